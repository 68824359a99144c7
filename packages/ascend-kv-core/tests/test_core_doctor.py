# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv doctor`` checks that need only ascend-kv-core (the full-stack cases with
every connector package and a real mooncake_master are in tests-e2e/test_doctor_e2e.py)."""

from __future__ import annotations

import json
import socket
import threading
import types

import pytest

from vllm_ascend.distributed.kv_transfer.core.channel import RpcServer, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.cli import main
from vllm_ascend.distributed.kv_transfer.core.doctor import Doctor, render
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.core.wire import Codec


def statuses(doctor: Doctor) -> dict[str, str]:
    return {c.what: c.status for c in doctor.run()}


def test_not_an_object_and_bad_top_level_keys() -> None:
    assert Doctor([1, 2]).run()[0].status == "fail"
    d = Doctor({"kv_connector": "SomethingElse", "kv_role": "kv_maker", "kv_port": 70000,
                "kv_load_failure_policy": "retry"})
    got = statuses(d)
    assert got["kv_role"] == "fail" and got["kv_port"] == "fail"
    assert got["kv_load_failure_policy"] == "fail" and got["kv_connector"] == "warn"
    assert not d.healthy
    text = render(d.checks)
    assert "kv_maker" in text and "fix:" in text and "problem(s) to fix" in text


def test_missing_provider_package_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.core import doctor

    monkeypatch.setitem(doctor.PROVIDERS, "ProbeConnector", "no-such-distribution-xyz")
    d = Doctor({"kv_connector": "ProbeConnector", "kv_role": "kv_both"})
    d.run()
    fail = next(c for c in d.checks if c.what == "package no-such-distribution-xyz")
    assert fail.status == "fail" and "pip install 'no-such-distribution-xyz" in fail.fix


def test_peer_ping() -> None:
    server = RpcServer(tcp_endpoint("127.0.0.1", 0), Codec([]), lambda m: m, name="peer").start()
    try:
        dead = f"127.0.0.1:{free_port()}"
        d = Doctor({"kv_connector": "X", "kv_role": "kv_both"},
                   peers=[f"127.0.0.1:{server.port}", dead, "nonsense"], timeout_s=0.5)
        got = statuses(d)
        assert got[f"peer 127.0.0.1:{server.port}"] == "ok"
        assert got[f"peer {dead}"] == "fail" and got["peer nonsense"] == "fail"
    finally:
        server.stop()


def test_cli_exit_status_and_json(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    assert main(["doctor", "--kv-transfer-config", "{not json"]) == 1
    assert "cannot read it" in capsys.readouterr().out
    cfg = json.dumps({"kv_connector": "X", "kv_role": "bogus"})
    assert main(["doctor", "--kv-transfer-config", cfg, "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and any(c["what"] == "kv_role" for c in out["checks"])


def test_stall_bound_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig

    d = Doctor({})
    section = MooncakeP2PConfig.from_dict({"lease_ttl_s": 30, "load_timeout_s": 20})
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "5")
    d._check_stall_bound("MooncakeConnectorV1", section)
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "30")
    d._check_stall_bound("MooncakeConnectorV1", section)
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "soon")
    d._check_stall_bound("MooncakeConnectorV1", section)
    assert [c.status for c in d.checks] == ["ok", "warn", "warn"]
    assert "load_timeout_s=20" in d.checks[1].detail


@pytest.mark.parametrize("port", ["abc", 70000, None])
def test_bad_kv_port_of_a_producer_is_reported_not_a_traceback(
        port: object, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # The free-port check of a P/D producer used to int() and bind kv_port before it was
    # validated: "abc" raised ValueError, 70000 OverflowError, null TypeError. The provider
    # package is faked installed so the check is reached without ascend-kv-p2p.
    from vllm_ascend.distributed.kv_transfer.core import doctor

    real_version = doctor.metadata.version
    monkeypatch.setattr(doctor, "metadata", types.SimpleNamespace(
        version=lambda d: "0.0.test" if d == "ascend-kv-p2p" else real_version(d),
        PackageNotFoundError=doctor.metadata.PackageNotFoundError))
    bound: list[int] = []
    monkeypatch.setattr(Doctor, "_check_port_free", lambda self, p: bound.append(p))
    for role in ("kv_producer", "kv_both"):
        cfg = {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": port}
        assert main(["doctor", "--kv-transfer-config", json.dumps(cfg), "--timeout", "0.5"]) == 1
        out = capsys.readouterr().out
        line = next(ln for ln in out.splitlines() if ln.startswith("FAIL  kv_port"))
        assert f"kv_port={json.dumps(port)} " in line and "1..65535" in line, out
        assert "Traceback" not in out
    assert bound == []  # no free-port check of an invalid port
    # a valid port still gets its free-port check
    cfg = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": 15000}
    main(["doctor", "--kv-transfer-config", json.dumps(cfg)])
    assert bound == [15000] and "FAIL  kv_port" not in capsys.readouterr().out


def test_kv_port_range_and_free_port_check() -> None:
    from vllm_ascend.distributed.kv_transfer.core.doctor import _kv_port

    assert _kv_port({}) == 14579
    assert [_kv_port({"kv_port": p}) for p in (1, 65535)] == [1, 65535]
    assert {_kv_port({"kv_port": p}) for p in (0, 65536, -1, True, 1.5, "14579", None)} == {None}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        d = Doctor({})
        d._check_port_free(busy.getsockname()[1])
        d._check_port_free(free_port())
    assert [c.status for c in d.checks] == ["warn", "ok"]


class _Listener:
    """A TCP listener on loopback that answers each connection with ``reply`` (bytes) and closes,
    or with nothing until the client gives up when ``reply`` is None."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.reply = reply
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                if self.reply is None:
                    conn.settimeout(5)
                    try:
                        conn.recv(65536)
                        conn.recv(65536)  # hold the connection until the client closes it
                    except OSError:
                        pass
                    continue
                conn.recv(65536)
                conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()


