# SPDX-License-Identifier: Apache-2.0
"""Protected mode: without a deployment key, P's side channel serves only its own host.

P's pull side channel (the real :class:`~...pull.holder.LeaseHolder` and its handler, no
engine) runs in this process, bound to the address of network namespace ``a`` of a veth
pair (the serving thread enters ``a`` before it binds), holding one request. Clients run
as child processes (``ip netns exec``) with no key: an outsider in namespace ``b`` (another
host, as far as P can tell) and a peer in ``a`` itself (this host: it connects from P's own
address). Without a key the outsider's ``GetMeta``, ``Claim`` and ``Done`` (with the held
request's id and token) are each refused with ``ErrorReply(code="protected_mode")`` naming
the two ways out, counted in ``auth_refused``; no handler runs, nothing is held or freed,
and the same-host peer is served. With ``VLLM_ASCEND_KV_ALLOW_UNAUTHENTICATED=1`` P serves
the outsider (the opt-out). Seconds; root (network namespaces) needed, as for the netcut
tests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest

from ascend_kv_testing.keys import set_deployment_key
from ascend_kv_testing.netns import VethPair, enter_netns, netns_problem
from vllm_ascend.distributed.kv_transfer.core import auth, protected
from vllm_ascend.distributed.kv_transfer.core.layout import LayoutDescriptor
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import AgentMeta
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import SendMeta
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.holder import LeaseHolder

_problem = netns_problem()
pytestmark = pytest.mark.skipif(_problem is not None,
                                reason=f"network namespaces are not available: {_problem}")

#: P's registered regions as GetMeta would give them away
REGIONS = [0x7F00_0000_0000, 0x7F00_4000_0000]
RID, BLOCKS, TOKEN = "held-request-1", [3, 4, 5], "the-held-requests-capability-token"

#: The client: GetMeta, then Claim and Done of the held request with its token (what an
#: outsider who read the request's kv_transfer_params sends); each answer as JSON.
CLIENT = """
import json, sys
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient
from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import CODEC, Claim, Done, GetMeta
endpoint, rid, blocks, token = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
client = RpcClient(endpoint, CODEC, timeout_s=5, auth=None)
out = []
for msg in (GetMeta(), Claim(request_id=rid, block_ids=blocks, reader="x", token=token),
            Done(request_id=rid, reader="x", token=token)):
    try:
        reply = client.call(msg)
        out.append({"type": type(reply).__name__,
                    "region_addrs": list(getattr(reply, "region_addrs", []))})
    except RemoteError as exc:
        out.append({"code": exc.code, "message": str(exc)})
client.close()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def net() -> Iterator[VethPair]:
    with VethPair(subnet="10.213.94") as pair:
        yield pair


@pytest.fixture
def no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    set_deployment_key(monkeypatch, None)
    monkeypatch.delenv(auth.ENV_ALLOW_UNAUTHENTICATED, raising=False)
    # the addresses of this host as the serving thread (in namespace a) reads them
    monkeypatch.setattr(protected, "_LOCAL", protected._LocalAddresses())


class SideChannel:
    """P's side channel in namespace ``ns`` at ``host``, holding one request."""

    def __init__(self, ns: str, host: str) -> None:
        layout = LayoutDescriptor(kind="cpu", num_layers=2, num_blocks=8, block_size=16,
                                  dtype="float32", is_mla=False, num_kv_heads=2,
                                  head_size=8, block_lens=[1024, 1024, 1024, 1024])
        meta = AgentMeta(protocol_version=1, engine_id="P", model="tiny",
                         session=f"{host}:1", tp_rank=0, tp_size=1, pp_rank=0,
                         total_num_kv_heads=2, layout=layout, region_addrs=list(REGIONS),
                         region_strides=[1024, 1024])
        cfg = types.SimpleNamespace(lease_ttl_s=600.0, hold_window_s=0.0, max_hold_s=600.0)
        # port 0: the server binds a free one (in the namespace; this one has no such address)
        shared: Any = types.SimpleNamespace(cfg=cfg, meta=meta, host=host, port=0,
                                            recorder=MetricsRecorder(P2P_METRICS))
        self.holder = LeaseHolder(shared)
        self.handled: list[str] = []
        handle = self.holder.handle

        def recording(msg: Any) -> Any:
            self.handled.append(type(msg).__name__)
            return handle(msg)

        self.holder.handle = recording  # type: ignore[method-assign]
        self.holder.hold([SendMeta(request_id=RID, block_ids=list(BLOCKS), token=TOKEN)])
        failed: list[BaseException] = []

        def serve() -> None:  # this thread and the server's, started here, live in ns
            try:
                enter_netns(ns)
                self.holder.serve()
            except BaseException as exc:  # reported to the test below
                failed.append(exc)

        starter = threading.Thread(target=serve)
        starter.start()
        starter.join(30)
        if failed:
            raise failed[0]
        server = self.holder.server
        assert server is not None and server.auth is None
        self.server = server
        self.endpoint = server.endpoint

    @property
    def held(self) -> bool:
        return self.holder.held.get(RID) is not None

    def close(self) -> None:
        self.holder.stop()


