# SPDX-License-Identifier: Apache-2.0
"""MooncakeConnectorV1 under vLLM's hybrid KV cache manager (a sliding-window group and a
full-attention group): what P holds and says, what D pairs, inside vLLM's real Scheduler and
block pool; and the pieces (``pull.groups``, ``remote_block_groups``, aliased tensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.core.kv_groups import MOVABLE_KINDS, KVGroups
from vllm_ascend.distributed.kv_transfer.core.layout import KVCacheLayout
from vllm_ascend.distributed.kv_transfer.kv_p2p import register
from vllm_ascend.distributed.kv_transfer.kv_p2p.errors import KVParamsError
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import parse_remote_prefill
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.groups import (
    pair_blocks,
    predicted_claim,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.holder import _in_order

BS = 32
WINDOW = 64
NUM_BLOCKS = 96
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def hybrid_config(*, window: int = WINDOW) -> KVCacheConfig:
    swa = SlidingWindowSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32,
                            sliding_window=window)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([LAYERS[0]], swa), KVCacheGroupSpec([LAYERS[1]], full)])


GROUPS = KVGroups.from_config(hybrid_config())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ascend_kv_testing.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("model"))


def make_scheduler(model_dir: Path, role: str, kcc: KVCacheConfig | None = None) -> Scheduler:
    register()
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                     max_model_len=1024, enforce_eager=True, seed=0)
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                         max_model_len=1024, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeConnectorV1", kv_role=role, engine_id=f"engine-{role}",
            kv_load_failure_policy="fail", kv_connector_extra_config={"lease_ttl_s": 30}),
        device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    return Scheduler(vc, kcc or hybrid_config(), StructuredOutputManager(vc), block_size=BS,
                     log_stats=True)


def request(rid: str, n_tokens: int, kv: dict[str, Any] | None, max_tokens: int = 4) -> Request:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                        extra_args={"kv_transfer_params": kv} if kv is not None else None)
    return Request(rid, list(range(100, 100 + n_tokens)), sp, None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def step(s: Scheduler, *, kv: KVConnectorOutput | None = None) -> tuple[Any, dict[int, Any]]:
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[7] for _ in ids], kv_connector_output=kv)
    return out, s.update_from_output(out, mro)


def finished(engine_outputs: dict[int, Any]) -> dict[str, Any]:
    return {o.request_id: o for outs in engine_outputs.values() for o in outs.outputs
            if o.finish_reason is not None}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- inside vLLM's scheduler
def test_p_leaves_the_last_token_and_says_each_groups_run(model_dir: Path) -> None:
    s = make_scheduler(model_dir, "kv_producer")
    req = request("p1", 200, {"do_remote_decode": True, "do_remote_prefill": False},
                  max_tokens=1)
    s.add_request(req)
    assert req.num_prompt_tokens == 199  # D computes the last prompt token
    out, eo = step(s)
    assert out.num_scheduled_tokens["p1"] == 199
    params = finished(eo)["p1"].kv_transfer_params
    runs = params["remote_block_groups"]
    # vLLM freed the window's blocks wholly before the window of the token after the 199
    # computed; P holds the rest of that group and every block of the full group
    full, first_kept = cdiv(199, BS), (199 - WINDOW + 1) // BS
    assert first_kept > 0 and runs == [[first_kept, full - first_kept], [0, full]]
    assert len(params["remote_block_ids"]) == 2 * full - first_kept
    assert len(set(params["remote_block_ids"])) == len(params["remote_block_ids"])
    sends = step(s)[0].kv_connector_metadata.requests_to_send
    assert sends["p1"].block_ids == params["remote_block_ids"] and sends["p1"].in_order


def test_d_pairs_the_blocks_its_manager_keeps(model_dir: Path) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    n = 200
    loaded = n - 1
    full = cdiv(loaded, BS)
    first_kept = (loaded - WINDOW + 1) // BS  # the window's blocks wholly before it are freed
    runs = [[0, full], [0, full]]
    remote = list(range(500, 500 + 2 * full))
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": remote,
              "remote_block_groups": runs, "remote_engine_id": "engine-p",
              "remote_host": "127.0.0.1", "remote_port": 30000, "remote_request_id": "p-req",
              "remote_tp_size": 1}
    req = request("d1", n, params)
    s.add_request(req)
    out, _ = step(s)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    m = out.kv_connector_metadata.requests["d1"]
    assert m.error is None
    # the window's group: positions first_kept.. of P's first run; the full group: all of it
    assert m.remote_block_ids == remote[first_kept:full] + remote[full:]
    swa, fa = s.kv_cache_manager.get_block_ids("d1")
    assert m.local_block_ids == swa[first_kept:full] + fa[:full]
    assert 0 not in m.local_block_ids
    # a failed load is reported by request (block ids mean nothing across groups)
    _o, eo = step(s, kv=KVConnectorOutput(finished_recving={"d1"}, failed_recving={"d1"}))
    assert "d1" in finished(eo)


def test_d_with_one_group_refuses_ps_groups_and_releases_p(model_dir: Path) -> None:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    one = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), full)])
    s = make_scheduler(model_dir, "kv_consumer", one)
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_block_ids": list(range(10, 18)), "remote_block_groups": [[0, 4], [0, 4]],
              "remote_engine_id": "engine-p", "remote_host": "127.0.0.1", "remote_port": 30000,
              "remote_request_id": "p-req", "remote_tp_size": 1}
    s.add_request(request("d2", 120, params))
    m = step(s)[0].kv_connector_metadata.requests["d2"]
    assert m.error and "KV cache group" in m.error and m.release_on_error


def test_hybrid_d_refuses_params_of_one_group(model_dir: Path) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_block_ids": [10, 11, 12, 13], "remote_engine_id": "engine-p",
              "remote_host": "127.0.0.1", "remote_port": 30000, "remote_request_id": "p-req",
              "remote_tp_size": 1}
    s.add_request(request("d3", 120, params))
    m = step(s)[0].kv_connector_metadata.requests["d3"]
    assert m.error and "same model and the hybrid KV cache manager" in m.error
    assert m.release_on_error and 0 not in m.local_block_ids


# ---------------------------------------------------------------- pull.groups
def test_runs_skip_the_freed_head_of_a_window() -> None:
    held, runs = GROUPS.runs(([0, 0, 7, 8, 9], [1, 2, 3, 4, 5, 6]), 150)
    assert held == [7, 8, 9, 1, 2, 3, 4, 5] and runs == [(2, 3), (0, 5)]
    with pytest.raises(ValueError, match="freed block"):
        GROUPS.runs(([0, 7, 0, 9, 10], [1, 2, 3, 4, 5]), 150)
    with pytest.raises(ValueError, match="lists of block ids"):
        GROUPS.runs(([1, 2],), 40)


def test_pair_blocks_by_position_and_refuse_a_window_p_freed() -> None:
    runs = [(2, 3), (0, 5)]
    remote = [7, 8, 9, 1, 2, 3, 4, 5]
    local = ([0, 0, 0, 40, 41], [50, 51, 52, 53, 54])
    span = {"computed_tokens": 0, "total_tokens": 5 * BS}
    mine, theirs = pair_blocks(GROUPS, runs, remote, local, **span)
    assert mine == [40, 41, 50, 51, 52, 53, 54] and theirs == [8, 9, 1, 2, 3, 4, 5]
    # D's own prefix covers the first 4 blocks: only the last of each group moves
    assert pair_blocks(GROUPS, runs, remote, local, computed_tokens=4 * BS,
                       total_tokens=5 * BS) == ([41, 54], [9, 5])
    with pytest.raises(ValueError, match="windows differ"):
        pair_blocks(GROUPS, runs, remote, ([0, 39, 0, 40, 41], local[1]), **span)
    with pytest.raises(ValueError, match="KV cache groups"):
        pair_blocks(GROUPS, runs[:1], remote, local, **span)


@pytest.mark.parametrize("n", [40, 64, 65, 128, 129, 159, 160, 300])
def test_the_claim_sent_ahead_is_what_d_pairs(n: int) -> None:
    loaded = n - 1
    full = cdiv(loaded, BS)
    runs = [(0, full), (0, full)]
    remote = list(range(100, 100 + 2 * full))
    first_kept = GROUPS.groups[0].first_kept(loaded)
    local = ([0] * first_kept + list(range(200, 200 + full - first_kept)),
             list(range(300, 300 + full)))
    _mine, theirs = pair_blocks(GROUPS, runs, remote, local, computed_tokens=0,
                                total_tokens=loaded)
    assert predicted_claim(GROUPS, runs, remote, computed_tokens=0,
                           total_tokens=loaded) == theirs


# ---------------------------------------------------------------- params, holder, layout
def test_remote_block_groups_are_checked() -> None:
    base = {"remote_engine_id": "p", "remote_host": "h", "remote_port": 1,
            "remote_request_id": "r", "remote_block_ids": [1, 2, 3, 4]}
    ok = parse_remote_prefill({**base, "remote_block_groups": [[0, 2], [0, 2]]},
                              prompt_len=64, block_size=BS)
    assert ok.block_groups == ((0, 2), (0, 2))
    # P computed all but the last token: runs may end one block short at k*block+1
    parse_remote_prefill({**base, "remote_block_groups": [[0, 2], [0, 2]]}, prompt_len=65,
                         block_size=BS)
    for bad in ([[0, 2]], [[0, 3], [0, 1]], [[0, 2], [1, 3]], [[0, "2"], [0, 2]], "x",
                [[-1, 3], [0, 2]], [[0, 2], [0, 1]]):
        with pytest.raises(KVParamsError, match="remote_block_groups"):
            parse_remote_prefill({**base, "remote_block_groups": bad}, prompt_len=64,
                                 block_size=BS)


def test_holder_takes_a_claim_in_order_only() -> None:
    held = [7, 8, 9, 1, 2, 3]
    assert _in_order([8, 9, 2, 3], held) and _in_order([], held)
    assert not _in_order([9, 8], held) and not _in_order([4], held)


def test_layers_sharing_a_tensor_are_moved_once() -> None:
    shared = torch.zeros(NUM_BLOCKS, BS, 2, 128)
    other = torch.zeros(NUM_BLOCKS, BS, 2, 128)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    layout = KVCacheLayout.from_kv_caches(
        {names[0]: shared, names[1]: shared, names[2]: other, names[3]: other}, block_size=BS)
    assert [x.name for x in layout.layers] == [names[0], names[2]]
    assert layout.aliases == {names[1]: names[0], names[3]: names[2]}
    assert layout.block_bytes == 2 * BS * 2 * 128 * 4


def test_groups_refuse_what_cannot_move() -> None:
    assert GROUPS.hybrid and GROUPS.has_window and GROUPS.leaves_last_token
    assert GROUPS.signature() == [f"sliding/{BS}/w{WINDOW}:{LAYERS[0]}", f"full/{BS}:{LAYERS[1]}"]
    GROUPS.refuse_unsupported("X")
    mamba = MambaSpec(block_size=BS, shapes=((16,),), dtypes=(torch.float32,))
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([LAYERS[0]], mamba),
        KVCacheGroupSpec([LAYERS[1]], hybrid_config().kv_cache_groups[1].kv_cache_spec)])
    state = KVGroups.from_config(cfg)
    assert state.has_state and state.leaves_last_token
    # the state is the block at the group's last position
    assert [state.groups[0].first_kept(n) for n in (1, BS, BS + 1, 5 * BS)] == [0, 0, 1, 4]
    state.refuse_unsupported("X", kinds=MOVABLE_KINDS)  # the pull moves it
    with pytest.raises(ConfigError, match="MambaSpec"):
        state.refuse_unsupported("X")  # the token kinds only, by default
    assert not KVGroups.from_config(None).hybrid


def test_a_state_layer_within_an_attention_layers_pages_is_moved_with_them() -> None:
    """vLLM puts a state-space layer's conv and SSM state in the pages of an attention
    layer's tensor (Qwen3-Next on vLLM CPU: a 32 KiB page, conv at 0, SSM state at 1,536)."""
    page = torch.zeros(NUM_BLOCKS, 4, BS, 128, dtype=torch.bfloat16)  # 32 KiB a block
    flat = page.view(NUM_BLOCKS, -1)
    conv = flat[:, :768].view(NUM_BLOCKS, 3, 256)
    ssm = flat[:, 768:768 + 2 * 64 * 64].view(NUM_BLOCKS, 2, 64, 64)
    names = ["model.layers.0.linear_attn", "model.layers.1.self_attn.attn"]
    layout = KVCacheLayout.from_kv_caches({names[0]: (conv, ssm), names[1]: page},
                                          block_size=BS)
    assert [x.name for x in layout.layers] == [names[1]] and layout.aliases == {names[0]: names[1]}
    # a tensor outside every page is still a layout error
    with pytest.raises(Exception, match="layout"):
        KVCacheLayout.from_kv_caches({names[0]: (torch.zeros(NUM_BLOCKS, 3, 7),),
                                      names[1]: page}, block_size=BS)
