# SPDX-License-Identifier: Apache-2.0
"""With a deployment key, D dials nothing a key holder did not sign, and a captured frame
acts nowhere but where it was sent.

A keyed P and a keyed D (``MooncakeConnectorV1``, real engines, shared by the module; D has
``allowed_peer_hosts: ["127.0.0.1"]`` and the fail policy) and an outsider in this process:

* **another request's params**: the outsider read request A's ``kv_transfer_params`` and
  sends D a completion with them rewritten to name request B (B's id and blocks, A's
  token). D refuses them before it dials anything (``bad_mac``, counted on D); re-signed by
  an outsider who holds the key, D's claim reaches P, which refuses it (``bad_token``,
  counted on P). Both requests fail on D, nothing stays held on D, and P still holds B,
  whose own params then load on D as usual;
* **a forged ``remote_host``**: A's params pointing at a listener of the outsider's.
  Refused by D (``bad_mac``; re-signed with the key: ``not_allowed``, the allowlist), and
  the listener sees no connection;
* **a frame replayed to another rank**: two ranks of P's side channel (the real
  ``LeaseHolder``, in this process, each with its own authenticator as two worker processes
  have) hold the same request with the same token, as TP ranks do. A ``Done`` a keyed D
  sealed for rank 0, captured and sent to rank 1 within the window, is refused there
  (``misdirected``, counted), no handler runs and rank 1 still holds the request; rank 0
  takes it once, and a second delivery there is a ``replay``.
"""

from __future__ import annotations

import socket
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import holds_nothing, leak_state, start_in_parallel, wait_for
from ascend_kv_testing.keys import set_deployment_key
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import PROBES, baseline, kv_config, prefill, prompts_of
from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.auth import Authenticator
from vllm_ascend.distributed.kv_transfer.kv_p2p.signed_params import MAC_KEY, sign

HOST = "127.0.0.1"
#: where the outsider listens (a loopback address D's allowlist does not name)
OUTSIDER = "127.0.0.2"
KEY = "the-deployment-key-of-the-signed-params-tests-0123456789"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, EngineProcess]]:
    model = make_tiny_llama(tmp_path_factory.mktemp("signed-params-model"))
    env = {auth.ENV_KEY: KEY, "VLLM_ASCEND_KV_HOST": HOST, "MC_TCP_BIND_ADDRESS": HOST,
           "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": HOST}
    made = start_in_parallel({
        "p": lambda: EngineProcess(model, kv_config("kv_producer", "sp-p", lease_ttl_s=600),
                                   env=env),
        "d": lambda: EngineProcess(model, kv_config(
            "kv_consumer", "sp-d", policy="fail", load_timeout_s=10, handshake_timeout_s=2.0,
            allowed_peer_hosts=[HOST]), env=env),
    })
    yield made
    for engine in made.values():
        engine.close()


def refused(engine: EngineProcess) -> dict[str, float]:
    return dict(engine.call(f"{PROBES}:auth_refused"))


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {r: after.get(r, 0.0) - before.get(r, 0.0) for r in set(before) | set(after)
            if after.get(r, 0.0) != before.get(r, 0.0)}


def resign(params: dict[str, Any]) -> dict[str, Any]:
    """What an outsider who holds the key makes of changed params: a valid MAC."""
    return sign({k: v for k, v in params.items() if k != MAC_KEY}, ttl_s=600,
                authn=Authenticator([KEY.encode()]))


