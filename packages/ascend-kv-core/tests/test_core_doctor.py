# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv doctor`` checks that need only ascend-kv-core (the full-stack cases with
every connector package and a real mooncake_master are in tests-e2e/test_doctor_e2e.py)."""

from __future__ import annotations

import json

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
    from vllm_ascend.distributed.kv_transfer.core.config.p2p import MooncakeP2PConfig

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
