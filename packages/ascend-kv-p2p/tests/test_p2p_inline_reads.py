# SPDX-License-Identifier: Apache-2.0
"""``inline_reads``: D starts a window read on the caller's thread and polls its end.

Real P and D pull workers (side channels, the real transfer engine on loopback, same-host
reads off so that bytes go through the engine). The read of a request inside P's read
window goes out from ``start_load_kv`` and ends in ``get_finished``; one that ended after
the window, or failed, is pulled again on a pull thread (claimed first once the window is
over); anything else takes the pull threads as without the option. A P with a deployment key
tells D where a request's blocks are only in a claim's grant: its loads are claimed first, on
a pull thread, never read inline.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from p2p_worker_harness import numbered_caches, pd_vllm_config, set_retry

from ascend_kv_testing.keys import set_deployment_key
from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.channel import tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.local_reads import LOCAL_READS_ENV
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import RemotePrefill
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import Claim, worker_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import inline as pull_inline
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
    CLOCK_SKEW_S,
    MooncakeConnectorMetadata,
    RecvMeta,
    SendMeta,
    window_end,
    window_tag,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker

BS, NB, HEADS, HD, LAYERS = 16, 8, 2, 8, 2
KEY = "deployment-key-for-the-inline-read-tests-0001"
WINDOW_S = 2.0


def _worker(role: str, port: int, instance: str, cfg: dict[str, Any]) -> PullWorker:
    vc = pd_vllm_config(role, port, block_size=BS, heads=HEADS)
    vc.instance_id = instance
    return PullWorker(vc, MooncakeP2PConfig.from_dict(cfg), role[3].upper(),
                      MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)


def _caches(fill: bool) -> dict[str, Any]:
    return numbered_caches(fill, layers=LAYERS, blocks=NB, heads=HEADS, block_size=BS,
                           head_size=HD)


def make_pd(monkeypatch: pytest.MonkeyPatch, keyed: bool) -> Any:
    monkeypatch.setenv(LOCAL_READS_ENV, "0")
    set_deployment_key(monkeypatch, KEY if keyed else None)
    p_port = free_port()
    p = _worker("kv_producer", p_port, "1001", {"lease_ttl_s": 30.0, "read_window_s": WINDOW_S})
    cp = _caches(True)
    p.register_kv_caches(cp)
    d = _worker("kv_consumer", free_port(), "2002", {"load_timeout_s": 10.0,
                                                     "inline_reads": True})
    cd = _caches(False)
    d.register_kv_caches(cd)
    ns = SimpleNamespace(p=p, d=d, cp=cp, cd=cd, p_port=p_port, claims=[], pulls=[],
                         keyed=keyed)
    assert p.holder is not None and p.holder.server is not None and d.reader is not None
    handle = p.holder.handle

    def spy(msg: Any) -> Any:
        if isinstance(msg, Claim):
            ns.claims.append(msg.request_id)
        return handle(msg)

    p.holder.server.handler = spy
    pull = d.reader._pull

    def logged_pull(meta: RecvMeta) -> None:  # a pull thread took the load
        ns.pulls.append(meta.request_id)
        pull(meta)

    d.reader._pull = logged_pull  # type: ignore[method-assign]
    return ns


@pytest.fixture
def pd(monkeypatch: pytest.MonkeyPatch) -> Any:
    ns = make_pd(monkeypatch, False)
    try:
        yield ns
    finally:
        ns.p.shutdown()
        ns.d.shutdown()
        monkeypatch.setattr(auth, "_cached", None)


def hold(pd: Any, rid: str, src: list[int], *, age_s: float = 0.0) -> RemotePrefill:
    """P's scheduler stamps the params ``age_s`` ago and its worker holds ``src``."""
    token = auth.capability_token()
    held_at = time.time() - age_s
    pd.p.start_load_kv(MooncakeConnectorMetadata(
        requests_to_send={rid: SendMeta(rid, src, token)}))
    hold_s = pd.p.cfg.hold_window_s
    return RemotePrefill(engine_id="P", host="127.0.0.1", port=pd.p_port, request_id=rid,
                         block_ids=src, tp_size=1, pcp_size=1, dcp_size=1, token=token,
                         instance=pd.p.instance, held_at=held_at, hold_s=hold_s,
                         window_tag=window_tag(instance=pd.p.instance, request_id=rid,
                                               block_ids=src, held_at=held_at, hold_s=hold_s,
                                               token=token))


