# SPDX-License-Identifier: Apache-2.0
"""Every socket the connectors listen on, fuzzed inside a real engine; pickles; bind addresses.

One engine runs all four connectors that listen (vLLM's ``MultiConnector`` of
``MooncakeConnectorV1`` as P, ``MooncakeLayerwiseConnector`` as D, ``AscendStoreConnector``
with the embedded pool and ``CPUOffloadingConnector``), so it serves the P side channel,
the layerwise D side channel, the pool's lookup socket and the offload metadata server
at once. It binds ``127.0.0.2`` (``VLLM_ASCEND_KV_HOST``), not the loopback default, so a
socket bound anywhere else shows.

For each endpoint: hypothesis sends valid messages of its protocol, the same messages
mutated (bytes flipped, cut, spliced; fields of the wrong type; unknown tags; other wire
versions), other endpoints' messages and random bytes, over ZeroMQ with arbitrary
framing; then raw non-ZMTP bytes, oversize frames and pickles that would run code.
Every message must be answered (an error or a valid reply) within seconds, the engine's
resident memory must stay bounded, no pickle may run, and afterwards the endpoint, the
engine and a real P/D transfer from this engine must work as before.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import (
    ZmqProbe,
    evil_pickles,
    listening_sockets,
    raw_send,
    rss_bytes,
    start_in_parallel,
)
from ascend_kv_testing.fuzzing import listening_codecs, listening_multi_config, wire_payloads
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import PROBES, baseline, kv_config, prefill, prompts_of
from vllm_ascend.distributed.kv_transfer.core.wire import ErrorReply, Ping, Pong

HOST = "127.0.0.2"
#: Examples per endpoint (each one a round trip to the live engine); the soak session
#: runs many more.
EXAMPLES = int(os.environ.get("VLLM_ASCEND_KV_FUZZ_EXAMPLES", "150"))
#: Resident-memory growth allowed over all fuzzing of one endpoint.
RSS_SLACK = 64 << 20


CODECS = listening_codecs()
ENDPOINTS = sorted(CODECS)


def multi_config() -> dict[str, Any]:
    """Every listening connector in one engine."""
    return listening_multi_config("fuzz-multi", lease_ttl_s=30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tiny_llama(tmp_path_factory.mktemp("fuzz-model"))
    hosts = {"VLLM_ASCEND_KV_HOST": HOST, "MC_TCP_BIND_ADDRESS": HOST,
             "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": HOST}
    made = start_in_parallel({
        "multi": lambda: EngineProcess(model, multi_config(), env=hosts),
        "d": lambda: EngineProcess(model, kv_config("kv_consumer", "fuzz-d",
                                                    handshake_timeout_s=2.0)),
    })
    made["endpoints"] = made["multi"].call(f"{PROBES}:kv_endpoints")
    yield type("Cluster", (), made)
    made["d"].close()
    made["multi"].close()


def _check_answer(codec: Any, reply: list[bytes] | None, payload: bytes) -> None:
    assert reply is not None, f"no answer within 5s to {payload[:64]!r}"
    msg = codec.decode(reply[-1])  # whatever came back is a valid message of the protocol
    assert type(msg).__name__ in {t.__name__ for t in codec.types}


@pytest.mark.parametrize("role", ENDPOINTS)
def test_fuzzed_endpoint_answers_everything_and_serves_on(cluster: Any, role: str,
                                                         fault_report: Any) -> None:
    endpoint = cluster.endpoints[role]
    codec = CODECS[role]
    others = tuple(c for r, c in CODECS.items() if r != role)
    pid = cluster.multi.proc.pid
    probe = ZmqProbe(endpoint)
    rss0 = rss_bytes(pid)
    counts = {"error": 0, "reply": 0}

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(payload=wire_payloads(codec, others=others),
           extra_frames=st.lists(st.binary(max_size=16), max_size=2))
    def fuzz(payload: bytes, extra_frames: list[bytes]) -> None:
        reply = probe.ask([*extra_frames, payload])
        fault_report.check("deadline", reply is not None,
                           f"no answer within 5s to {payload[:32]!r}")
        _check_answer(codec, reply, payload)
        assert reply is not None
        counts["error" if isinstance(codec.decode(reply[-1]), ErrorReply) else "reply"] += 1

    try:
        fuzz()
        # frames over the size limit are dropped by libzmq (the connection goes); none of
        # them may be buffered whole, and the server must take new connections afterwards
        big = b"VAKV\x01" + b"\x00" * (codec.max_size + 4096)
        for _ in range(8):
            assert probe.ask([big], timeout_s=1.0) is None
            probe.reconnect()
        pong = codec.decode(probe.ask([codec.encode(Ping())])[-1])  # type: ignore[index]
        assert fault_report.check("survivor", isinstance(pong, Pong),
                                  f"Ping afterwards got {type(pong).__name__}")
    finally:
        probe.close()
    grown = rss_bytes(pid) - rss0
    assert grown < RSS_SLACK, f"{role}: resident memory grew by {grown >> 20} MiB"
    assert counts["error"] > 0  # the fuzzer did reach the rejection paths
    assert cluster.multi.call(f"{PROBES}:kv_endpoints")[role] == endpoint
    fault_report(fault=f"fuzzing the {role.replace('_', ' ')} ({endpoint.split('://')[0]})",
                 happened=f"{sum(counts.values())} messages: {counts['error']} rejected, "
                          f"{counts['reply']} answered; 8 oversize frames dropped; resident "
                          f"memory {grown / (1 << 20):+.1f} MiB; Ping answered afterwards",
                 deadline="every message answered < 5s", zero=None,
                 client="an error reply naming the problem")


@pytest.mark.parametrize("role", ENDPOINTS)
def test_raw_bytes_that_are_not_zmtp_do_not_hurt(cluster: Any, role: str) -> None:
    endpoint = cluster.endpoints[role]
    junk = [b"\x00" * 64, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 64,
            b"\xff" + b"\x00" * 8 + b"\x7f" + b"\xff" * 4096,  # a ZMTP greeting, then garbage
            b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f\x03\x00NULL" + b"\x00" * 48 + b"\x04\xff"]
    for data in junk:
        raw_send(endpoint, data, timeout_s=1.0)
    probe = ZmqProbe(endpoint)
    try:
        reply = probe.ask([CODECS[role].encode(Ping())])
        assert reply is not None and isinstance(CODECS[role].decode(reply[-1]), Pong)
    finally:
        probe.close()


@pytest.mark.parametrize("role", ENDPOINTS)
def test_a_pickle_that_would_run_code_is_never_run(cluster: Any, role: str,
                                                   tmp_path: Path) -> None:
    marker = tmp_path / f"pwned-{role}"
    probe = ZmqProbe(cluster.endpoints[role])
    try:
        for payload in evil_pickles(marker):
            reply = probe.ask([payload])
            assert reply is not None
            err = CODECS[role].decode(reply[-1])
            assert isinstance(err, ErrorReply) and err.code == "bad_message"
            raw_send(cluster.endpoints[role], payload, timeout_s=0.5)
    finally:
        probe.close()
    assert not marker.exists(), f"{role} unpickled a peer's bytes"


def test_engine_and_pd_transfer_work_after_the_fuzzing(cluster: Any) -> None:
    """Runs after the fuzz tests (file order): the fuzzed engine still computes the right
    tokens, still hands its KV to a D over the fuzzed side channel, and holds nothing."""
    multi, d = cluster.multi, cluster.d
    prompts = prompts_of([100, 65, 33], seed=301)
    want = baseline(d, prompts)
    assert [r.token_ids for r in multi.generate(prompts, max_tokens=8)] == want
    params = prefill(multi, prompts)
    got = d.generate(prompts, max_tokens=8, kv_params=params)
    assert [g.token_ids for g in got] == want
    loaded = d.call(f"{PROBES}:connector_totals").get("p2p_requests_loaded", 0)
    assert loaded >= len(prompts)
    for engine in (multi, d):
        assert engine.wait_idle(30)
        s = engine.call(f"{PROBES}:leak_state")
        assert s["requests"] == 0 and s["used_blocks"] == 0 and s["p2p_held"] == 0, s


def _mooncake_wildcards() -> int:
    """How many listening sockets a bare Mooncake transfer engine opens on every interface
    (its RPC/handshake port and its TCP transport ignore MC_TCP_BIND_ADDRESS)."""
    code = (
        "import os, time\n"
        "from mooncake.engine import TransferEngine\n"
        f"te = TransferEngine(); assert te.initialize('{HOST}', 'P2PHANDSHAKE', 'tcp', '') == 0\n"
        "from ascend_kv_testing.faults import listening_sockets\n"
        "print(sum(s.wildcard for s in listening_sockets(os.getpid())))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={"MC_TCP_BIND_ADDRESS": HOST, "PATH": "/usr/bin:/bin"},
                         check=True)
    return int(out.stdout.strip().splitlines()[-1])


def test_sockets_bind_the_configured_interface(cluster: Any, fault_report: Any) -> None:
    """Every socket of ours listens on VLLM_ASCEND_KV_HOST (TCP) or is a Unix socket; the
    only sockets on every interface are the ones Mooncake's transfer engine opens itself."""
    endpoints = cluster.endpoints
    sockets = listening_sockets(cluster.multi.proc.pid)
    ours = {}
    for role in ENDPOINTS:
        ep = endpoints[role]
        if ep.startswith("tcp://"):
            port = int(ep.rsplit(":", 1)[1])
            ours[role] = [str(s) for s in sockets if s.port == port]
            assert ours[role] == [f"tcp:{HOST}:{port}"], (role, ours[role])
        else:
            path = ep[len("ipc://"):]
            ours[role] = [str(s) for s in sockets if s.path == path]
            assert ours[role] == [f"unix:{path}"], (role, ours[role])
    te_port = int(endpoints["transfer_engine"].rsplit(":", 1)[1])
    wild = [s for s in sockets if s.wildcard]
    assert te_port in {s.port for s in wild}  # Mooncake's own
    assert len(wild) == _mooncake_wildcards(), [str(s) for s in wild]
    fault_report(fault="socket bind addresses (VLLM_ASCEND_KV_HOST=127.0.0.2)",
                 happened="side channels on 127.0.0.2; lookup and offload servers on Unix "
                          f"sockets; {len(wild)} wildcard listeners, all Mooncake's own "
                          "transfer engine (RPC port and TCP transport ignore "
                          "MC_TCP_BIND_ADDRESS)",
                 deadline=None, survivor=None, zero=None, client="n/a")
