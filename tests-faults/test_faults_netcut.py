# SPDX-License-Identifier: Apache-2.0
"""The network between P and D cut in the middle of a transfer.

P and D run in two network namespaces joined by a veth pair that the test creates
(``ip netns``/``ip link``, as root) and bind and advertise their namespace's address.
After a transfer over the veth pair proves the path, D's next read is held right after P
granted the claim, the link is set down, and the read goes out into a dead network: it
stalls (TCP retransmits; no reset ever comes). Mooncake drops a connection without
progress after ``MC_TCP_PROGRESS_TIMEOUT_SEC``; D's request must end within its deadline
and be recomputed, P's lease must lapse and free the blocks, both must serve on, and a
P/D request must work again once the link is back.

Both engines run with same-host reads off (``VLLM_ASCEND_KV_LOCAL_READS=0``): P and D share
this host's memory, and D would otherwise copy P's blocks without the network.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.faults import listening_sockets, start_in_parallel, wait_for
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.netns import NetnsEngineProcess, VethPair, netns_problem
from ascend_kv_testing.pd import PROBES, baseline, kv_config, prefill, prompts_of

HOOKS = "ascend_kv_testing.fault_hooks"
LEASE_S = 4.0
DEADLINE_S = 8.0
#: Mooncake's "no progress" bound on a stalled TCP transfer (30 s by default)
PROGRESS_S = 5

_problem = netns_problem()
pytestmark = pytest.mark.skipif(_problem is not None,
                                reason=f"network namespaces are not available: {_problem}")


@pytest.fixture(scope="module")
def net() -> Iterator[VethPair]:
    with VethPair(subnet="10.213.91") as pair:
        yield pair


@pytest.fixture(scope="module")
def pd(net: VethPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tiny_llama(tmp_path_factory.mktemp("netcut-model"))
    # two namespaces of one host are one host to same-host reads, which need no network:
    # off, so that D reads over the network as between two hosts
    # and two namespaces are two hosts to protected mode (no key): opted out, as before it
    env = {"MC_TCP_PROGRESS_TIMEOUT_SEC": str(PROGRESS_S), "VLLM_ASCEND_KV_LOCAL_READS": "0",
           "VLLM_ASCEND_KV_ALLOW_UNAUTHENTICATED": "1"}
    made = start_in_parallel({
        "p": lambda: NetnsEngineProcess(
            model, kv_config("kv_producer", "cut-p", lease_ttl_s=LEASE_S), netns=net.ns_a,
            host=net.addr_a, env=env),
        "d": lambda: NetnsEngineProcess(
            model, kv_config("kv_consumer", "cut-d", policy="recompute",
                             load_timeout_s=DEADLINE_S, handshake_timeout_s=2.0),
            netns=net.ns_b, host=net.addr_b, env=env),
    })
    yield type("PD", (), made)
    for engine in made.values():
        engine.close()


def test_engines_bind_and_advertise_their_namespace_address(pd: Any, net: VethPair) -> None:
    endpoints = pd.p.call(f"{PROBES}:kv_endpoints")
    assert endpoints["p2p_side_channel"].startswith(f"tcp://{net.addr_a}:")
    assert endpoints["transfer_engine"].startswith(f"{net.addr_a}:")
    port = int(endpoints["p2p_side_channel"].rsplit(":", 1)[1])
    mine = [s for s in listening_sockets(pd.p.proc.pid) if s.port == port]
    assert [s.host for s in mine] == [net.addr_a]
    assert pd.d.call(f"{PROBES}:kv_endpoints")["transfer_engine"].startswith(f"{net.addr_b}:")


def test_link_cut_mid_transfer(pd: Any, net: VethPair, tmp_path: Path,
                               fault_report: Any) -> None:
    p, d = pd.p, pd.d
    x, x2, z = prompts_of([160, 150, 60], seed=201)
    want = baseline(d, [x, x2, z])
    # the path works: a first transfer crosses the veth pair
    got = d.generate([x], max_tokens=8, kv_params=prefill(p, [x]))[0]
    assert got.token_ids == want[0]
    loaded = d.call(f"{PROBES}:connector_totals").get("p2p_requests_loaded", 0)
    assert loaded == 1
    expired0 = p.call(f"{PROBES}:connector_totals").get("p2p_expired_leases", 0)
    params = prefill(p, [x2])
    assert d.call(f"{HOOKS}:pause_before_read", flag_dir=str(tmp_path), max_wait_s=30)
    out: dict[str, Any] = {}

    def decode() -> None:
        t = time.monotonic()
        out["x2"] = d.generate([x2], max_tokens=8, kv_params=params)[0]
        out["took"] = time.monotonic() - t

    thread = threading.Thread(target=decode)
    thread.start()
    assert wait_for(lambda: (tmp_path / "reading").exists(), 30)
    net.set_link(False)
    cut_at = time.monotonic()
    (tmp_path / "go").touch()
    thread.join(120)
    assert not thread.is_alive()
    # D: the stalled read failed (progress bound) before the deadline; recomputed
    assert out["x2"].token_ids == want[1] and out["x2"].finish_reason == "length"
    assert fault_report.check("deadline", out["took"] < DEADLINE_S + 3,
                              f"D's request took {out['took']:.1f}s"), out["took"]
    totals = d.call(f"{PROBES}:connector_totals")
    causes = {k: v for k, v in totals.items() if k.startswith("p2p_failures")}
    assert sum(causes.values()) == 1, causes
    # P: no Done can arrive; the lease lapses and P frees the blocks once
    freed = wait_for(lambda: p.call(f"{PROBES}:step_for", seconds=0.2)["requests"] == 0,
                     LEASE_S + 5)
    freed_after = time.monotonic() - cut_at
    assert fault_report.check("deadline", freed, f"P still held the blocks {freed_after:.1f}s "
                                                 "after the cut")
    assert p.call(f"{PROBES}:connector_totals").get("p2p_expired_leases", 0) - expired0 == 1
    # both serve on while the network is down
    assert fault_report.check("survivor", d.generate([z], max_tokens=8)[0].token_ids == want[2],
                              "D's answer with the link down")
    assert fault_report.check("survivor", len(p.generate([z], max_tokens=4)[0].token_ids) == 4,
                              "P's answer with the link down")
    for engine in (p, d):
        idle = engine.wait_idle(30)
        s = engine.call(f"{PROBES}:leak_state")
        fault_report.check("zero", idle and s["requests"] == s["used_blocks"] == 0
                           and s["p2p_held"] == s["p2p_pending"] == 0, f"idle={idle}, {s}")
        assert idle, s
        assert s["requests"] == 0 and s["used_blocks"] == 0, s
        assert s["p2p_held"] == 0 and s["p2p_pending"] == 0, s
    # the network comes back: P/D works again
    net.set_link(True)
    d.reset_prefix_cache()
    again = d.generate([x2], max_tokens=8, kv_params=prefill(p, [x2]))[0]
    assert fault_report.check("survivor", again.token_ids == want[1],
                              "P/D once the link was back")
    assert d.call(f"{PROBES}:connector_totals").get("p2p_requests_loaded", 0) == loaded + 1
    fault_report(fault="network between P and D cut mid-transfer (veth link down)",
                 happened=f"D's read stalled, Mooncake dropped it after {PROGRESS_S}s without "
                          f"progress, D recomputed ({out['took']:.1f}s); P's lease lapsed and "
                          f"P freed the blocks ({freed_after:.1f}s after the cut); P/D worked "
                          f"again once the link was back ({sorted(causes)[0].split('=')[-1]})",
                 deadline=f"yes ({out['took']:.1f}s < load timeout {DEADLINE_S:.0f}s + 3s)",
                 client="the right tokens (recompute policy)")