def run_client(ns: str, endpoint: str) -> list[dict[str, Any]]:
    """The client's answers, run in namespace ``ns`` without a key."""
    env_unset = [auth.ENV_KEY, auth.ENV_KEY_FILE, auth.ENV_ALLOW_UNAUTHENTICATED]
    cmd = ["ip", "netns", "exec", ns, "env", *[f"--unset={v}" for v in env_unset],
           sys.executable, "-c", CLIENT, endpoint, RID, json.dumps(BLOCKS), TOKEN]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return list(json.loads(res.stdout.strip().splitlines()[-1]))


def refused(channel: SideChannel) -> float:
    return auth.RECORDER.total("auth_refused", socket=channel.server.name,
                               reason=protected.REFUSAL)


def test_without_a_key_an_outsider_is_refused_and_this_host_served(
        net: VethPair, no_key: None, fault_report: Any) -> None:
    p = SideChannel(net.ns_a, net.addr_a)
    try:
        assert p.server.gate.active
        before = refused(p)
        answers = run_client(net.ns_b, p.endpoint)
        assert [a.get("code") for a in answers] == ["protected_mode"] * 3, answers
        for a in answers:
            assert net.addr_b in a["message"]
            assert auth.ENV_KEY_FILE in a["message"]
            assert f"{auth.ENV_ALLOW_UNAUTHENTICATED}=1" in a["message"]
        counted = refused(p) - before
        assert counted == 3
        assert p.handled == []  # no handler ran: nothing served
        assert fault_report.check("zero", p.held, "the held request was freed")
        assert p.server.stats["auth_refused"] == 3
        # a peer on P's own host (in namespace a, from P's address) is served
        mine = run_client(net.ns_a, p.endpoint)
        assert mine[0] == {"type": "AgentMeta", "region_addrs": REGIONS}, mine
        assert fault_report.check("survivor", [a.get("type") for a in mine[1:]] == [
            "ClaimOK", "DoneAck"], f"same-host peer got {mine}")
        assert p.handled == ["GetMeta", "Claim", "Done"]
        assert refused(p) - before == 3
    finally:
        p.close()
    fault_report(fault="an outsider on another host (network namespace) against P's side "
                       "channel without a deployment key: GetMeta, and Claim and Done with "
                       "the held request's token",
                 happened=f"each refused with ErrorReply(protected_mode) and counted "
                          f"({counted:g} in auth_refused), no handler ran, the request stayed "
                          "held; a peer on P's host was then served",
                 deadline=None, survivor="same-host peer served",
                 zero="nothing held or freed by the outsider",
                 client="ErrorReply(protected_mode) naming the key and the opt-out")


def test_the_opt_out_serves_the_outsider(net: VethPair, no_key: None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.ENV_ALLOW_UNAUTHENTICATED, "1")
    p = SideChannel(net.ns_a, net.addr_a)
    try:
        assert not p.server.gate.active
        before = refused(p)
        answers = run_client(net.ns_b, p.endpoint)
        assert answers[0] == {"type": "AgentMeta", "region_addrs": REGIONS}, answers
        assert [a.get("type") for a in answers[1:]] == ["ClaimOK", "DoneAck"], answers
        assert refused(p) == before
        assert p.handled == ["GetMeta", "Claim", "Done"]
    finally:
        p.close()
