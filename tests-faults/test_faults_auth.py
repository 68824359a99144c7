# SPDX-License-Identifier: Apache-2.0
"""With a deployment key, valid-looking frames without it are refused on every socket.

One engine with a deployment key runs every connector that listens (the P side channel
of ``MooncakeConnectorV1``, the layerwise D side channel, the pool's lookup socket and the
offload metadata server, as in ``test_faults_sockets``) and holds one real request for a
D (its ``kv_transfer_params``, capability token included, are known to the outsider).

For each endpoint hypothesis sends well-formed msgspec frames of every message type of
its protocol, and messages aimed at the held request (``Claim``, ``Renew``, ``Done`` with
its id and token), each in one of the ways an outsider has: unsigned, signed with another
key, signed with the right key but a stale timestamp, or a validly signed frame replayed
(its first delivery went to another socket of the process, whose codec does not know the
type, so it did nothing there), or one sealed for another socket (misdirected). Every one is answered ``auth_refused`` and counted in
``auth_refused`` under its reason; the server serves on; the held request stays held,
with no reader done; and a keyed client then frees it with the token, as D would.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import ZmqProbe, wait_for
from ascend_kv_testing.fuzzing import listening_codecs, listening_multi_config, struct_strategy
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import PROBES, prefill, prompts_of
from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.auth import Authenticator
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient
from vllm_ascend.distributed.kv_transfer.core.wire import ErrorReply, Message, Ping, Pong

HOST = "127.0.0.1"
KEY = "the-deployment-key-of-the-fault-tests-0123456789"
#: Examples per endpoint (each one or two round trips to the live engine).
EXAMPLES = int(os.environ.get("VLLM_ASCEND_KV_FUZZ_AUTH_EXAMPLES", "60"))
#: how each outsider's frame fails the check -> the refusal reason it is counted under
MODES = {"unsigned": "unauthenticated", "other_key": "bad_mac", "stale": "stale",
         "replayed": "replay", "misdirected": "misdirected"}


CODECS = listening_codecs()
ENDPOINTS = sorted(CODECS)


def multi_config() -> dict[str, Any]:
    """Every listening connector in one engine; P's lease outlives the fuzzing."""
    return listening_multi_config("auth-multi", lease_ttl_s=600)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tiny_llama(tmp_path_factory.mktemp("auth-model"))
    engine = EngineProcess(model, multi_config(), env={
        auth.ENV_KEY: KEY, "VLLM_ASCEND_KV_HOST": HOST, "MC_TCP_BIND_ADDRESS": HOST,
        "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": HOST})
    try:
        (params,) = prefill(engine, prompts_of([70], seed=919))
        assert params.get("remote_claim_token"), params  # a keyed P issues capabilities
        endpoints = engine.call(f"{PROBES}:kv_endpoints")
        # what a keyed frame to each must be sealed for (the side channels bind the engine)
        audiences = engine.call(f"{PROBES}:kv_audiences")
        # P's side channel is bound to the engine its params name (what D seals for)
        assert audiences["p2p_side_channel"] == auth.audience_of(
            endpoints["p2p_side_channel"], params["remote_engine_id"]), audiences
        # P's worker takes the hold a step after the prefill finished: wait for it, or the
        # first test's "before" would count 0 held
        assert wait_for(lambda: p2p_held(engine) == 1, 60), engine.call(
            f"{PROBES}:leak_state")
        yield type("Keyed", (), {"engine": engine, "params": params, "endpoints": endpoints,
                                 "audiences": audiences})
    finally:
        engine.close()


