# SPDX-License-Identifier: Apache-2.0
"""An instance whose TP ranks live on different hosts: each rank publishes its own address
(vLLM's handshake-metadata path), the scheduler posts them in
``remote_multi_nodes_meta_mapping``, and the peer dials each rank where it lives.

The "hosts" are distinct loopback addresses (127.0.0.2, 127.0.0.3): one vLLM CPU engine
cannot place its TP workers in different network namespaces (its executor spawns them on
this host, sharing one environment), so the ranks are built as workers here, each with its
own ``VLLM_ASCEND_KV_HOST`` as on its own node, with the real side channels and the real
Mooncake transfer engine. Nothing listens on the scheduler's address at the ranks' ports:
a push that ignored the mapping would fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_p2p_layerwise_scheduler import Metaserver, d_params, make_scheduler, model_dir, step
from test_p2p_layerwise_worker import (
    d_expect,
    expected_block,
    make_caches,
    new_worker,
    p_step,
    wait_recv,
)

from vllm_ascend.distributed.kv_transfer.core.net import HOST_ENV_VARS, free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.errors import KVParamsError
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.contract import PushReq
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import parse_push_target
from vllm_ascend.distributed.kv_transfer.kv_p2p.rank_hosts import (
    MULTI_NODES_KEY,
    RankAddress,
    hosts_of,
    parse_rank_hosts,
)

__all__ = ["model_dir"]  # the fixture, imported for this module's tests

BS = 16
RANK_HOSTS = {0: "127.0.0.2", 1: "127.0.0.3"}


def at_host(monkeypatch: pytest.MonkeyPatch, host: str) -> None:
    for var in HOST_ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(HOST_ENV_VARS[0], host)


def test_p_pushes_to_d_ranks_on_their_own_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    p_port, d_port = free_port(), free_port()
    d_workers = []
    try:
        for rank, host in RANK_HOSTS.items():
            at_host(monkeypatch, host)  # as on the rank's own node
            d_workers.append(new_worker("kv_consumer", d_port, 2, rank, "D"))
        at_host(monkeypatch, "127.0.0.1")
        p = new_worker("kv_producer", p_port, 1, 0, "P")
        d_workers.append(p)  # closed with the others
        caches_p = [make_caches("cpu", 1, 0, fill=True)]
        p.register_kv_caches(caches_p[0])
        caches_d = [make_caches("cpu", 2, r, fill=False) for r in RANK_HOSTS]
        for w, c in zip(d_workers[:2], caches_d, strict=True):
            w.register_kv_caches(c)
        published = {w.tp_rank: RankAddress(host=w.host, port=w.port, tp_rank=w.tp_rank)
                     for w in d_workers[:2]}
        assert hosts_of(published) == RANK_HOSTS
        # what D's scheduler posts (its own host is 127.0.0.1, where no rank listens)
        params = {"remote_engine_id": "D", "remote_host": "127.0.0.1", "remote_port": d_port,
                  "remote_request_id": "r", "remote_tp_size": 2, "remote_block_ids": [1, 5],
                  "remote_block_size": BS, "remote_cached_tokens": 0,
                  MULTI_NODES_KEY: {str(r): {"host": h, "engine_id": "D"}
                                    for r, h in RANK_HOSTS.items()}}
        tgt = parse_push_target(params, prompt_len=2 * BS, block_size=BS)
        assert tgt.rank_hosts == RANK_HOSTS and tgt.host_of(1) == "127.0.0.3"
        for w in d_workers[:2]:
            d_expect(w, "r", [1, 5])
        p_step([p], caches_p, {"r": PushReq("r", tgt, [0, 1], [7, 3], last=True)})
        for w in d_workers[:2]:
            assert wait_recv(w, "r") == set()
        for d_rank, cache in enumerate(caches_d):
            for name, value in cache.items():
                for db, pb in ((1, 7), (5, 3)):
                    want = expected_block(caches_p, "cpu", 1, 2, d_rank, name, pb)
                    torch.testing.assert_close(value[db], want, rtol=0, atol=0)
    finally:
        for w in d_workers:
            w.shutdown()


def test_without_the_mapping_the_push_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same D ranks, P told only ``remote_host``: it cannot reach them, and says so."""
    from test_p2p_layerwise_worker import target

    p_port, d_port = free_port(), free_port()
    workers = []
    try:
        at_host(monkeypatch, RANK_HOSTS[0])
        d = new_worker("kv_consumer", d_port, 1, 0, "D", {"load_timeout_s": 3.0})
        workers.append(d)
        d.register_kv_caches(make_caches("cpu", 1, 0, fill=False))
        at_host(monkeypatch, "127.0.0.1")
        p = new_worker("kv_producer", p_port, 1, 0, "P", {"handshake_timeout_s": 1.0,
                                                           "push_retry": {"deadline_s": 0.5}})
        workers.append(p)
        cp = make_caches("cpu", 1, 0, fill=True)
        p.register_kv_caches(cp)
        d_expect(d, "r", [1, 2])
        p_step([p], [cp], {"r": PushReq("r", target(d_port, "r", [1, 2]), [0, 1], [4, 5],
                                        last=True)})
        assert wait_recv(d, "r", timeout=15) == {1, 2}  # failed at D's deadline, not hung
        failures = {k: v for k, v in p.recorder.totals().items() if "p2p_failures" in str(k)}
        assert sum(failures.values()) >= 1, p.recorder.totals()
    finally:
        for w in workers:
            w.shutdown()


