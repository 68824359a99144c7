# SPDX-License-Identifier: Apache-2.0
"""The meta-package brings the six packages at exactly its pinned versions, and none of them
hides its namespace siblings (or a foreign module in the namespace)."""

from __future__ import annotations

import importlib
import sys
from importlib import metadata
from pathlib import Path

import pytest

SIX = ("ascend-kv-core", "ascend-kv-p2p", "ascend-kv-pool", "ascend-cpu-offload",
       "ascend-dist-utils", "ascend-kernels")
MODULES = (
    "vllm_ascend.distributed.kv_transfer.core",
    "vllm_ascend.distributed.kv_transfer.kv_p2p",
    "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store",
    "vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload",
    "vllm_ascend.distributed.kernels",
    "vllm_ascend.distributed.device_communicators",
)
NAMESPACES = ("vllm_ascend", "vllm_ascend.distributed", "vllm_ascend.distributed.kv_transfer",
              "vllm_ascend.distributed.kv_transfer.kv_pool")


def test_pins_equal_the_installed_versions() -> None:
    pins = {}
    for req in metadata.requires("vllm-ascend-distributed") or []:
        if "extra ==" in req:
            continue
        name, _, version = req.partition("==")
        pins[name.strip()] = version.strip()
    assert set(pins) == set(SIX)
    for dist in SIX:
        assert metadata.version(dist) == pins[dist], dist


def test_namespaces_stay_open() -> None:
    for ns in NAMESPACES:
        mod = importlib.import_module(ns)
        assert mod.__file__ is None, f"{ns} is a regular package ({mod.__file__}): it would hide " \
                                     "its siblings"
    for name in MODULES:
        importlib.import_module(name)


def test_a_foreign_module_in_the_namespace_still_imports(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "vllm_ascend" / "distributed"
    pkg.mkdir(parents=True)
    (pkg / "foreign_probe_meta.py").write_text("ANSWER = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = importlib.import_module("vllm_ascend.distributed.foreign_probe_meta")
    assert probe.ANSWER == 42
    for name in MODULES:  # and every package is still there beside it
        importlib.import_module(name)
    sys.modules.pop("vllm_ascend.distributed.foreign_probe_meta", None)
