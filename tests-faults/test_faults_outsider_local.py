# SPDX-License-Identifier: Apache-2.0
"""Protocol ``local`` against issue 51's outsider: same-host P/D with no Mooncake port at all.

``test_faults_mooncake_outsider.py`` shows what Mooncake's own ports give a keyless outsider
in another network namespace: P's live KV. Under transfer protocol ``local``
(:mod:`vllm_ascend.distributed.kv_transfer.core.local_protocol`) no Mooncake engine is
started: D copies P's blocks from P's memory (``process_vm_readv``), and P opens no port but
its side channel. Here P and D are real vLLM CPU engines with the deployment key, P in
network namespace ``a`` selecting the protocol with the connector's ``protocol`` option, D in
``b`` with ``VLLM_ASCEND_KV_PROTOCOL`` (two namespaces of one host: one host to same-host
reads, which need no network; D reaches P's side channel over the veth pair). The test
checks that

* D's greedy tokens equal a single instance's, and D's loads were same-host reads (its
  transfer engine's counters: every read a local one, no failure);
* P's process listens on no TCP port but its side channel (``/proc/<pid>/net/tcp*`` matched
  to P's descriptors) outside loopback (vLLM's and torch's own sockets in P's namespace;
  Mooncake's listen on every interface), and its transfer engine opened none;
* the outsider (:mod:`ascend_kv_testing.outsider`, no key, in ``b``) is refused ``GetMeta``,
  finds no open port on P's address but the side channel in a scan of all 65,535, and so has
  no Mooncake port to ask for a buffer address and reads nothing;
* P and D serve on afterwards and hold nothing.

Root (network namespaces) needed, as for the other outsider and netcut tests; two engine
starts and a port scan, well under two minutes.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ascend_kv_testing.faults import (
    failure_counts,
    holds_nothing,
    listening_sockets,
    start_in_parallel,
)
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.netns import NetnsEngineProcess, VethPair, netns_problem
from ascend_kv_testing.outsider import OUTSIDER, run_in_netns
from ascend_kv_testing.pd import PROBES, baseline, kv_config, prefill, prompts_of
from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.local_protocol import is_local_session
from vllm_ascend.distributed.kv_transfer.core.transfer_engine import PROTOCOL_ENV

_problem = netns_problem()
pytestmark = pytest.mark.skipif(_problem is not None,
                                reason=f"network namespaces are not available: {_problem}")

KEY = "local-protocol-outsider-test-deployment-key"
READ_BYTES = 64 << 10
#: P/D requests end within this (seconds)
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def net() -> Iterator[VethPair]:
    with VethPair(subnet="10.213.96") as pair:
        yield pair


@pytest.fixture(scope="module")
def pd(net: VethPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tiny_llama(tmp_path_factory.mktemp("outsider-local-model"))
    env = {auth.ENV_KEY: KEY}
    made = start_in_parallel({
        "p": lambda: NetnsEngineProcess(
            model, kv_config("kv_producer", "local-p", protocol="local"), netns=net.ns_a,
            host=net.addr_a, env=env),
        "d": lambda: NetnsEngineProcess(
            model, kv_config("kv_consumer", "local-d", policy="fail",
                             handshake_timeout_s=5.0),
            netns=net.ns_b, host=net.addr_b, env={**env, PROTOCOL_ENV: "local"}),
    })
    yield type("PD", (), made)
    for engine in made.values():
        engine.close()


def _pd_round(pd: Any, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    start = time.monotonic()
    params = prefill(pd.p, prompts)
    got = [r.token_ids for r in pd.d.generate(prompts, kv_params=params, timeout=DEADLINE_S)]
    return got, time.monotonic() - start


def test_local_protocol_moves_the_kv_and_leaves_the_outsider_no_mooncake_port(
        pd: Any, net: VethPair, fault_report: Any) -> None:
    prompts = prompts_of([64, 100, 150], seed=51)
    want = baseline(pd.d, prompts)
    got, took = _pd_round(pd, prompts)
    fault_report.check("deadline", took < DEADLINE_S, f"P/D round {took:.1f}s")
    assert got == want

    # D's loads were same-host reads, every one of them
    d_te = pd.d.call(f"{PROBES}:transfer_stats")
    assert d_te["protocol"] == "local" and d_te["listen_ports"] == [], d_te
    assert d_te["local_reads"] >= 1 and d_te["reads"] == d_te["local_reads"], d_te
    assert d_te["bytes_read_local"] == d_te["bytes_read"] > 0 and d_te["failures"] == 0, d_te
    assert not any(failure_counts(pd.d).values()), failure_counts(pd.d)

    # P listens on its side channel and nothing else; its engine opened nothing
    p_te = pd.p.call(f"{PROBES}:transfer_stats")
    assert p_te["protocol"] == "local" and p_te["listen_ports"] == [], p_te
    assert is_local_session(p_te["session"]), p_te
    side = int(pd.p.call(f"{PROBES}:kv_endpoints")["p2p_side_channel"].rsplit(":", 1)[1])
    # (vLLM's and torch's own sockets listen on loopback, which no other host or namespace
    # reaches; Mooncake's would listen on every interface)
    tcp = [s for s in listening_sockets(pd.p.proc.pid) if s.kind != "unix"]
    loopback = [s for s in tcp if ipaddress.ip_address(s.host).is_loopback]
    reachable = sorted(str(s) for s in tcp if s not in loopback)
    assert reachable == [f"tcp:{net.addr_a}:{side}"], [str(s) for s in tcp]

    # the outsider: no key, another namespace; GetMeta, then every open port of P's address
    start = time.monotonic()
    out = run_in_netns(net.ns_b, net.addr_b, None, OUTSIDER, net.addr_a, str(side),
                       net.addr_b, str(READ_BYTES), "scan")
    scan_s = time.monotonic() - start
    assert out["get_meta"].startswith("refused"), f"P's side channel: {out['get_meta']}"
    assert out["scanned"] == [side], out
    assert out["ports"] == {}, out  # no Mooncake port to ask: nothing read

    # both serve on, and hold nothing
    again, took = _pd_round(pd, prompts[:1])
    fault_report.check("deadline", took < DEADLINE_S, f"P/D round after {took:.1f}s")
    assert fault_report.check("survivor", again == want[:1], "P/D after the outsider")
    holds_nothing(pd.p, fault_report)
    holds_nothing(pd.d, fault_report)
    after = pd.d.call(f"{PROBES}:transfer_stats")
    assert after["reads"] == after["local_reads"] > d_te["local_reads"], after

    fault_report(
        fault="outsider without the key (another network namespace, no role) against a keyed "
              "P under protocol local (no Mooncake engine): P's side channel, then a scan "
              "of every TCP port of P's address",
        happened=(f"D's tokens equal a single instance's, its {after['local_reads']} reads "
                  "all copied from P's memory on this host; P listens on its side channel "
                  f"only (and {len(loopback)} loopback ports of vLLM/torch); GetMeta {out['get_meta']}; the scan ({scan_s:.0f}s) found only "
                  "the side channel: no Mooncake port to ask, nothing read"),
        deadline="every P/D round and the outsider's calls answered",
        client="the outsider: nothing (refused, no port); D: the same tokens",
    )
