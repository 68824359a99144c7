# SPDX-License-Identifier: Apache-2.0
"""An outsider against a keyed P: our side channel refuses it, Mooncake's own ports do not.

What ``docs/security.md`` says the deployment key protects and what only the network does,
measured again on every run (issue 51's outsider). P is a real pull worker
(``MooncakeConnectorV1``'s, over the real transfer engine, with the deployment key) in
network namespace ``a`` of a veth pair, holding a KV cache filled with a pattern. The
outsider is a process in namespace ``b`` (another host, as far as P can tell) with no key
and no role. It

1. asks P's side channel for P's metadata (``GetMeta``), as D would: refused;
2. then does what needs no key: for every TCP port P listens on (what a port scan finds;
   the side channel's left out), asks Mooncake for the first buffer address of the segment
   ``<P's address>:<port>`` (``TransferEngine.get_first_buffer_address``) and, where it
   gets one, reads 64 KiB there with a transfer engine of its own
   (:mod:`ascend_kv_testing.outsider`).

The test checks the refusal (1), that P serves on afterwards (a keyed client in P's own
namespace gets its metadata) and nothing P holds changed, and records (2): which ports gave
an address and whether the bytes read are P's live KV. Mooncake 0.3.x authenticates no one,
so today they are; ``docs/security.md`` says so ("Only the network protects the KV"), and
the test fails when the two disagree, so a Mooncake that closes the hole, or a doc that
stops saying it, shows up here. Seconds; root (network namespaces) needed, as for the
netcut tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.faults import listening_sockets
from ascend_kv_testing.netns import VethPair, netns_problem
from ascend_kv_testing.outsider import OUTSIDER, OUTSIDER_TIMEOUT_S, netns_env, run_in_netns

_problem = netns_problem()
pytestmark = pytest.mark.skipif(_problem is not None,
                                reason=f"network namespaces are not available: {_problem}")

KEY = "mooncake-outsider-test-deployment-key"
#: P's engine id (a keyed client seals for it: what D takes from the request's params)
P_ENGINE = "P-outsider"
READ_BYTES = 64 << 10
SECURITY_DOC = Path(__file__).resolve().parents[1] / "docs" / "security.md"
#: what docs/security.md says of Mooncake's ports (checked against what the outsider got)
DOC_CLAIM = "Only the network protects"

# P: a keyed pull worker holding a patterned KV cache; prints its side-channel port and
# the sha256 of the first READ_BYTES of each registered layer, then serves until stdin ends.
P_SCRIPT = r"""
import hashlib, json, sys
from types import SimpleNamespace
import torch
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker

port, nbytes = int(sys.argv[1]), int(sys.argv[2])
kvc = SimpleNamespace(kv_port=port, is_kv_producer=True, is_kv_consumer=False,
                      kv_connector_extra_config={})
cfg = SimpleNamespace(
    kv_transfer_config=kvc,
    parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0,
                                    pipeline_parallel_size=1),
    cache_config=SimpleNamespace(block_size=16),
    model_config=SimpleNamespace(model="/models/outsider", get_total_num_kv_heads=lambda: 4))
p = PullWorker(cfg, MooncakeP2PConfig.from_dict({}), sys.argv[3], MetricsRecorder(P2P_METRICS),
               tp_rank=0, pp_rank=0)
caches, digests = {}, []
for layer in range(2):
    t = torch.empty(32, 4, 16, 64, dtype=torch.uint8)
    t.view(-1).copy_((torch.arange(t.numel()) * (layer + 3) % 251).to(torch.uint8))
    caches[f"model.layers.{layer}.self_attn.attn"] = t
    digests.append(hashlib.sha256(t.view(-1)[:nbytes].numpy().tobytes()).hexdigest())
