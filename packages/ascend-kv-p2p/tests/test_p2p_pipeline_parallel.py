# SPDX-License-Identifier: Apache-2.0
"""A pipeline-parallel P (``prefill.pp_size`` > 1) with MooncakeConnectorV1, at worker level.

Each P stage's workers register only their stage's layers (as vLLM gives them), each with
its own real Mooncake transfer engine session over TCP on loopback; D (one stage) reads
every layer from the stage that holds it, byte-exact, and every stage rank frees its lease.
Tested at worker level: an engine-level probe would need vLLM CPU to run
``pipeline_parallel_size=2`` P/D instances next to each other on this machine's two cores.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import (
    MooncakeLayerwiseConfig,
    MooncakeP2PConfig,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import (
    params_for_decode,
    parse_remote_prefill,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import worker_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import reader as pull_reader
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
    MooncakeConnectorMetadata,
    RecvMeta,
    SendMeta,
    expand_over_stages,
    stage_layers,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker

BS, NB, HEADS, HD = 16, 10, 2, 8


@pytest.fixture(params=["overlapped", "claims_first"])
def claim_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(pull_reader, "OVERLAP_MIN_CPUS",
                        0 if request.param == "overlapped" else 1 << 30)
    return str(request.param)


def _vllm_config(role: str, kv_port: int, *, tp: int, pp: int, layers: int) -> Any:
    kvc = SimpleNamespace(kv_port=kv_port, is_kv_producer=role == "kv_producer",
                          is_kv_consumer=role == "kv_consumer", kv_connector_extra_config={})
    return SimpleNamespace(
        kv_transfer_config=kvc,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, data_parallel_rank=0,
                                        pipeline_parallel_size=pp),
        cache_config=SimpleNamespace(block_size=BS),
        model_config=SimpleNamespace(model="/models/tiny", get_total_num_kv_heads=lambda: HEADS,
                                     hf_text_config=SimpleNamespace(num_hidden_layers=layers)))


def _worker(role: str, kv_port: int, cfg: dict[str, Any], *, tp: int = 1, pp: int = 1,
            tp_rank: int = 0, pp_rank: int = 0, layers: int = 8) -> PullWorker:
    return PullWorker(_vllm_config(role, kv_port, tp=tp, pp=pp, layers=layers),
                      MooncakeP2PConfig.from_dict(cfg), "P" if role == "kv_producer" else "D",
                      MetricsRecorder(P2P_METRICS), tp_rank=tp_rank, pp_rank=pp_rank)


def _caches(layers: range, *, tp: int, tp_rank: int, fill: bool) -> dict[str, torch.Tensor]:
    """CPU-layout caches of ``layers`` (global indices in the names), the heads of
    ``tp_rank``; with ``fill`` each element says (layer, block, head, position)."""
    per_rank = HEADS // tp
    out = {}
    for layer in layers:
        t = torch.zeros(NB, per_rank, BS, 2 * HD)
        if fill:
            for hi in range(per_rank):
                h = tp_rank * per_rank + hi
                t[:, hi] = (layer * 1e6 + h * 1e4
                            + torch.arange(NB).view(-1, 1, 1) * 1e2
                            + torch.arange(BS * 2 * HD).view(BS, 2 * HD) / 1e3)
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def _wait(pred: Any, what: str, timeout: float = 30.0) -> Any:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"{what} within {timeout}s")


def _pull(p_tp: int, partition: list[int] | None, layers: int, *,
          d_cfg: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]],
                                                          set[int], list[PullWorker]]:
    """P with 2 stages of ``p_tp`` ranks, D at TP 1 pulls one request; returns D's caches,
    P's caches by stage rank, the failed blocks and the workers (still running)."""
    p_cfg = {"prefill": {"pp_size": 2, "pp_layer_partition": partition}}
    if d_cfg is None:
        d_cfg = p_cfg
    p_port, d_port = free_port(), free_port()
    stages = stage_layers(layers, 2, partition)
    workers: list[PullWorker] = []
    caches_p: list[dict[str, Any]] = []
    for s, stage in enumerate(stages):
        for r in range(p_tp):
            w = _worker("kv_producer", p_port, p_cfg, tp=p_tp, pp=2, tp_rank=r, pp_rank=s,
                        layers=layers)
            workers.append(w)
            caches_p.append(_caches(stage, tp=p_tp, tp_rank=r, fill=True))
            w.register_kv_caches(caches_p[-1])
            assert w.port == worker_port(p_port, tp_rank=r, tp_size=p_tp, pp_rank=s)
    d = _worker("kv_consumer", d_port, d_cfg, layers=layers)
    workers.append(d)
    caches_d = _caches(range(layers), tp=1, tp_rank=0, fill=False)
    d.register_kv_caches(caches_d)
    p_blocks, d_blocks = [7, 2, 5], [1, 4, 0]
    for w in workers[:-1]:
        w.start_load_kv(MooncakeConnectorMetadata(requests_to_send={
            "req": SendMeta("req", p_blocks)}))
    params = params_for_decode(block_ids=p_blocks, engine_id="P", host="127.0.0.1",
                               port=p_port, request_id="req", tp_size=p_tp, last_token_id=1,
                               num_prompt_blocks=3)
    remote = parse_remote_prefill(params, prompt_len=3 * BS, block_size=BS)
    d.start_load_kv(MooncakeConnectorMetadata(requests={"req": RecvMeta(
        "req", d_blocks, remote, remote_block_ids=p_blocks)}))
    failed: set[int] = set()

    def loaded() -> bool:
        _s, recving = d.get_finished()
        failed.update(d.get_block_ids_with_load_errors())
        return bool(recving and "req" in recving)

    _wait(loaded, "D's load did not end")
    return caches_d, caches_p, failed, workers


