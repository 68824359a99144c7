#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The import-cycle guard: no module of ``packages/*/src`` reaches itself through imports.

Run by ``nox -s lint``; exits 1 listing every cycle, 0 when there is none.

Every ``import`` statement counts, wherever it stands: at module level, inside a function,
under ``if TYPE_CHECKING:``. A cycle only the type checker sees still ties two modules
together: neither can be read, tested or moved without the other.

The graph's nodes are the modules of all packages together (they share the
``vllm_ascend.distributed`` namespace, so a cycle may cross distributions). An import
statement is an edge from the module that holds it to the module of ours it names:

* ``import a.b.c``: the deepest of ``a.b.c``, ``a.b``, ``a`` that is a module of ours;
* ``from a.b import c``: ``a.b.c`` when that is a module (a submodule imported by name),
  else ``a.b`` (a name taken from ``a.b``, the package's ``__init__`` when ``a.b`` is a
  package), else the deepest module above it;
* relative imports the same, from the importing module's package (``from . import x`` is
  an edge to the submodule ``x`` when ``x`` is a module, else to the package).

The parent packages Python imports on the way are not edges: every submodule would
otherwise close a cycle with a package ``__init__`` that imports it. Imports by string
(``importlib.import_module``) are not statements and do not count.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Module:
    """One module of ours: its dotted name, its file, and whether it is a package."""

    name: str
    path: Path
    is_package: bool

    @property
    def package(self) -> str:
        """The package relative imports in this module start from."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Edge:
    """An import of ``target`` by ``source``, at ``path:line``."""

    source: str
    target: str
    path: Path
    line: int


def find_modules(src_roots: Iterable[Path]) -> dict[str, Module]:
    """Every module under the ``src_roots`` (each a folder on ``sys.path``), by name."""
    modules: dict[str, Module] = {}
    for root in src_roots:
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            if parts:
                name = ".".join(parts)
                modules[name] = Module(name, path, is_package)
    return modules


def _deepest_module(dotted: str, modules: Mapping[str, Module]) -> str | None:
    """``dotted`` or the nearest name above it that is a module of ours; None if none is."""
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _from_base(module: Module, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` statement names, made absolute."""
    if not node.level:
        return node.module or ""
    base = module.package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: Module, modules: Mapping[str, Module]) -> list[Edge]:
    """The edges of ``module``'s import statements to modules of ours, in file order."""
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    edges: list[Edge] = []

    def add(target: str | None, node: ast.stmt) -> None:
        if target is not None and target != module.name:
            edges.append(Edge(module.name, target, module.path, node.lineno))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_deepest_module(alias.name, modules), node)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                add(submodule if submodule in modules else _deepest_module(base, modules),
                    node)
    edges.sort(key=lambda e: e.line)
    return edges


def import_graph(modules: Mapping[str, Module]) -> dict[str, list[Edge]]:
    """Each module's imports of modules of ours (one edge per target: its first import)."""
    graph: dict[str, list[Edge]] = {}
    for name, module in sorted(modules.items()):
        first: dict[str, Edge] = {}
        for edge in imports_of(module, modules):
            first.setdefault(edge.target, edge)
        graph[name] = list(first.values())
    return graph


def _reachable(graph: Mapping[str, list[Edge]], start: str) -> set[str]:
    """The modules ``start`` imports, directly or not (itself only through a cycle)."""
    seen: set[str] = set()
    todo = [e.target for e in graph.get(start, ())]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(e.target for e in graph.get(name, ()))
    return seen


def find_cycles(graph: Mapping[str, list[Edge]]) -> list[list[str]]:
    """The groups of modules that import each other (directly or through others of the
    group), each sorted; a module that reaches only itself is a group of one."""
    reach = {name: _reachable(graph, name) for name in graph}
    groups: list[list[str]] = []
    grouped: set[str] = set()
    for name in sorted(graph):
        if name in grouped or name not in reach[name]:
            continue
        group = sorted(other for other in reach[name] if name in reach[other])
        grouped.update(group)
        groups.append(group)
    return groups


def shortest_cycle(graph: Mapping[str, list[Edge]], start: str) -> list[Edge]:
    """The fewest imports that lead from ``start`` back to ``start`` (empty if none do)."""
    came_by: dict[str, Edge] = {}
    todo = deque([start])
    while todo:
        name = todo.popleft()
        for edge in graph.get(name, ()):
            if edge.target == start:
                path = [edge]
                while path[0].source != start:
                    path.insert(0, came_by[path[0].source])
                return path
            if edge.target not in came_by:
                came_by[edge.target] = edge
                todo.append(edge.target)
    return []


#: Left out of the module names in the report (every module of ours starts with it).
NAMESPACE = "vllm_ascend.distributed."


def _short(name: str) -> str:
    return name.removeprefix(NAMESPACE)


def _where(edge: Edge, root: Path) -> str:
    path = edge.path.relative_to(root) if edge.path.is_relative_to(root) else edge.path
    return f"{path}:{edge.line}"


def report(graph: Mapping[str, list[Edge]], cycles: list[list[str]], root: Path) -> str:
    """Each cycle: its modules, the imports between them (where to break it), and the
    shortest way around it."""
    lines = [f"{len(cycles)} import cycle(s) in packages/*/src (modules under {NAMESPACE}):"]
    for number, group in enumerate(cycles, 1):
        members = set(group)
        lines.append(f"\n{number}. {len(group)} modules: {', '.join(map(_short, group))}")
        lines.append("   imports among them:")
        for name in group:
            for edge in graph[name]:
                if edge.target in members:
                    lines.append(f"     {_short(edge.source)} -> {_short(edge.target)}  "
                                 f"({_where(edge, root)})")
        around = shortest_cycle(graph, group[0])
        lines.append("   shortest cycle: "
                     + " -> ".join(_short(n) for n in [group[0]] + [e.target for e in around]))
    return "\n".join(lines)


def src_roots(root: Path) -> list[Path]:
    """The ``src`` folders of the packages under ``root/packages``."""
    return sorted(p for p in (root / "packages").glob("*/src") if p.is_dir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the checkout whose packages/*/src are checked (default: this one)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    modules = find_modules(src_roots(root))
    graph = import_graph(modules)
    cycles = find_cycles(graph)
    if cycles:
        print(report(graph, cycles, root))
        return 1
    edges = sum(len(e) for e in graph.values())
    print(f"no import cycle among {len(modules)} modules ({edges} imports) in packages/*/src")
    return 0


if __name__ == "__main__":
    sys.exit(main())