def _http(status: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            .encode() + body)


@pytest.mark.parametrize(("reply", "want"), [
    (_http("404 Not Found", b"metadata not found"), "ok"),  # Mooncake, unknown key
    (_http("404 Not Found", b"404 Not Found"), "warn"),  # HTTP, but the wrong path
    (_http("200 OK", b"# HELP ..."), "fail"),  # answers a key nobody wrote: not Mooncake
    (_http("500 Internal Server Error", b"boom"), "fail"),
    (b"\x21\x00\x01not http at all\r\n", "fail"),  # a binary RPC port, like the master's
    (b"", "fail"),  # accepts and closes
    (None, "fail"),  # accepts and never answers
])
def test_metadata_server_is_checked_over_http(reply: bytes | None, want: str) -> None:
    listener = _Listener(reply)
    try:
        url = f"http://127.0.0.1:{listener.port}/metadata"
        d = Doctor({}, timeout_s=0.5)
        d._check_metadata_server(url)
        (check,) = d.checks
        assert (check.what, check.status) == ("metadata server", want), check
        assert url in check.detail
        if want != "ok":
            assert "metadata_server" in check.fix
    finally:
        listener.close()


def test_metadata_server_down_and_no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # a proxy in the environment must not answer for the metadata server
    proxy = _Listener(_http("404 Not Found", b"metadata not found"))
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    try:
        d = Doctor({}, timeout_s=0.5)
        d._check_metadata_server(f"http://127.0.0.1:{free_port()}/metadata")
        assert d.checks[0].status == "fail" and "refused" in d.checks[0].detail.lower()
    finally:
        proxy.close()


def test_master_check_says_only_the_port_was_reached(tmp_path: object) -> None:
    from pathlib import Path

    listener = _Listener(b"")
    try:
        path = Path(str(tmp_path)) / "mooncake.json"
        path.write_text(json.dumps({"master_server_address": f"127.0.0.1:{listener.port}",
                                    "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}))
        d = Doctor({}, mooncake_config=str(path), timeout_s=0.5)
        d._check_pool_backend(types.SimpleNamespace(backend="mooncake", mooncake=None))
        master = next(c for c in d.checks if c.what == "mooncake_master")
        assert master.status == "ok" and "TCP connect only" in master.detail
        assert not any(c.what == "metadata server" for c in d.checks)  # P2PHANDSHAKE
    finally:
        listener.close()
