# SPDX-License-Identifier: Apache-2.0
"""``doctor`` finds where the transfer engine's ports are reachable, by trying them."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest

from ascend_kv_testing.requires import require
from vllm_ascend.distributed.kv_transfer.core.tooling import doctor_listeners
from vllm_ascend.distributed.kv_transfer.core.tooling.doctor import Doctor


def non_loopback() -> list[str]:
    return [a for a in doctor_listeners.local_addresses()
            if not ipaddress.ip_address(a).is_loopback]


def test_own_listeners_sees_a_socket_bound_here_and_where() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ("127.0.0.1", port) in doctor_listeners.own_listeners()
    assert all(p != port for _a, p in doctor_listeners.own_listeners())


def test_local_addresses_include_loopback_and_parse() -> None:
    addrs = doctor_listeners.local_addresses()
    assert "127.0.0.1" in addrs
    for a in addrs:
        ipaddress.ip_address(a)


def test_a_wildcard_listener_is_exposed_a_loopback_one_is_not() -> None:
    others = non_loopback()
    addrs = doctor_listeners.local_addresses()
    with socket.socket() as wild, socket.socket() as lo:
        wild.bind(("0.0.0.0", 0))
        wild.listen()
        lo.bind(("127.0.0.1", 0))
        lo.listen()
        w, l_ = wild.getsockname()[1], lo.getsockname()[1]
        got = doctor_listeners.exposures([("0.0.0.0", w), ("127.0.0.1", l_)], addrs,
                                         "127.0.0.1")
    v4 = [a for a in others if ":" not in a]
    assert got.get(w, []) == v4 or (not v4 and w not in got)
    assert l_ not in got  # bound to the chosen address only: reachable nowhere else


class _Report:
    def __init__(self) -> None:
        self.checks: list[tuple[str, str, str]] = []

    def ok(self, what: str, detail: str = "") -> None:
        self.checks.append(("ok", what, detail))

    def warn(self, what: str, detail: str, fix: str = "") -> None:
        self.checks.append(("warn", what, detail))

    def fail(self, what: str, detail: str, fix: str = "") -> None:
        self.checks.append(("fail", what, detail))


def test_the_probe_of_a_real_engine_reports_its_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    require("mooncake.engine", why="the probe starts a real Mooncake transfer engine")
    report = _Report()
    doctor_listeners.check(report, "127.0.0.1")
    [(status, what, detail)] = report.checks
    assert what == "Mooncake ports reachable"
    assert "listens on" in detail, detail
    # Mooncake listens on every interface: with another interface here, the probe says so
    assert status == ("warn" if non_loopback() else "ok"), detail
    assert "not the running instance's" in detail  # says what it checked
    keyed = _Report()
    doctor_listeners.check(keyed, "127.0.0.1", keyed=True)
    [(status, _what, detail)] = keyed.checks
    assert status == ("fail" if non_loopback() else "ok"), detail


@pytest.mark.parametrize(("keyed", "status"), [(True, "fail"), (False, "warn")])
def test_an_exposed_port_fails_under_a_key_and_warns_without(
        monkeypatch: pytest.MonkeyPatch, keyed: bool, status: str) -> None:
    import json
    import subprocess

    probe = {"host": "10.20.0.11", "rpc_port": 15001, "listeners": [["0.0.0.0", 15001]],
             "exposed": {"15001": ["192.0.2.4"]}, "bind_env": "10.20.0.11"}
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout=json.dumps(probe) + "\n", stderr=""))
    report = _Report()
    doctor_listeners.check(report, "10.20.0.11", keyed=keyed)
    [(got, what, detail)] = report.checks
    assert (got, what) == (status, "Mooncake ports reachable")
    assert "port 15001 on 192.0.2.4" in detail and ("key or no key" in detail) == keyed


def test_doctor_runs_the_probe_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[Any] = []
    monkeypatch.setattr(doctor_listeners, "check", lambda d, host: seen.append(host))
    Doctor({"kv_connector": "X", "kv_role": "kv_both"}).run()
    assert seen == []
    Doctor({"kv_connector": "X", "kv_role": "kv_both"}, probe_listeners=True).run()
    assert len(seen) == 1


@pytest.mark.parametrize("where", ["option", "multi", "env"])
def test_under_protocol_local_no_mooncake_port_is_opened_or_probed(
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    import subprocess

    def no_probe(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a probe engine was started under protocol local")

    monkeypatch.setattr(subprocess, "run", no_probe)
    monkeypatch.delenv("VLLM_ASCEND_KV_PROTOCOL", raising=False)
    cfg: dict[str, Any] = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer"}
    if where == "option":
        cfg["kv_connector_extra_config"] = {"protocol": "local"}
    elif where == "multi":
        cfg = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "MooncakeConnectorV1",
             "kv_connector_extra_config": {"protocol": "local"}}]}}
    else:
        monkeypatch.setenv("VLLM_ASCEND_KV_PROTOCOL", "local")
    report = _Report()
    report.kv_config = cfg  # type: ignore[attr-defined]
    doctor_listeners.check(report, "127.0.0.1", keyed=True)
    [(status, what, detail)] = report.checks
    assert (status, what) == ("ok", "Mooncake ports reachable")
    assert "no Mooncake port is opened" in detail
    # a config with another protocol is probed
    monkeypatch.setenv("VLLM_ASCEND_KV_PROTOCOL", "tcp")
    assert doctor_listeners.transfer_protocol({"kv_connector_extra_config": {}}) == "tcp"
    with pytest.raises(AssertionError, match="probe engine"):
        doctor_listeners.check(_Report(), "127.0.0.1")
