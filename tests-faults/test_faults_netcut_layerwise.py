# SPDX-License-Identifier: Apache-2.0
"""The network between P and D cut while P pushes (``MooncakeLayerwiseConnector``).

The push direction of ``test_faults_netcut.py``: P and D run in two network namespaces
joined by a veth pair (``ip netns``/``ip link``, as root) and bind and advertise their
namespace's address; the stand-in for the proxy's metaserver listens on D's loopback.
After a layerwise P/D request over the veth pair proves the path, P's next push is held
at a layer boundary (after its first write into D's blocks, with D's write lease
granted), the link is set down, and the held write goes out into a dead network: it
stalls (TCP retransmits; no reset ever comes) until Mooncake drops it after
``MC_TCP_PROGRESS_TIMEOUT_SEC``, and P's lease renewals cannot reach D either.

D must fail the load when P's write lease lapses (well before its deadline) and
recompute the prompt; P must stop the push, count it and free the request's blocks and
push state; D must release what it held for the push (registered staging); both must
serve on while the link is down, and a layerwise P/D request must work again once the
link is back.

The late write: the write Mooncake "dropped" is not withdrawn. Its bytes stay queued in
P's kernel (the closed socket in FIN-WAIT-1, seen with ``ss`` in P's namespace) and go out
once the link is back. D must have fenced the connection they arrive on before it handed
the blocks back (``layerwise.fence``): the test fills the blocks the failed push targeted
with a pattern once D handed them back (as another request's KV would be), heals the link,
waits until P's kernel holds nothing for D any more (delivered, or reset by D), and finds
the pattern intact.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import (
    PUSH_STATE,
    connector_totals,
    failure_counts,
    holds_nothing,
    leak_state,
    start_in_parallel,
    wait_for,
)
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.netns import NetnsEngineProcess, VethPair, enter_netns, netns_problem
from ascend_kv_testing.pd import LAYERWISE, PROBES, Metaserver, baseline, kv_config, prompts_of

HOOKS = "ascend_kv_testing.fault_hooks"
#: D's write leases (P renews every third of it). P starts no write later than the stall
#: bound + 0.5 s before a lease ends: 4 s leave P a window of 2.5 s after each renewal, so the
#: write held across the cut still starts inside it and really goes out into the dead network.
LEASE_S = 4.0
#: D's load deadline: D fails the load when P's lease lapses, well before it (a longer
#: deadline costs nothing while that works, and keeps the cause ``peer_lost`` on a busy machine)
DEADLINE_S = 15.0
#: Mooncake's "no progress" bound on a stalled TCP transfer (30 s by default)
PROGRESS_S = 1
#: two namespaces are two hosts to protected mode (no key): opted out, as before it
ENV = {"MC_TCP_PROGRESS_TIMEOUT_SEC": str(PROGRESS_S), "VLLM_ASCEND_KV_LOCAL_READS": "0",
       "VLLM_ASCEND_KV_ALLOW_UNAUTHENTICATED": "1"}

_problem = netns_problem()
pytestmark = pytest.mark.skipif(_problem is not None,
                                reason=f"network namespaces are not available: {_problem}")


@pytest.fixture(scope="module")
def net() -> Iterator[VethPair]:
    with VethPair(subnet="10.213.93") as pair:
        yield pair


def metaserver_in(netns: str) -> Metaserver:
    """A :class:`Metaserver` listening on ``netns``'s loopback (D posts to it from there)."""
    box: dict[str, Any] = {}

    def make() -> None:
        try:
            enter_netns(netns)  # this thread only: the listening socket is created in netns
            box["meta"] = Metaserver()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=make)
    thread.start()
    thread.join(30)
    if "meta" not in box:
        raise RuntimeError(f"no metaserver in {netns}: {box.get('error')}")
    return box["meta"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def lw(net: VethPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """P (chunked prefill, 64 tokens a step) in namespace a, D (recompute policy) in b."""
    model = make_tiny_llama(tmp_path_factory.mktemp("netcut-lw-model"))
    made = start_in_parallel({
        "p": lambda: NetnsEngineProcess(
            model, kv_config("kv_producer", "cutlw-p", connector=LAYERWISE, lease_ttl_s=LEASE_S,
                             handshake_timeout_s=2.0),
            netns=net.ns_a, host=net.addr_a, env=ENV, max_num_batched_tokens=64),
        "d": lambda: NetnsEngineProcess(
            model, kv_config("kv_consumer", "cutlw-d", policy="recompute", connector=LAYERWISE,
                             load_timeout_s=DEADLINE_S, lease_ttl_s=LEASE_S,
                             handshake_timeout_s=2.0),
            netns=net.ns_b, host=net.addr_b, env=ENV),
    })
    meta = metaserver_in(net.ns_b)
    yield {**made, "meta": meta}
    meta.close()
    closing = [threading.Thread(target=engine.close) for engine in made.values()]
    for thread in closing:  # in parallel: each engine's shutdown takes seconds
        thread.start()
    for thread in closing:
        thread.join()


def held_requests(llm: Any) -> float | None:
    """In the engine (``EngineProcess.call``): P's ``p2p_held_requests`` gauge."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().recorder.gauge("p2p_held_requests")  # type: ignore[no-any-return]


#: what the test writes into the blocks D handed back (as another request's KV)
FILL = 0xA5


def _block_spans(block_ids: list[int]) -> list[tuple[int, int]]:
    """In the engine: ``(address, bytes)`` of each of D's blocks ``block_ids``, every region."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    layout = get_kv_transfer_group().connector_worker.layout
    return [(r.base_addr + b * r.block_stride, r.block_len)
            for r in layout.regions for b in block_ids]


def fill_blocks(llm: Any, block_ids: list[int]) -> int:
    """In the engine: write :data:`FILL` over D's blocks ``block_ids``; the bytes written."""
    import ctypes

    spans = _block_spans(block_ids)
    for addr, size in spans:
        ctypes.memset(addr, FILL, size)
    return sum(size for _, size in spans)


def bytes_overwritten(llm: Any, block_ids: list[int]) -> int:
    """In the engine: how many bytes of D's blocks ``block_ids`` no longer hold :data:`FILL`."""
    import ctypes

    return sum(size - ctypes.string_at(addr, size).count(bytes([FILL]))
               for addr, size in _block_spans(block_ids))


def queued_for(netns: str, addr: str) -> int:
    """Bytes the kernel in ``netns`` still holds unacknowledged for ``addr`` (``ss``)."""
    res = subprocess.run(["ip", "netns", "exec", netns, "ss", "-tnH", "dst", addr],
                         capture_output=True, text=True, check=True, timeout=30)
    # State Recv-Q Send-Q Local Peer
    return sum(int(line.split()[2]) for line in res.stdout.splitlines() if line.split())


def new_failures(engine: EngineProcess, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in failure_counts(engine).items()
            if v != before.get(k, 0)}


def test_link_cut_mid_push(lw: dict[str, Any], net: VethPair, tmp_path: Path,
                           fault_report: Any) -> None:
    p, d, meta = lw["p"], lw["d"], lw["meta"]
    endpoints = d.call(f"{PROBES}:kv_endpoints")
    assert endpoints["transfer_engine"].startswith(f"{net.addr_b}:"), endpoints
    x, x2, z, x3 = prompts_of([200, 200, 70, 150], seed=801)
    want = baseline(d, [x, x2, z, x3])
    # the path works: a first push crosses the veth pair
    got = meta.pd_once(p, d, x, prefix="cutlw")
    assert got.token_ids == want[0] and got.finish_reason == "length"
    loaded = connector_totals(d).get("p2p_requests_loaded", 0)
    assert loaded == 1
    fail_p, fail_d = failure_counts(p), failure_counts(d)
    d_registered = leak_state(d)["registered_bytes"]
    # P's next push is held after its first write into D's blocks (D's lease granted)
    out: dict[str, Any] = {}
    rid, thread = meta.start_decode(d, x2, out, prefix="cutlw")
    posted = meta.wait([rid])
    assert p.call(f"{HOOKS}:pause_push", flag_dir=str(tmp_path), after_writes=1, max_wait_s=30)
    p_out: dict[str, Any] = {}
    p_thread = threading.Thread(target=lambda: p_out.update(
        r=p.generate([x2], max_tokens=1, kv_params=posted, timeout=120)[0]), daemon=True)
    p_thread.start()
    assert wait_for(lambda: (tmp_path / "pushing").exists(), 60)
    net.set_link(False)
    cut_at = time.monotonic()
    (tmp_path / "go").touch()  # the held write goes out into the dead network
    thread.join(120)
    assert not thread.is_alive() and "d" in out, out
    # D: P's lease lapsed (no renewal crosses a dead link); the load failed and D recomputed
    assert out["d"].token_ids == want[1] and out["d"].finish_reason == "length"
    assert fault_report.check("deadline", out["took"] < DEADLINE_S + 3,
                              f"D's request took {out['took']:.1f}s"), out["took"]
    d_causes = new_failures(d, fail_d)
    assert d_causes == {"peer_lost": 1}, d_causes  # the lease lapsed, not the deadline
    # P: its client got the prefill answer; the stalled write failed, P stopped the push and
    # freed the request's blocks and push state
    p_thread.join(60)
    assert not p_thread.is_alive() and p_out["r"].finish_reason == "length", p_out
    freed = wait_for(lambda: p.call(f"{PROBES}:step_for", seconds=0.2)["requests"] == 0
                     and leak_state(p)["p2p_pushes"] == 0, LEASE_S + 10)
    freed_after = time.monotonic() - cut_at
    assert fault_report.check("deadline", freed, f"P still held the blocks {freed_after:.1f}s "
                                                 "after the cut"), freed_after
    held = p.call(f"{__name__}:held_requests")
    assert fault_report.check("zero", held == 0, f"P's p2p_held_requests gauge: {held}"), held
    p_causes = new_failures(p, fail_p)
    assert p_causes and set(p_causes) <= {"transfer", "lease_lapsed", "peer_timeout"}, p_causes
    assert (tmp_path / "resumed").exists()
    # both serve on while the network is down
    assert fault_report.check("survivor", d.generate([z], max_tokens=8)[0].token_ids == want[2],
                              "D's answer with the link down")
    assert fault_report.check("survivor", len(p.generate([z], max_tokens=4)[0].token_ids) == 4,
                              "P's answer with the link down")
    holds_nothing(p, fault_report, zero=PUSH_STATE)
    holds_nothing(d, fault_report, zero=PUSH_STATE)
    regd = leak_state(d)["registered_bytes"]
    assert fault_report.check("zero", regd == d_registered,
                              f"D's registered bytes {d_registered} -> {regd}")
    # D handed the failed push's blocks back: they hold another request's KV from now on
    pushed_to = list(posted[0]["remote_block_ids"])
    filled = d.call(f"{__name__}:fill_blocks", block_ids=pushed_to)
    late = queued_for(net.ns_a, net.addr_b)  # the dropped write, still queued on P's host
    fenced = connector_totals(d).get("p2p_write_fences|outcome=drained", 0)
    # the network comes back: P's kernel sends what it queued; nothing may land
    net.set_link(True)
    healed_at = time.monotonic()
    gone = wait_for(lambda: queued_for(net.ns_a, net.addr_b) == 0, 120)
    left = queued_for(net.ns_a, net.addr_b)
    assert gone, f"P's kernel still holds {left} bytes for D"
    drained_after = time.monotonic() - healed_at
    changed = d.call(f"{__name__}:bytes_overwritten", block_ids=pushed_to)
    assert fault_report.check("zero", changed == 0,
                              f"{changed} of {filled} bytes of the blocks D handed back were "
                              f"overwritten once the link was back ({late} bytes were queued "
                              "on P's host)"), changed
    if "transfer" in p_causes:  # the held write went out: its bytes were on the way
        assert late > 0 and fenced >= 1, (late, fenced)
    # layerwise P/D works again
    again = meta.pd_once(p, d, x3, prefix="cutlw")
    assert fault_report.check("survivor", again.token_ids == want[3],
                              "layerwise P/D once the link was back")
    assert connector_totals(d).get("p2p_requests_loaded", 0) == loaded + 1
    holds_nothing(p, fault_report, zero=PUSH_STATE)
    holds_nothing(d, fault_report, zero=PUSH_STATE)
    if "transfer" in p_causes:
        write = (f"P's held write went out into the dead network and stalled until Mooncake "
                 f"dropped it ({PROGRESS_S}s without progress); D fenced its connections "
                 f"before handing the blocks back, and the {late} bytes P's kernel still "
                 f"held went out once the link was back ({drained_after:.1f}s) and changed "
                 f"none of the {filled} pattern bytes D's blocks held by then")
    else:
        write = "P's held write found its write window closed and never started"
    fault_report(fault="layerwise: network between P and D cut mid-push (veth link down, P's "
                       "write held at a layer boundary)",
                 happened=f"{write}; P's lease renewals could not reach D, D failed the load "
                          f"when P's write lease lapsed "
                          f"(cause {', '.join(sorted(d_causes))}) and recomputed "
                          f"({out['took']:.1f}s); P stopped the push "
                          f"({', '.join(sorted(p_causes))}) and freed the blocks "
                          f"({freed_after:.1f}s after the cut, lease {LEASE_S:.0f}s); P/D "
                          "worked again once the link was back",
                 deadline=f"yes ({out['took']:.1f}s < load timeout {DEADLINE_S:.0f}s + 3s)",
                 client="the right tokens (recompute policy)")