def start(pd: Any, rid: str, remote: RemotePrefill, local: list[int]) -> None:
    pd.d.start_load_kv(MooncakeConnectorMetadata(requests={rid: RecvMeta(
        rid, local, remote, remote_block_ids=remote.block_ids)}))


def finish(pd: Any, rid: str, remote: RemotePrefill, local: list[int],
           timeout: float = 20.0) -> None:
    """Poll D's ``get_finished`` (as vLLM does) until ``rid`` ended; check it loaded P's
    blocks."""
    deadline = time.monotonic() + timeout
    while True:
        _s, recving = pd.d.get_finished(idle=True)
        if recving and rid in recving:
            break
        assert time.monotonic() < deadline, f"{rid} did not end"
    assert pd.d.get_block_ids_with_load_errors() == set()
    for name, value in pd.cd.items():
        torch.testing.assert_close(value[local], pd.cp[name][remote.block_ids], rtol=0, atol=0)


def warm_up(pd: Any) -> None:
    """D's first request goes to a pull thread: D has no metadata of P yet."""
    remote = hold(pd, "warm", [0])
    start(pd, "warm", remote, [0])
    assert len(pd.d.reader.inline) == 0
    finish(pd, "warm", remote, [0])
    assert pd.pulls == ["warm"]
    pd.claims.clear()


def test_a_window_read_goes_out_from_start_load_kv_and_ends_in_get_finished(pd: Any) -> None:
    warm_up(pd)
    rec = pd.d.recorder
    before = (rec.total("p2p_window_reads"), rec.total("p2p_transfer_bytes"))
    remote = hold(pd, "a", [3, 5])
    start(pd, "a", remote, [1, 2])
    assert len(pd.d.reader.inline) == 1  # in flight until get_finished sees its end
    finish(pd, "a", remote, [1, 2])
    assert pd.pulls == ["warm"] and pd.claims == []  # no pull thread, no claim
    block_bytes = pd.d.layout.block_bytes
    assert rec.total("p2p_window_reads") == before[0] + 1
    assert rec.total("p2p_inline_reads") == 1
    assert rec.total("p2p_transfer_bytes") == before[1] + 2 * block_bytes
    # D's Done went out once vLLM collected the load: P frees the blocks after its window
    deadline = time.monotonic() + 15
    while "a" not in (pd.p.get_finished()[0] or set()):
        assert time.monotonic() < deadline, "P kept the blocks"
        time.sleep(0.05)
    assert pd.p.recorder.total("p2p_requests_served") == 2
    assert pd.p.recorder.total("p2p_late_completions") == 0
    # wait_loads (benchmarks, tests) polls the reads started here too
    remote = hold(pd, "b", [6])
    start(pd, "b", remote, [7])
    assert pd.d.wait_loads(["b"], timeout=20)
    assert pd.d.get_finished()[1] == {"b"} and pd.pulls == ["warm"]


def test_a_read_seen_after_the_window_is_claimed_and_read_again_on_a_pull_thread(
        pd: Any) -> None:
    warm_up(pd)
    remote = hold(pd, "old", [2], age_s=WINDOW_S - CLOCK_SKEW_S - 0.3)
    start(pd, "old", remote, [4])
    assert len(pd.d.reader.inline) == 1
    while time.time() <= window_end(remote) + 0.05:  # vLLM polls only after the window
        time.sleep(0.05)
    finish(pd, "old", remote, [4])
    assert pd.pulls == ["warm", "old"] and pd.claims == ["old"]
    assert pd.d.recorder.total("p2p_window_reads") == 1  # the warm-up's