def held_messages(params: dict[str, Any]) -> list[Message]:
    """What an outsider who read the held request's params would send to P."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import Claim, Done, Renew

    rid, token = params["remote_request_id"], params["remote_claim_token"]
    return [Claim(request_id=rid, block_ids=list(params["remote_block_ids"]), reader="x",
                  token=token),
            Renew(request_ids=[rid]),
            Done(request_id=rid, reader="x", token=token),
            Done(request_id=rid, reader="x", success=False, num_readers=1, token=token)]


def p2p_held(engine: EngineProcess) -> int:
    return int(engine.call(f"{PROBES}:leak_state")["p2p_held"])


@pytest.mark.parametrize("role", ENDPOINTS)
def test_unauthenticated_frames_are_refused_counted_and_change_nothing(
        keyed: Any, role: str, fault_report: Any) -> None:
    engine, endpoints, audiences = keyed.engine, keyed.endpoints, keyed.audiences
    codec = CODECS[role]
    targeted = held_messages(keyed.params) if role == "p2p_side_channel" else []
    messages = st.one_of(*[struct_strategy(t) for t in codec.types],
                         *([st.sampled_from(targeted)] if targeted else []))
    signer = Authenticator([KEY.encode()])
    outsiders = {"other_key": Authenticator([b"an-outsiders-guess-at-the-key-0000"]),
                 "stale": Authenticator([KEY.encode()], clock=lambda: time.time() - 3600)}
    probe = ZmqProbe(endpoints[role])
    sinks = {r: ZmqProbe(endpoints[r]) for r in ENDPOINTS if r != role}
    held_before = p2p_held(engine)
    before = engine.call(f"{PROBES}:auth_refused")
    sent: Counter[str] = Counter()
    answered = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(msg=messages, mode=st.sampled_from(sorted(set(MODES) - {"misdirected"})))
    def fuzz(msg: Message, mode: str) -> None:
        payload = codec.encode(msg)
        if mode == "unsigned":
            frame = payload
        elif mode == "replayed":
            # sealed for, and first delivered to, a socket of the same process that cannot
            # decode the type (the replay cache is the process's), so it acts nowhere; here
            # it is a replay where the binding names both sockets alike (ipc), else
            # misdirected (sealed for another receiver)
            sink = next((r for r in sinks if type(msg) not in CODECS[r].types), None)
            if sink is None:  # a type every protocol has (Ping, Ack, ...): harmless anywhere
                sink = next(iter(sinks))
            frame, _nonce = signer.seal(payload, audience=audiences[sink])
            first = sinks[sink].ask([frame])
            assert first is not None, f"{sink} did not answer the first delivery"
            if audiences[sink] != audiences[role]:
                mode = "misdirected"
        else:
            frame, _nonce = outsiders[mode].seal(payload,  # addressed to this socket
                                                 audience=audiences[role])
        reply = probe.ask([frame])
        fault_report.check("deadline", reply is not None,
                           f"no answer within 5s to a {mode} {type(msg).__name__}")
        assert reply is not None
        err = codec.decode(reply[-1])  # an unsigned refusal: readable without the key
        assert isinstance(err, ErrorReply) and err.code == "auth_refused", (mode, msg, err)
        sent[MODES[mode]] += 1
        answered.append(type(msg).__name__)

    try:
        fuzz()
    finally:
        probe.close()
        for s in sinks.values():
            s.close()
    after = engine.call(f"{PROBES}:auth_refused")
    counted = {r: after.get(r, 0.0) - before.get(r, 0.0) for r in MODES.values()}
    assert counted == {r: float(sent[r]) for r in MODES.values()}, (counted, sent)
    # the server serves on, for a peer with the key
    client = RpcClient(endpoints[role], codec, timeout_s=5, auth=Authenticator([KEY.encode()]),
                       audience=audiences[role])
    try:
        pong = client.call(Ping())
    finally:
        client.close()
    fault_report.check("survivor", isinstance(pong, Pong), "a keyed Ping afterwards")
    assert isinstance(pong, Pong)
    held_after = p2p_held(engine)
    fault_report.check("zero", held_after == held_before,
                       f"P holds {held_after} requests (before: {held_before})")
    assert held_after == held_before == 1
    fault_report(fault=f"outsider without the key on the {role.replace('_', ' ')} "
                       "(unsigned, other key, stale, replayed and misdirected frames)",
                 happened=f"{sum(sent.values())} frames of {len(set(answered))} message types "
                          "refused and counted (" + ", ".join(
                              f"{r} {sent[r]}" for r in MODES.values()) + "); the held "
                          "request stayed held",
                 deadline="every frame answered < 5s", zero="nothing held or freed",
                 client="ErrorReply(auth_refused)")


def test_the_held_request_is_intact_and_a_keyed_d_frees_it(keyed: Any) -> None:
    """Runs after the fuzzing (file order): no outsider's Done counted as a reader, and the
    request's owner (the key and the token) frees it as D does."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import CODEC, Done, DoneAck

    engine, params = keyed.engine, keyed.params
    assert p2p_held(engine) == 1
    client = RpcClient(keyed.endpoints["p2p_side_channel"], CODEC, timeout_s=5,
                       auth=Authenticator([KEY.encode()]),
                       engine_id=params["remote_engine_id"])  # as D: P's engine, from params
    try:
        ack = client.call(Done(request_id=params["remote_request_id"], reader="d/tp0",
                               token=params["remote_claim_token"]))
    finally:
        client.close()
    assert isinstance(ack, DoneAck) and ack.valid  # held, with no reader done, until now
    assert engine.wait_idle(30)
    state = engine.call(f"{PROBES}:leak_state")
    assert state["p2p_held"] == 0 and state["used_blocks"] == 0, state