@pytest.mark.parametrize(("p_tp", "partition", "layers"), [
    (1, [3, 5], 8),      # uneven, explicit
    (2, None, 7),        # vLLM's default split of 7 layers over 2 stages: [4, 3]
])
def test_d_reads_each_layer_from_the_stage_that_holds_it(
        claim_mode: str, p_tp: int, partition: list[int] | None, layers: int) -> None:
    caches_d, caches_p, failed, workers = _pull(p_tp, partition, layers)
    try:
        assert failed == set()
        stages = stage_layers(layers, 2, partition)
        for layer in range(layers):
            s = next(i for i, st in enumerate(stages) if layer in st)
            name = f"model.layers.{layer}.self_attn.attn"
            for lb, pb in zip([1, 4, 0], [7, 2, 5], strict=True):
                want = torch.cat([caches_p[s * p_tp + r][name][pb] for r in range(p_tp)])
                assert torch.equal(caches_d[name][lb], want), (name, lb)
        for w in workers[:-1]:  # every stage rank got its Done and freed the blocks
            _wait(lambda w=w: "req" in (w.get_finished()[0] or set()),
                  f"P stage {w.pp_rank} rank {w.tp_rank} never released the request")
            assert w.holder is not None and w.holder.held.get("req") is None
    finally:
        for w in workers:
            w.shutdown()


def test_a_d_configured_with_another_partition_fails_the_load_clearly(
        caplog: pytest.LogCaptureFixture) -> None:
    wrong = {"prefill": {"pp_size": 2, "pp_layer_partition": [4, 4]}}
    caches_d, _p, failed, workers = _pull(1, [3, 5], 8, d_cfg=wrong)
    try:
        assert failed == {1, 4, 0}
        assert not any(t.abs().sum() for t in caches_d.values())  # nothing read
        assert ("holds layers [0, 3) of a P with pp_size=2; D expected stage 0 with layers "
                "[0, 4)") in caplog.text
        assert "handshake_mismatch" in caplog.text
        for w in workers[:-1]:  # D gave every stage its blocks back
            _wait(lambda w=w: "req" in (w.get_finished()[0] or set()),
                  f"P stage {w.pp_rank} never released the request")
    finally:
        for w in workers:
            w.shutdown()


def test_a_d_not_told_of_ps_stages_fails_the_load_clearly(
        caplog: pytest.LogCaptureFixture) -> None:
    caches_d, _p, failed, workers = _pull(1, [3, 5], 8, d_cfg={})
    try:
        assert failed == {1, 4, 0}
        assert not any(t.abs().sum() for t in caches_d.values())
        assert "P runs 2 pipeline stages, but D was configured with prefill.pp_size=1" \
            in caplog.text
    finally:
        for w in workers:
            w.shutdown()


# ---------------------------------------------------------------- the layer -> stage mapping
@pytest.mark.parametrize(("layers", "pp"), [(8, 2), (7, 2), (10, 4), (61, 4), (5, 5), (3, 1)])
def test_the_default_split_is_vllms(layers: int, pp: int) -> None:
    from vllm.distributed.utils import get_pp_indices

    got = stage_layers(layers, pp)
    assert [(r.start, r.stop) for r in got] == [get_pp_indices(layers, s, pp)
                                                for s in range(pp)]


def test_an_explicit_partition_gives_contiguous_stages() -> None:
    assert stage_layers(8, 2, [3, 5]) == [range(3), range(3, 8)]


