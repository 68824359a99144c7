# SPDX-License-Identifier: Apache-2.0
"""The layout rules of the workspace, checked on every package's sources.

* No runtime module imports tooling: a module outside a ``tooling`` subpackage
  never imports one (vLLM never loads the command line or the benchmarks).
* Core names no sibling: ascend-kv-core's sources name no other package's
  modules or distributions; they plug in through entry points.
* A package's tooling lives in that package: every ``vllm_ascend_kv.*`` entry
  point of a package points into a module that package ships, so installing one
  connector package brings no other connector's bench code.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGES = Path(__file__).resolve().parents[2]
SRC_DIRS = sorted(p for p in PACKAGES.glob("*/src") if p.is_dir())
TOOLING = "tooling"
#: Names of the other packages' modules and distributions, which core must not mention.
SIBLING_NAMES = ("kv_p2p", "ascend_store", "cpu_offload", "distributed.kernels",
                 "ascend-kv-p2p", "ascend-kv-pool", "ascend-cpu-offload", "ascend-kernels",
                 "ascend-dist-utils")
#: Modules of core still naming siblings, to be fixed (each with its reason); keep it empty.
KNOWN_EXCEPTIONS: set[str] = set()

pytestmark = pytest.mark.skipif(not SRC_DIRS, reason="needs the workspace checkout")


def _modules() -> Iterator[tuple[Path, str]]:
    for src in SRC_DIRS:
        for path in sorted(src.rglob("*.py")):
            rel = path.relative_to(src).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield path, ".".join(parts)


def _imports(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """Every module ``path`` imports, absolute, with its line."""
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:  # ``from . import tooling``
                yield node.lineno, f"{target}.{alias.name}"


def _is_tooling(module: str) -> bool:
    return TOOLING in module.split(".")


def test_no_runtime_module_imports_tooling() -> None:
    bad = [f"{path}:{line}: {module} imports {target}"
           for path, module in _modules() if not _is_tooling(module)
           for line, target in _imports(path, module)
           if target.startswith("vllm_ascend.") and _is_tooling(target)]
    assert not bad, "runtime modules importing tooling:\n" + "\n".join(bad)


def test_the_rule_sees_relative_and_absolute_imports(tmp_path: Path) -> None:
    path = tmp_path / "mod.py"
    path.write_text("from .tooling import cli\nfrom .. import tooling\n"
                    "import vllm_ascend.distributed.kv_transfer.core.tooling.cli\n")
    got = [t for _l, t in _imports(path, "vllm_ascend.distributed.kv_transfer.core.mod")]
    assert "vllm_ascend.distributed.kv_transfer.core.tooling" in got
    assert "vllm_ascend.distributed.kv_transfer.tooling" in got
    assert "vllm_ascend.distributed.kv_transfer.core.tooling.cli" in got


def test_core_names_no_sibling() -> None:
    core = PACKAGES / "ascend-kv-core" / "src"
    bad = [f"{path.relative_to(core)}:{n}: {line.strip()}"
           for path in sorted(core.rglob("*.py"))
           if str(path.relative_to(core)) not in KNOWN_EXCEPTIONS
           for n, line in enumerate(path.read_text().splitlines(), 1)
           if any(name in line for name in SIBLING_NAMES)]
    assert not bad, "ascend-kv-core names another package:\n" + "\n".join(bad)


def test_each_package_s_entry_points_point_into_its_own_modules() -> None:
    bad = []
    for pyproject in sorted(PACKAGES.glob("*/pyproject.toml")):
        doc = tomllib.loads(pyproject.read_text())
        shipped = doc.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {}) \
            .get("wheel", {}).get("only-include", [])
        roots = [p.removeprefix("src/").removesuffix(".py").replace("/", ".") for p in shipped]
        for group, eps in doc["project"].get("entry-points", {}).items():
            if not group.startswith("vllm_ascend_kv."):
                continue
            for name, value in eps.items():
                module = value.partition(":")[0]
                if not any(module == r or module.startswith(r + ".") for r in roots):
                    bad.append(f"{pyproject.parent.name}: {group} {name} = {value}")
                if not _is_tooling(module) and group != "vllm_ascend_kv.config":
                    bad.append(f"{pyproject.parent.name}: {group} {name} = {value} "
                               "(not in a tooling subpackage)")
    assert not bad, "\n".join(bad)
