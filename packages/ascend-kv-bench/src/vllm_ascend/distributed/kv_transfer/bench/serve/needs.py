# SPDX-License-Identifier: Apache-2.0
"""What a ``bench serve`` scenario needs, and whether this machine has it.

Needs (:attr:`~.spec.Scenario.needs`): a distribution, Mooncake, the Store's binaries, the
peers' harness modules, NIXL in the interpreter that runs its engines."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata, util
from pathlib import Path

from ..mooncake_store import find_binary
from .child import EngineChild
from .spec import Scenario, ServeConfig

#: The peers' harness modules, shipped with this package (``bench/peers``): imported first
#: in the engines of vLLM's own connectors (by their top-level names, this directory on
#: their ``sys.path``), never by a module of ours.
PEERS_DIR = Path(__file__).resolve().parent.parent / "peers"
#: The peers' harness module that lets vLLM's Mooncake connectors run on a CPU engine.
PATCH_MODULE = "vllm_mooncake_cpu_patch"
#: Another directory of peer harness modules (``--peers-path`` wins over it).
PEERS_ENV = "VLLM_ASCEND_KV_BENCH_PEERS"
#: The engine process module (an interpreter running ``bench serve`` engines must have it).
CHILD_MODULE = EngineChild.__module__


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def _has_module(name: str) -> bool:
    try:
        return util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def peers_dir(explicit: str | None) -> Path:
    """The directory of the peer harness modules: ``explicit`` (``--peers-path``), else
    ``$VLLM_ASCEND_KV_BENCH_PEERS``, else the modules shipped here (:data:`PEERS_DIR`)."""
    return Path(explicit or os.environ.get(PEERS_ENV) or PEERS_DIR)


def peers_path(explicit: str | None) -> str | None:
    """:func:`peers_dir` resolved, or ``None`` when it lacks :data:`PATCH_MODULE` (a
    directory named by ``--peers-path`` or ``$VLLM_ASCEND_KV_BENCH_PEERS`` that holds no
    harness: the scenarios that need it are skipped, saying so)."""
    path = peers_dir(explicit)
    return str(path.resolve()) if (path / f"{PATCH_MODULE}.py").exists() else None


def python_has(python: str, module: str) -> bool:
    """Whether ``python`` can import ``module`` (a quick child process)."""
    try:
        return subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def skip_reason(sc: Scenario, cfg: ServeConfig) -> str | None:
    """Why ``sc`` cannot run here, or ``None``."""
    for need in sc.needs:
        if need.startswith("dist:") and not _installed(need[5:]):
            return f"{need[5:]} is not installed"
        if need == "mooncake" and not _has_module("mooncake.engine"):
            return "mooncake-transfer-engine is not installed (pip install 'ascend-kv-core[cpu]')"
        if need == "store" and not (find_binary("mooncake_master")
                                    and find_binary("mooncake_client")):
            return "mooncake_master / mooncake_client not found"
        if need == "patch" and not cfg.peers_path:
            return (f"needs the peers' harness modules ({PATCH_MODULE}.py and the modules "
                    f"beside it, shipped in {PEERS_DIR}): the directory named by "
                    f"--peers-path or {PEERS_ENV} lacks them")
        if need == "nixl":
            python = cfg.nixl_python or sys.executable
            if not python_has(python, "nixl"):
                return (f"the nixl package is not importable by {python} (nox -s bench builds "
                        "an environment with it; or pass --nixl-python)")
            if not python_has(python, CHILD_MODULE):
                return f"ascend-kv-bench is not installed in {python}"
    return None