def test_another_requests_params_are_refused_and_b_stays_held(
        engines: dict[str, EngineProcess], fault_report: Any) -> None:
    p, d = engines["p"], engines["d"]
    a, b = prompts_of([70, 70], seed=5101)
    want_b = baseline(d, [b])[0]
    pa, pb = prefill(p, [a, b])
    assert pa[MAC_KEY] and pb[MAC_KEY]  # a keyed P signs what it returns
    assert wait_for(lambda: leak_state(p)["p2p_held"] == 2, 30)
    forged = {**pa, "remote_request_id": pb["remote_request_id"],
              "remote_block_ids": list(pb["remote_block_ids"])}
    d0, p0 = refused(d), refused(p)
    got = d.generate([b, b], max_tokens=4, kv_params=[forged, resign(forged)])
    assert [g.finish_reason for g in got] == ["error", "error"], got
    d_grew, p_grew = grew(d0, refused(d)), grew(p0, refused(p))
    assert fault_report.check("zero", d_grew.get("bad_mac") == 1, f"D counted {d_grew}")
    # only the re-signed one reached P, whose token check refused it
    assert fault_report.check("zero", p_grew.get("bad_token", 0) >= 1, f"P counted {p_grew}")
    holds_nothing(d, fault_report)
    assert fault_report.check("zero", leak_state(p)["p2p_held"] == 2,
                              "P freed a request for the outsider")
    # B's own params still load, and give B's tokens
    got_b = d.generate([b], max_tokens=8, kv_params=[pb])[0]
    assert fault_report.check("survivor", got_b.token_ids == want_b, f"B gave {got_b}")
    d.generate([a], max_tokens=1, kv_params=[pa])
    assert fault_report.check("zero", wait_for(lambda: leak_state(p)["p2p_held"] == 0, 30),
                              "P still holds A or B")
    fault_report(fault="an outsider with request A's params (and with the key) sends D "
                       "params naming request B",
                 happened=f"unsigned change: refused by D before any dial ({d_grew}); "
                          f"re-signed with the key: P refused D's claim ({p_grew}); both "
                          "failed on D, nothing held there, P kept B, whose own params then "
                          "loaded",
                 deadline=None, client="the request fails (kv_load_failure_policy fail)")


class Listener:
    """The outsider's TCP listener: counts the connections it accepts."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _addr = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def test_a_forged_remote_host_is_never_dialed(engines: dict[str, EngineProcess],
                                             fault_report: Any) -> None:
    p, d = engines["p"], engines["d"]
    (a,) = prompts_of([70], seed=5102)
    (pa,) = prefill(p, [a])
    trap = Listener(OUTSIDER)
    try:
        forged = {**pa, "remote_host": OUTSIDER, "remote_port": trap.port,
                  "remote_multi_nodes_meta_mapping": {"0": {"host": OUTSIDER,
                                                            "engine_id": pa["remote_engine_id"]}}}
        d0 = refused(d)
        got = d.generate([a, a], max_tokens=4, kv_params=[forged, resign(forged)])
        assert [g.finish_reason for g in got] == ["error", "error"], got
        d_grew = grew(d0, refused(d))
        assert fault_report.check("zero", d_grew.get("bad_mac") == 1
                                  and d_grew.get("not_allowed") == 1, f"D counted {d_grew}")
        holds_nothing(d, fault_report)
        assert fault_report.check("zero", trap.accepted == 0,
                                  f"D connected to the outsider {trap.accepted} time(s)")
    finally:
        trap.close()
    d.generate([a], max_tokens=1, kv_params=[pa])  # the real params: P lets go of A
    assert fault_report.check("survivor", wait_for(lambda: leak_state(p)["p2p_held"] == 0,
                                                   30), "P still holds A")
    fault_report(fault="a forged remote_host in params (unsigned, and re-signed with the key)",
                 happened=f"D refused both before dialing ({d_grew}: the MAC, then the "
                          "allowlist); the outsider's listener saw no connection",
                 deadline=None, client="the request fails (kv_load_failure_policy fail)")


# ------------------------------------------------------------------ a frame to another rank
RID, BLOCKS, TOKEN = "held-by-both-ranks", [3, 4, 5], "the-requests-capability-token"


class Rank:
    """One rank of P's side channel (the real LeaseHolder and its RpcServer) holding RID."""

    def __init__(self) -> None:
        from vllm_ascend.distributed.kv_transfer.core.layout import LayoutDescriptor
        from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
        from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
        from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import AgentMeta
        from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import SendMeta
        from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.holder import LeaseHolder

        layout = LayoutDescriptor(kind="cpu", num_layers=2, num_blocks=8, block_size=16,
                                  dtype="float32", is_mla=False, num_kv_heads=2,
                                  head_size=8, block_lens=[1024, 1024, 1024, 1024])
        meta = AgentMeta(protocol_version=1, engine_id="P", model="tiny",
                         session=f"{HOST}:1", tp_rank=0, tp_size=2, pp_rank=0,
                         total_num_kv_heads=2, layout=layout, region_addrs=[1 << 40],
                         region_strides=[1024])
        cfg = types.SimpleNamespace(lease_ttl_s=600.0, hold_window_s=0.0, max_hold_s=600.0)
        shared: Any = types.SimpleNamespace(cfg=cfg, meta=meta, host=HOST, port=0,
                                            recorder=MetricsRecorder(P2P_METRICS))
        self.holder = LeaseHolder(shared)
        self.handled: list[str] = []
        handle = self.holder.handle

        def recording(msg: Any) -> Any:
            self.handled.append(type(msg).__name__)
            return handle(msg)

        self.holder.handle = recording  # type: ignore[method-assign]
        self.holder.hold([SendMeta(request_id=RID, block_ids=list(BLOCKS), token=TOKEN)])
        self.holder.serve()
        server = self.holder.server
        assert server is not None and server.auth is not None
        self.server = server

    def readers_done(self) -> set[str]:
        held = self.holder.held.get(RID)
        assert held is not None, "the request is no longer held"
        return set(held.readers_done)

    def deliver(self, frame: bytes) -> bytes:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.server.endpoint)
        try:
            sock.send_multipart([b"", frame])
            assert sock.poll(5000), "no answer within 5 s"
            return bytes(sock.recv_multipart()[-1])
        finally:
            sock.close(0)


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Rank, Rank]]:
    set_deployment_key(monkeypatch, KEY)
    # each rank its own authenticator and replay cache, as two worker processes have
    monkeypatch.setattr(auth, "from_env", lambda env=None: Authenticator([KEY.encode()]))
    ranks = (Rank(), Rank())
    try:
        yield ranks
    finally:
        for r in ranks:
            r.holder.stop()


