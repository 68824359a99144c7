# SPDX-License-Identifier: Apache-2.0
"""The layout rules of the workspace, checked on every package's sources.

Runtime distributions are the ones vLLM loads (core, the connectors, kernels, dist-utils);
a tool distribution (``[tool.vllm-ascend-distributed] role = "tool"`` in its
``pyproject.toml``: ascend-kv-bench) holds the benchmarks and serve harnesses.

* No runtime module imports tooling: a module of a runtime distribution outside a
  ``tooling`` subpackage never imports one (vLLM never loads the command line).
* No runtime module imports a tool: no module of a runtime distribution, its tooling
  included, imports a tool distribution's package (``vllm-ascend-kv`` and the doctor work
  without ascend-kv-bench).
* Runtime wheels hold no benchmark: a runtime ``tooling`` subpackage holds the command,
  its plugin loader and the doctor with what the doctor reads (:data:`RUNTIME_TOOLING`),
  and a runtime distribution declares no ``vllm_ascend_kv.bench`` or ``.serve`` entry point.
* No runtime distribution depends on a tool, the meta-package included.
* Core names no sibling: ascend-kv-core's sources name no other runtime package's
  modules or distributions; they plug in through entry points.
* A package's entry points point into that package: every ``vllm_ascend_kv.*`` entry
  point of a package names a module the package ships; a runtime package's, other than a
  config section, a module of its ``tooling`` subpackage.
"""

from __future__ import annotations

import ast
import re
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
#: What a runtime distribution's ``tooling`` subpackage may hold: the command and its plugin
#: loader, the doctor, its checks and what they read. A benchmark, a serve harness or a
#: launcher belongs to the tool distribution; a new kind of module here needs a reason.
RUNTIME_TOOLING = re.compile(r"(__init__|cli|plugins|doctor(_\w+)?|provenance|cpu_binding)")
#: Entry-point groups only a tool distribution declares.
TOOL_GROUPS = ("vllm_ascend_kv.bench", "vllm_ascend_kv.serve")


def _pyproject(pkg: Path) -> dict:
    return tomllib.loads((pkg / "pyproject.toml").read_text())


def _is_tool(pkg: Path) -> bool:
    return _pyproject(pkg).get("tool", {}).get("vllm-ascend-distributed", {}).get("role") \
        == "tool"


def _dist(pkg: Path) -> str:
    return str(_pyproject(pkg)["project"]["name"])


PACKAGE_DIRS = sorted(p.parent for p in PACKAGES.glob("*/pyproject.toml"))
TOOL_DIRS = [p for p in PACKAGE_DIRS if _is_tool(p)]
#: The import roots of the tool distributions (``vllm_ascend.distributed.kv_transfer.bench``).
TOOL_ROOTS = tuple(root for p in TOOL_DIRS for root in (
    s.removeprefix("src/").replace("/", ".") for s in
    _pyproject(p)["tool"]["hatch"]["build"]["targets"]["wheel"]["only-include"]))

pytestmark = pytest.mark.skipif(not SRC_DIRS, reason="needs the workspace checkout")


def _modules(*, tools: bool = False) -> Iterator[tuple[Path, str]]:
    """Every module of the runtime distributions (with ``tools``, of the tool ones)."""
    for src in SRC_DIRS:
        if _is_tool(src.parent) != tools:
            continue
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


def _is_tool_module(module: str) -> bool:
    return any(module == r or module.startswith(r + ".") for r in TOOL_ROOTS)


def test_there_is_a_tool_distribution_and_it_holds_the_benchmarks() -> None:
    assert [_dist(p) for p in TOOL_DIRS] == ["ascend-kv-bench"]
    assert TOOL_ROOTS == ("vllm_ascend.distributed.kv_transfer.bench",)
    names = {m.rpartition(".")[2] for _p, m in _modules(tools=True)}
    assert {"engine", "p2p", "layerwise", "pool", "offload", "kernels", "router"} <= names


def test_no_runtime_module_imports_a_tool() -> None:
    bad = [f"{path}:{line}: {module} imports {target}"
           for path, module in _modules()
           for line, target in _imports(path, module) if _is_tool_module(target)]
    assert not bad, "runtime modules importing the bench package:\n" + "\n".join(bad)


def test_runtime_tooling_holds_no_benchmark() -> None:
    bad = [f"{path}" for path, module in _modules()
           if _is_tooling(module) and module.rpartition(".")[2] != TOOLING
           and not RUNTIME_TOOLING.fullmatch(path.stem)]
    assert not bad, ("modules of a runtime tooling subpackage that are not the command or the "
                     "doctor (a benchmark or harness goes to ascend-kv-bench):\n"
                     + "\n".join(bad))
    assert RUNTIME_TOOLING.fullmatch("doctor_listeners")
    assert not any(RUNTIME_TOOLING.fullmatch(n) for n in ("bench", "serve_child", "benchutil",
                                                          "mooncake_store", "bench_client"))


def test_no_runtime_distribution_depends_on_a_tool() -> None:
    tools = {_dist(p) for p in TOOL_DIRS}
    bad = []
    for pkg in PACKAGE_DIRS:
        if pkg in TOOL_DIRS:
            continue
        project = _pyproject(pkg)["project"]
        reqs = [*project.get("dependencies", []),
                *(r for extra in project.get("optional-dependencies", {}).values()
                  for r in extra)]
        bad += [f"{pkg.name}: {r}" for r in reqs
                if re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].strip().lower() in tools]
    assert not bad, "runtime distributions (or the meta-package) requiring a tool:\n" + \
        "\n".join(bad)


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
    for pkg in PACKAGE_DIRS:
        doc = _pyproject(pkg)
        shipped = doc.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {}) \
            .get("wheel", {}).get("only-include", [])
        roots = [p.removeprefix("src/").removesuffix(".py").replace("/", ".") for p in shipped]
        tool = pkg in TOOL_DIRS
        for group, eps in doc["project"].get("entry-points", {}).items():
            if not group.startswith("vllm_ascend_kv."):
                continue
            for name, value in eps.items():
                module = value.partition(":")[0]
                if not any(module == r or module.startswith(r + ".") for r in roots):
                    bad.append(f"{pkg.name}: {group} {name} = {value}")
                if tool:
                    continue
                if group in TOOL_GROUPS:
                    bad.append(f"{pkg.name}: {group} {name} = {value} (a benchmark of a "
                               "runtime package: it belongs to ascend-kv-bench)")
                elif not _is_tooling(module) and group != "vllm_ascend_kv.config":
                    bad.append(f"{pkg.name}: {group} {name} = {value} "
                               "(not in a tooling subpackage)")
    assert not bad, "\n".join(bad)