def test_the_worker_reads_on_the_scheduler_s_verdict_and_claims_when_the_clock_passed_it(
        pd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """With D's scheduler's verdict on P's window in the request (RecvMeta.window_until)
    the worker does not check P's tag again, inline or on a pull thread; a verdict the clock
    has passed (the request waited) is not trusted: the load is claimed on a pull thread."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import contract as pull_window

    warm_up(pd)
    fresh, stale = hold(pd, "v", [3]), hold(pd, "s", [4])
    until = window_end(fresh)
    checked: list[str] = []
    monkeypatch.setattr(pull_window, "tag_ok", lambda r: checked.append(r.request_id))
    pd.d.start_load_kv(MooncakeConnectorMetadata(requests={"v": RecvMeta(
        "v", [1], fresh, remote_block_ids=fresh.block_ids, window_until=until)}))
    assert len(pd.d.reader.inline) == 1
    finish(pd, "v", fresh, [1])
    pd.d.start_load_kv(MooncakeConnectorMetadata(requests={"s": RecvMeta(
        "s", [2], stale, remote_block_ids=stale.block_ids, window_until=time.time() - 0.01)}))
    assert len(pd.d.reader.inline) == 0
    finish(pd, "s", stale, [2])
    assert checked == []
    assert pd.pulls == ["warm", "s"] and pd.claims == ["s"]


def misplace_p_regions(pd: Any) -> None:
    """Make D's knowledge of P's regions wrong (as after P re-registered its cache)."""
    d = pd.d
    endpoint = tcp_endpoint("127.0.0.1", worker_port(pd.p_port, tp_rank=0, tp_size=1))
    good = d._remote_meta[endpoint]
    d._remote_meta[endpoint] = msgspec.structs.replace(
        good, region_addrs=[a + (1 << 44) for a in good.region_addrs])


def test_a_failed_inline_read_is_pulled_again_on_a_pull_thread(pd: Any) -> None:
    """D's knowledge of P's regions is wrong (as after P re-registered its cache): the read
    fails, a pull thread tries again, fetches P's regions anew and loads."""
    warm_up(pd)
    d = pd.d
    misplace_p_regions(pd)
    remote = hold(pd, "f", [1, 6])
    start(pd, "f", remote, [3, 5])
    assert len(d.reader.inline) == 1
    finish(pd, "f", remote, [3, 5])
    assert pd.pulls == ["warm", "f"]
    assert d.recorder.total("p2p_read_retries", reason="transfer") >= 1


def test_a_failed_inline_read_fails_the_load_when_read_retry_allows_no_retry(
        pd: Any) -> None:
    """``read_retry.attempts`` 1: the inline read was the one try; its failure ends the load
    (failed, its blocks reported) instead of going to a pull thread."""
    warm_up(pd)
    d = pd.d
    set_retry(d, "read_retry", attempts=1)
    misplace_p_regions(pd)
    remote = hold(pd, "f", [1, 6])
    start(pd, "f", remote, [3, 5])
    assert len(d.reader.inline) == 1
    deadline = time.monotonic() + 20
    while "f" not in (d.get_finished(idle=True)[1] or set()):
        assert time.monotonic() < deadline, "the load did not end"
    assert d.get_block_ids_with_load_errors() == {3, 5}
    assert pd.pulls == ["warm"]  # no pull thread tried again
    assert d.recorder.total("p2p_read_retries", reason="transfer") == 0
    assert d.recorder.total("p2p_failures", cause="transfer") == 1


def test_loads_the_inline_path_does_not_take_go_to_the_pull_threads(
        pd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    warm_up(pd)
    # outside the window: claimed first, on a pull thread
    remote = hold(pd, "stale", [2], age_s=WINDOW_S)
    start(pd, "stale", remote, [4])
    assert len(pd.d.reader.inline) == 0
    finish(pd, "stale", remote, [4])
    assert pd.pulls[-1] == "stale" and pd.claims == ["stale"]
    # a large read: more ranges than are submitted on vLLM's thread
    monkeypatch.setattr(pull_inline, "INLINE_MAX_RANGES", 2 * LAYERS - 1)
    remote = hold(pd, "big", [5, 7])
    start(pd, "big", remote, [1, 3])
    assert len(pd.d.reader.inline) == 0
    finish(pd, "big", remote, [1, 3])
    assert pd.pulls[-1] == "big"
    # as many blocks, consecutive on both sides: a range a region once merged, read here
    inline_before = pd.d.recorder.total("p2p_inline_reads")
    remote = hold(pd, "run", [5, 6])
    start(pd, "run", remote, [1, 2])
    assert len(pd.d.reader.inline) == 1
    finish(pd, "run", remote, [1, 2])
    assert pd.pulls[-1] == "big" and pd.d.recorder.total("p2p_inline_reads") == inline_before + 1
    # local block ids outside D's cache: not read here, and no exception on vLLM's thread;
    # the pull thread fails the load
    remote = hold(pd, "bad", [1])
    start(pd, "bad", remote, [NB + 3])
    assert len(pd.d.reader.inline) == 0
    deadline = time.monotonic() + 20
    while "bad" not in (pd.d.get_finished()[1] or set()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert pd.d.get_block_ids_with_load_errors() == {NB + 3}
    # a claim D's scheduler sent ahead: that path's own
    remote = hold(pd, "ahead", [3])
    pd.d.start_load_kv(MooncakeConnectorMetadata(requests={"ahead": RecvMeta(
        "ahead", [6], remote, remote_block_ids=remote.block_ids, claimed_ahead=True)}))
    assert len(pd.d.reader.inline) == 0
    finish(pd, "ahead", remote, [6])
    assert pd.pulls[-1] == "ahead"


def test_block_runs_count_the_ranges_left_once_merged() -> None:
    def runs(local: list[int], remote: list[int]) -> int:
        return pull_inline.block_runs(RecvMeta("r", local, None, remote_block_ids=remote))

    assert runs([1, 2, 3], [7, 8, 9]) == 1
    assert runs([3, 1, 2], [9, 7, 8]) == 1  # the order of the blocks does not matter
    assert runs([1, 2, 3], [7, 9, 8]) == 3  # consecutive on D only
    assert runs([1, 2, 5, 6], [7, 8, 3, 4]) == 2
    assert runs([4], [0]) == 1 and runs([], []) == 0


def test_a_p_read_from_its_memory_on_this_host_is_read_on_a_pull_thread(
        pd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same-host reads copy from P's memory synchronously: they stay on the pull threads
    (P and D share one process and one transfer engine here, which never reads itself
    that way, so the engine is told P is such a peer)."""
    warm_up(pd)
    assert pd.d.te is not None
    monkeypatch.setattr(pd.d.te, "is_local_peer", lambda session: True)
    remote = hold(pd, "here", [4])
    start(pd, "here", remote, [2])
    assert len(pd.d.reader.inline) == 0
    finish(pd, "here", remote, [2])
    assert pd.pulls == ["warm", "here"]
    assert pd.d.recorder.total("p2p_inline_reads") == 0


def test_a_keyed_p_s_loads_are_claimed_first_never_read_inline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """D keeps no region address of a keyed P (its grants name only the claimed blocks):
    every load, within P's window or not, goes to a pull thread and is claimed before it is
    read: one claim round trip per load, no window read."""
    pd = make_pd(monkeypatch, True)
    try:
        warm_up(pd)
        for rid, src, dst in (("a", [3, 5], [1, 2]), ("b", [6], [7])):
            remote = hold(pd, rid, src)
            start(pd, rid, remote, dst)
            assert len(pd.d.reader.inline) == 0
            finish(pd, rid, remote, dst)
            assert pd.pulls[-1] == rid and pd.claims[-1] == rid
        assert pd.claims == ["a", "b"]
        assert pd.d.recorder.total("p2p_inline_reads") == 0
        assert pd.d.recorder.total("p2p_window_reads") == 0
    finally:
        pd.p.shutdown()
        pd.d.shutdown()
        monkeypatch.setattr(auth, "_cached", None)
