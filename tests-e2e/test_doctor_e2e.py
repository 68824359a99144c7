# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv doctor`` with every package installed and a real mooncake_master."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.procs import free_port


def doctor(cfg: Any, *args: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "vllm_ascend.distributed.kv_transfer.core.tooling.cli",
                           "doctor", "--kv-transfer-config", json.dumps(cfg), "--json",
                           "--timeout", "1", *args],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout)


def status_of(report: dict[str, Any], what: str) -> str:
    return next(c["status"] for c in report["checks"] if c["what"] == what)


def test_good_pd_config_passes() -> None:
    cfg = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer", "kv_port": free_port(),
           "kv_connector_extra_config": {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}}}
    rc, report = doctor(cfg)
    assert rc == 0 and report["ok"], report
    assert status_of(report, "Mooncake transfer engine") == "ok"
    assert status_of(report, "package ascend-kv-p2p") == "ok"


@pytest.mark.parametrize(("extra", "key", "value"), [
    ({"lease_ttl_s": "soon"}, "lease_ttl_s", "'soon'"),  # a bad value
    ({"prefil": {"tp_size": 1}}, "'prefil'", "'prefill'"),  # a misspelt key, and the right one
])
def test_broken_pd_config_names_the_key(extra: dict[str, Any], key: str, value: str) -> None:
    cfg = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_consumer",
           "kv_connector_extra_config": {"decode": {"tp_size": 1}, **extra}}
    rc, report = doctor(cfg)
    assert rc == 1
    check = next(c for c in report["checks"] if c["what"] == "MooncakeConnectorV1 configuration")
    assert check["status"] == "fail"
    assert key in check["detail"] and value in check["detail"], check["detail"]


def test_pool_with_a_real_master(mooncake_master: Any, tmp_path: Path) -> None:
    path = mooncake_master.write_config(tmp_path / "mooncake.json")
    cfg = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"backend": "mooncake"}}
    rc, report = doctor(cfg, "--mooncake-config", str(path))
    assert rc == 0, report
    assert status_of(report, "mooncake_master") == "ok"
    assert status_of(report, "metadata server") == "ok"
    # the master's RPC port is open, but it is no HTTP metadata server
    wrong = mooncake_master.write_config(
        tmp_path / "wrong.json", metadata_server=f"http://{mooncake_master.master_address}/metadata")
    rc, report = doctor(cfg, "--mooncake-config", str(wrong))
    assert rc == 1 and status_of(report, "metadata server") == "fail", report


def test_pool_with_the_master_down(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": dead, "metadata_server": "P2PHANDSHAKE",
                                "protocol": "tcp"}))
    cfg = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"backend": "mooncake"}}
    rc, report = doctor(cfg, "--mooncake-config", str(path))
    assert rc == 1 and status_of(report, "mooncake_master") == "fail"
    rc, report = doctor(cfg)  # no config at all
    assert rc == 1 and status_of(report, "Mooncake Store config") == "fail"


def test_offload_and_multiconnector() -> None:
    cfg = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"connectors": [
               {"kv_connector": "CPUOffloadingConnector", "kv_connector_extra_config": {}},
               {"kv_connector": "AscendStoreConnector",
                "kv_connector_extra_config": {"backend": "nope"}}]}}
    rc, report = doctor(cfg)
    assert rc == 1
    assert status_of(report, "CPUOffloadingConnector configuration") == "ok"
    assert status_of(report, "AscendStoreConnector configuration") == "fail"