def test_d_scheduler_posts_its_ranks_hosts(model_dir: Path, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    server = Metaserver()
    try:
        s = make_scheduler(model_dir, "kv_consumer")
        conn = s.get_kv_connector()
        me = conn.connector_scheduler.host
        assert conn.connector_scheduler.published_hosts is None  # nothing passed yet
        conn.set_xfer_handshake_metadata({0: RankAddress(me, 1, 0),
                                          1: RankAddress("10.1.2.3", 2, 1)})
        # every rank as published (what the uneven-TP engine test checks)
        assert conn.connector_scheduler.published_hosts == {0: me, 1: "10.1.2.3"}
        from test_p2p_layerwise_scheduler import request

        s.add_request(request("d1", 40, d_params(server.url)))
        step(s)
        post = server.wait_posts(1)[0]
        # only the rank away from the scheduler's host is named
        assert post[MULTI_NODES_KEY] == {"1": {"host": "10.1.2.3",
                                               "engine_id": "engine-kv_consumer"}}
    finally:
        server.close()


@pytest.mark.parametrize(("mapping", "match"), [
    ("10.0.0.1", "must be an object"),
    ({"x": {"host": "a"}}, "keys are TP ranks"),
    ({"2": {"host": "a"}}, "names rank 2 of an instance of TP size 2"),
    ({"0": {"host": 5}}, "'host' string"),
    ({"0": "10.0.0.1"}, "'host' string"),
])
def test_a_malformed_mapping_is_a_clear_error(mapping: Any, match: str) -> None:
    with pytest.raises(KVParamsError, match=match):
        parse_rank_hosts({MULTI_NODES_KEY: mapping}, tp_size=2)
    assert parse_rank_hosts({}, tp_size=2) == {}


# ---------------------------------------------------------------- pull: P ranks on two hosts
def test_d_pulls_from_p_ranks_on_their_own_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    import test_p2p_pull_worker as pw

    from vllm_ascend.distributed.kv_transfer.kv_p2p.params import (
        params_for_decode,
        parse_remote_prefill,
    )
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
        MooncakeConnectorMetadata,
        RecvMeta,
        SendMeta,
    )

    p_port, d_port = free_port(), free_port()
    workers = []
    try:
        for rank, host in RANK_HOSTS.items():  # P TP=2, one rank per "node"
            at_host(monkeypatch, host)
            workers.append(pw.new_worker("kv_producer", p_port, 2, rank, "P"))
        at_host(monkeypatch, "127.0.0.1")
        d = pw.new_worker("kv_consumer", d_port, 1, 0, "D")
        workers.append(d)
        caches_p = [pw.make_caches("cpu", 2, r, fill=True) for r in RANK_HOSTS]
        caches_d = pw.make_caches("cpu", 1, 0, fill=False)
        for w, c in zip(workers[:2], caches_p, strict=True):
            w.register_kv_caches(c)
        d.register_kv_caches(caches_d)
        p_blocks, d_blocks = [7, 2], [1, 4]
        for w in workers[:2]:
            w.start_load_kv(MooncakeConnectorMetadata(requests_to_send={
                "req-p": SendMeta("req-p", p_blocks)}))
        published = hosts_of({w.tp_rank: RankAddress(w.host, w.port, w.tp_rank)
                              for w in workers[:2]})
        params = params_for_decode(block_ids=p_blocks, engine_id="P", host="127.0.0.1",
                                   port=p_port, request_id="req-p", tp_size=2,
                                   last_token_id=1, num_prompt_blocks=2, rank_hosts=published)
        assert params[MULTI_NODES_KEY] == {"0": {"host": "127.0.0.2", "engine_id": "P"},
                                           "1": {"host": "127.0.0.3", "engine_id": "P"}}
        remote = parse_remote_prefill(params, prompt_len=2 * pw.BS, block_size=pw.BS)
        assert remote.host_of(1) == "127.0.0.3"
        d.start_load_kv(MooncakeConnectorMetadata(requests={"req-d": RecvMeta(
            "req-d", d_blocks, remote, remote_block_ids=p_blocks)}))
        assert pw.wait_recv(d, "req-d") == set()
        pw.wait_sent(workers[:2], "req-p")
        for layer, value in caches_d.items():
            for lb, pb in zip(d_blocks, p_blocks, strict=True):
                want = pw.expected_d_block(caches_p, "cpu", 2, 1, 0, layer, pb)
                torch.testing.assert_close(value[lb], want, rtol=0, atol=0)
    finally:
        for w in workers:
            w.shutdown()


def test_a_p_without_published_hosts_names_rank_0_at_its_host() -> None:
    from vllm_ascend.distributed.kv_transfer.kv_p2p.params import (
        params_for_decode,
        parse_remote_prefill,
    )

    params = params_for_decode(block_ids=[3], engine_id="P", host="10.0.0.9", port=20000,
                               request_id="q", tp_size=2, last_token_id=1, num_prompt_blocks=1)
    assert params[MULTI_NODES_KEY] == {"0": {"host": "10.0.0.9", "engine_id": "P"}}
    remote = parse_remote_prefill(params, prompt_len=5, block_size=16)
    assert remote.host_of(0) == remote.host_of(1) == "10.0.0.9"