p.register_kv_caches(caches)
print(json.dumps({"side_port": port, "digests": digests}), flush=True)
sys.stdin.read()
p.shutdown()
"""

@pytest.fixture(scope="module")
def net() -> Iterator[VethPair]:
    with VethPair(subnet="10.213.95") as pair:
        yield pair


@pytest.fixture(scope="module")
def keyed_p(net: VethPair) -> Iterator[dict[str, Any]]:
    from vllm_ascend.distributed.kv_transfer.core.net import free_port

    port = free_port()
    proc = subprocess.Popen(
        ["ip", "netns", "exec", net.ns_a, "env", *netns_env(net.addr_a, KEY), sys.executable,
         "-c", P_SCRIPT, str(port), str(READ_BYTES), P_ENGINE],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        pytest.fail(f"P did not start in namespace {net.ns_a} (exit {proc.returncode})")
    info = json.loads(line)
    try:
        yield {"proc": proc, **info}
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _keyed_get_meta(net: VethPair, side_port: int) -> str:
    """A keyed client in P's own namespace: what P answers it."""
    script = ("import sys\n"
              "from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient\n"
              "from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import CODEC, GetMeta\n"
              "c = RpcClient(sys.argv[1], CODEC, timeout_s=5, engine_id=sys.argv[2])\n"
              "print('{\"reply\": \"%s\"}' % type(c.call(GetMeta(requester='d'))).__name__)\n")
    return str(run_in_netns(net.ns_a, net.addr_a, KEY, script,
                            f"tcp://{net.addr_a}:{side_port}", P_ENGINE)["reply"])


def test_outsider_is_refused_by_the_key_and_reads_the_kv_through_mooncake(
        net: VethPair, keyed_p: dict[str, Any], fault_report: Any) -> None:
    proc, side_port = keyed_p["proc"], keyed_p["side_port"]
    ports = sorted({s.port for s in listening_sockets(proc.pid)
                    if s.kind != "unix" and s.port != side_port})
    assert ports, "P's transfer engine listens on no TCP port"
    start = time.monotonic()
    got = run_in_netns(net.ns_b, net.addr_b, None, OUTSIDER, net.addr_a, str(side_port),
                       net.addr_b, str(READ_BYTES), json.dumps(ports))
    took = time.monotonic() - start
    fault_report.check("deadline", took < OUTSIDER_TIMEOUT_S, f"{took:.0f}s")

    # 1. the control plane: a keyless GetMeta is refused
    assert got["get_meta"].startswith("refused"), f"P's side channel: {got['get_meta']}"

    # 2. Mooncake's ports: what they gave away
    answered = {p: r for p, r in got["ports"].items() if r.get("address")}
    read = {p: r for p, r in answered.items() if r.get("read_rc") == 0}
    kv = {p: r for p, r in read.items() if r.get("sha256") in keyed_p["digests"]}
    # whatever the outsider read came from P's KV as P holds it (nothing else, nothing torn)
    assert set(read) == set(kv), f"read bytes that are not P's KV: {read}"

    # P serves on: a keyed peer in its namespace gets its metadata, P is alive
    serving = proc.poll() is None and _keyed_get_meta(net, side_port) == "AgentMeta"
    assert fault_report.check("survivor", serving, "P stopped serving its keyed peers")

    doc_says_open = DOC_CLAIM in SECURITY_DOC.read_text(encoding="utf-8")
    assert bool(kv) == doc_says_open, (
        f"the outsider read P's KV: {bool(kv)}, but docs/security.md "
        f"{'says' if doc_says_open else 'no longer says'} {DOC_CLAIM!r}: update the doc")
    fault_report(
        fault="outsider without the key (another network namespace, no role) against a keyed "
              "P: P's side channel, then a scan of Mooncake's ports",
        happened=(f"GetMeta {got['get_meta']}; of P's {len(ports)} other TCP ports "
                  f"{len(answered)} gave a buffer address to "
                  f"`get_first_buffer_address` and the outsider read {READ_BYTES >> 10} KiB "
                  f"of P's live KV through {len(kv)} (the bytes equal P's): only the "
                  "network protects the KV (docs/security.md)"
                  if kv else
                  f"GetMeta {got['get_meta']}; none of P's {len(ports)} other TCP ports let "
                  "the outsider read P's KV"),
        deadline=f"every call answered ({took:.0f}s)", zero=None,
        client="the outsider: P's KV through Mooncake, nothing from our sockets"
               if kv else "the outsider: nothing",
    )