def test_a_frame_replayed_to_another_rank_is_refused(two_ranks: tuple[Rank, Rank],
                                                     fault_report: Any) -> None:
    from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import CODEC, Done

    rank0, rank1 = two_ranks
    # D's Done to rank 0, as it goes over the wire (sealed for rank 0), captured
    frame, _nonce = Authenticator([KEY.encode()]).seal(
        CODEC.encode(Done(request_id=RID, reader="D/tp0", token=TOKEN)),
        audience=rank0.server.audience)

    def count(rank: Rank, reason: str) -> float:
        return auth.RECORDER.total("auth_refused", socket=rank.server.name, reason=reason)

    before = count(rank1, "misdirected")
    reply = rank1.deliver(frame)
    assert b"auth_refused" in reply and b"misdirected" in reply, reply
    assert fault_report.check("zero", count(rank1, "misdirected") == before + 1,
                              "rank 1 did not count the refusal")
    assert fault_report.check("zero", rank1.handled == [] and rank1.readers_done() == set(),
                              f"rank 1 ran {rank1.handled}")
    # where it was going it acts, once
    assert rank0.deliver(frame).startswith(auth.AUTH_MAGIC)
    assert rank0.handled == ["Done"]
    replays = count(rank0, "replay")
    assert b"replay" in rank0.deliver(frame)
    assert fault_report.check("survivor", count(rank0, "replay") == replays + 1
                              and rank0.handled == ["Done"], "rank 0 served a replay")
    assert rank1.readers_done() == set()  # rank 1 still holds the request for its reader
    fault_report(fault="a keyed D's Done for rank 0, captured and sent to rank 1 (another "
                       "process, its own replay cache) within the window",
                 happened="refused by rank 1 as misdirected (counted), no handler ran, the "
                          "request stayed held there; rank 0 took it once and refused its "
                          "replay",
                 deadline=None, client="ErrorReply(auth_refused)")
