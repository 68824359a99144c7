# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv doctor`` checks of the P/D connectors (``kv_p2p.tooling.doctor``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.core.tooling.doctor import Doctor
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.tooling import doctor as p2p_doctor


def test_stall_bound_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Doctor({})
    section = MooncakeP2PConfig.from_dict({"lease_ttl_s": 30, "load_timeout_s": 20})
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "5")
    p2p_doctor.check_stall_bound(d, section)
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "30")
    p2p_doctor.check_stall_bound(d, section)
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "soon")
    p2p_doctor.check_stall_bound(d, section)
    assert [c.status for c in d.checks] == ["ok", "warn", "warn"]
    assert "load_timeout_s=20" in d.checks[1].detail


def _run(cfg: dict[str, Any]) -> Doctor:
    d = Doctor(cfg, timeout_s=0.5)
    d._check_top_level(cfg)
    p2p_doctor.check(d, "MooncakeConnectorV1", cfg.get("kv_connector_extra_config", {}),
                     "kv_connector_extra_config", cfg)
    return d


@pytest.mark.parametrize("port", ["abc", 70000, None])
def test_bad_kv_port_of_a_producer_is_reported_not_a_traceback(
        port: object, monkeypatch: pytest.MonkeyPatch) -> None:
    # The free-port check of a P/D producer used to int() and bind kv_port before it was
    # validated: "abc" raised ValueError, 70000 OverflowError, null TypeError.
    bound: list[int] = []
    monkeypatch.setattr(Doctor, "check_port_free", lambda self, p: bound.append(p))
    for role in ("kv_producer", "kv_both"):
        d = _run({"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": port})
        fail = next(c for c in d.checks if c.what == "kv_port")
        assert fail.status == "fail"
        assert f"kv_port={json.dumps(port)} " in fail.detail and "1..65535" in fail.detail
    assert bound == []  # no free-port check of an invalid port
    # a valid port still gets its free-port check, and a consumer none
    d = _run({"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": 15000})
    assert bound == [15000] and not any(c.what == "kv_port" for c in d.checks)
    _run({"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_consumer", "kv_port": 15001})
    assert bound == [15000]


def test_a_bad_key_is_reported_with_the_section_to_read() -> None:
    d = _run({"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_consumer",
              "kv_connector_extra_config": {"lease_ttl_s": "soon"}})
    fail = next(c for c in d.checks if c.what == "MooncakeConnectorV1 configuration")
    assert fail.status == "fail" and "soon" in fail.detail
    assert "vllm-ascend-kv config MooncakeConnectorV1" in fail.fix


@pytest.mark.parametrize(("env", "status", "says"), [
    ({}, "warn", "VLLM_CPU_OMP_THREADS_BIND=auto"),  # vLLM's default
    ({"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, "warn", "GOMP_SPINCOUNT=0"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, "ok", "pinned"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "GOMP_SPINCOUNT": "0"}, "ok", "passive"),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, "ok", "passive"),
    ({"GOMP_SPINCOUNT": "1000"}, "warn", "spin"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"}, "ok", "pinned"),  # one list per rank
    ({"VLLM_CPU_OMP_THREADS_BIND": "cores0"}, "warn", "nor a CPU list"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "1-", "GOMP_SPINCOUNT": "0"}, "warn", "nor a CPU list"),
])
def test_a_cpu_producer_whose_openmp_threads_are_not_pinned_gets_the_advice(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], status: str, says: str) -> None:
    monkeypatch.setenv("VLLM_ASCEND_KV_DEVICE", "cpu")
    d = Doctor({})
    p2p_doctor.check_openmp_spin(d, env)
    [c] = d.checks
    assert (c.status, c.what) == (status, "OpenMP threads (P on CPU)")
    assert says in c.detail + c.fix
    assert d.healthy  # advice, never a failure


def test_the_openmp_advice_is_for_cpu_producers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("VLLM_ASCEND_KV_DEVICE", "npu")
    d = Doctor({})
    p2p_doctor.check_openmp_spin(d)
    assert d.checks == []  # the threads that compute are the NPU's
    monkeypatch.setenv("VLLM_ASCEND_KV_DEVICE", "cpu")
    extra = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}}
    consumer = _run({"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_consumer",
                     "kv_connector_extra_config": extra})
    assert not [c for c in consumer.checks if c.what.startswith("OpenMP")]
    producer = _run({"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer",
                     "kv_connector_extra_config": extra})
    assert [c.status for c in producer.checks if c.what.startswith("OpenMP")] == ["warn"]


def test_doctor_says_whether_vllm_keeps_the_hybrid_kv_cache_manager_on() -> None:
    """vLLM's own rule (every connector declares ``SupportsHMA``), asked of vLLM."""
    def line(cfg: dict[str, Any]) -> Any:
        d = Doctor(cfg, timeout_s=0.5)
        d._check_hybrid(cfg)
        [check] = [c for c in d.checks if c.what == "hybrid KV cache manager"]
        return check

    for name in ("MooncakeConnectorV1", "MooncakeLayerwiseConnector"):
        check = line({"kv_connector": name, "kv_role": "kv_consumer"})
        assert check.status == "ok" and check.detail.startswith("stays on"), check
    # vLLM's own example connector does not declare SupportsHMA
    off = line({"kv_connector": "ExampleConnector", "kv_role": "kv_both"})
    assert off.status == "ok" and "turns it off" in off.detail
    unknown = line({"kv_connector": "NoSuchConnector", "kv_role": "kv_both"})
    assert unknown.status == "warn" and "cannot tell" in unknown.detail