@pytest.mark.parametrize(("layers", "pp", "partition", "match"), [
    (8, 2, [3, 4], "adds up to 7 layers but the model has 8"),
    (8, 2, [8], "must have pp_size=2 positive entries"),
    (8, 2, [0, 8], "must have pp_size=2 positive entries"),
    (1, 2, None, "1 layers cannot be split over pp_size=2"),
])
def test_bad_partitions_are_refused(layers: int, pp: int, partition: list[int] | None,
                                    match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        stage_layers(layers, pp, partition)
    assert info.value.key.startswith("prefill.pp_")


def test_the_plan_names_every_stage_rank() -> None:
    from vllm_ascend.distributed.kernels.heads import plan_head_slices

    plan = plan_head_slices(4, 2, 1, 0)
    out, readers = expand_over_stages(plan, {0: 1, 1: 1}, tp_size=2, pp_size=3)
    assert sorted({s.remote_rank for s in out}) == [0, 1, 2, 3, 4, 5]
    assert readers == {r: 1 for r in range(6)}
    assert expand_over_stages(plan, {0: 1}, tp_size=2, pp_size=1) == (tuple(plan), {0: 1})


# ---------------------------------------------------------------- refused at start-up
def test_a_d_whose_layers_do_not_add_up_to_the_partition_is_refused() -> None:
    d = _worker("kv_consumer", free_port(), {"prefill": {"pp_size": 2,
                                                         "pp_layer_partition": [3, 4]}})
    try:
        with pytest.raises(ConfigError, match="adds up to 7 layers but the model has 8"):
            d.register_kv_caches(_caches(range(8), tp=1, tp_rank=0, fill=False))
    finally:
        d.shutdown()


def test_a_p_stage_whose_layers_are_not_its_partition_is_refused() -> None:
    w = _worker("kv_producer", free_port(), {"prefill": {"pp_size": 2,
                                                         "pp_layer_partition": [3, 5]}},
                pp=2, pp_rank=1)
    try:
        with pytest.raises(ConfigError, match=r"stage 1 holds layers \[4, 5, 6, 7\]"):
            w.register_kv_caches(_caches(range(4, 8), tp=1, tp_rank=0, fill=False))
    finally:
        w.shutdown()


def test_a_pp_p_without_prefill_pp_size_is_refused() -> None:
    with pytest.raises(ConfigError, match="prefill.pp_size=1") as info:
        _worker("kv_producer", free_port(), {}, pp=2)
    assert info.value.key == "prefill.pp_size"


def test_a_pp_d_is_refused() -> None:
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2 is not supported on a "
                                          "kv_consumer"):
        _worker("kv_consumer", free_port(), {"prefill": {"pp_size": 2}}, pp=2)
    with pytest.raises(ConfigError, match="decode.pp_size must be 1"):
        MooncakeP2PConfig.from_dict({"decode": {"pp_size": 2}})


def test_the_layerwise_connector_refuses_a_pp_prefill() -> None:
    with pytest.raises(ConfigError, match="MooncakeLayerwiseConnector") as info:
        MooncakeLayerwiseConfig.from_dict({"prefill": {"pp_size": 2}})
    assert info.value.key.endswith("prefill.pp_size")


def test_a_pp_p_whose_ranks_listen_on_several_hosts_is_refused() -> None:
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.scheduler import PullScheduler

    sched = PullScheduler(_vllm_config("kv_producer", free_port(), tp=2, pp=2, layers=8),
                          MooncakeP2PConfig.from_dict({"prefill": {"pp_size": 2}}), "P")
    sched.rank_hosts = {0: "127.0.0.1", 1: "127.0.0.1"}  # one host: served
    assert sched.rank_hosts == {0: "127.0.0.1", 1: "127.0.0.1"}
    with pytest.raises(ConfigError, match="listen on several hosts"):
        sched.rank_hosts = {0: "127.0.0.2", 1: "127.0.0.3"}


def test_the_connector_takes_every_stages_handshake_metadata() -> None:
    """vLLM hands a PP engine's handshake metadata keyed by (pp rank, tp rank); its default
    refuses any stage above 0. Stages on one host name their TP ranks' host; stages on
    several hosts are refused, naming them."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.connector import MooncakeConnector
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.scheduler import PullScheduler
    from vllm_ascend.distributed.kv_transfer.kv_p2p.rank_hosts import RankAddress

    sched = PullScheduler(_vllm_config("kv_producer", free_port(), tp=2, pp=2, layers=8),
                          MooncakeP2PConfig.from_dict({"prefill": {"pp_size": 2}}), "P")
    conn = object.__new__(MooncakeConnector)  # the scheduler side alone
    conn.connector_scheduler = sched
    conn.set_xfer_handshake_metadata_pp_aware({
        (pp, tp): RankAddress("10.0.0.7", 5000 + 2 * pp + tp, tp)
        for pp in range(2) for tp in range(2)})
    assert sched.rank_hosts == {0: "10.0.0.7", 1: "10.0.0.7"}
    with pytest.raises(ConfigError, match=r"listen on several hosts \(\['10.0.0.7', '10.0.0.8'\]"):
        conn.set_xfer_handshake_metadata_pp_aware({
            (0, 0): RankAddress("10.0.0.7", 5000, 0), (0, 1): RankAddress("10.0.0.7", 5001, 1),
            (1, 0): RankAddress("10.0.0.8", 5002, 0), (1, 1): RankAddress("10.0.0.8", 5003, 1)})
