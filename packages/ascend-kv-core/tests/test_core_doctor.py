# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv doctor`` checks that need only ascend-kv-core (each connector's own checks
are tested in its package, ``test_*_doctor.py``; the full-stack cases with every connector
package and a real mooncake_master are in tests-e2e/test_doctor_e2e.py)."""

from __future__ import annotations

import json
import socket
import threading

import pytest

from vllm_ascend.distributed.kv_transfer.core.channel import RpcServer, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.core.tooling.cli import main
from vllm_ascend.distributed.kv_transfer.core.tooling.doctor import Doctor, render
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


def test_unknown_connector_names_the_installed_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.core.tooling import plugins

    monkeypatch.setattr(plugins, "entry_points", lambda group: [_FakeEntryPoint(
        "KnownConnector", group, lambda *a: None)])
    d = Doctor({"kv_connector": "ProbeConnector", "kv_role": "kv_both"})
    d.run()
    warn = next(c for c in d.checks if c.what == "kv_connector")
    assert warn.status == "warn" and "ProbeConnector" in warn.detail
    assert "KnownConnector" in warn.detail and plugins.DOCTOR_GROUP in warn.detail


class _FakeEntryPoint:
    def __init__(self, name: str, group: str, target: object) -> None:
        self.name, self.group, self.value, self.dist = name, group, "fake:target", None
        self._target = target

    def load(self) -> object:
        return self._target


def test_a_connector_s_doctor_plugin_gets_the_doctor(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.core.tooling import plugins

    seen: list[tuple[object, ...]] = []

    def check(doctor: Doctor, connector: str, extra: object, where: str, cfg: object) -> None:
        seen.append((connector, extra, where))
        doctor.fail("probe", "from the plugin")

    monkeypatch.setattr(plugins, "entry_points", lambda group: [
        _FakeEntryPoint("ProbeConnector", group, check)] if group == plugins.DOCTOR_GROUP
        else [])
    cfg = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"connectors": [
               {"kv_connector": "ProbeConnector", "kv_connector_extra_config": {"a": 1}}]}}
    d = Doctor(cfg)
    got = statuses(d)
    assert seen == [("ProbeConnector", {"a": 1}, "connectors[0]")]
    assert got["probe"] == "fail" and got["package providing ProbeConnector"] == "ok"
    assert not d.healthy


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


def test_parallel_sizes_count_the_workers_on_this_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm serve's parallel flags tell doctor how many workers share the host."""
    from vllm_ascend.distributed.kv_transfer.core.tooling import doctor as doctor_mod

    seen: list[int] = []
    monkeypatch.setattr(doctor_mod.Doctor, "run", lambda self: seen.append(
        self.workers_on_host) or [])
    cfg = '{"kv_connector": "X", "kv_role": "kv_both"}'
    assert main(["doctor", "--kv-transfer-config", cfg]) == 0
    assert main(["doctor", "--kv-transfer-config", cfg, "-tp", "4", "-pp", "2",
                 "--nnodes", "2", "-dpl", "3"]) == 0
    assert main(["doctor", "--kv-transfer-config", cfg, "--tensor-parallel-size", "8"]) == 0
    assert seen == [1, 4 * 2 // 2 * 3, 8]
    assert Doctor({}).workers_on_host == 1
    with pytest.raises(SystemExit):
        main(["doctor", "--kv-transfer-config", cfg, "-tp", "0"])


def test_kv_port_range_and_free_port_check() -> None:
    from vllm_ascend.distributed.kv_transfer.core.tooling.doctor import kv_port

    assert kv_port({}) == 14579
    assert [kv_port({"kv_port": p}) for p in (1, 65535)] == [1, 65535]
    assert {kv_port({"kv_port": p}) for p in (0, 65536, -1, True, 1.5, "14579", None)} == {None}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        d = Doctor({})
        d.check_port_free(busy.getsockname()[1])
        d.check_port_free(free_port())
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
        d.check_metadata_server(url)
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
        d.check_metadata_server(f"http://127.0.0.1:{free_port()}/metadata")
        assert d.checks[0].status == "fail" and "refused" in d.checks[0].detail.lower()
    finally:
        proxy.close()
