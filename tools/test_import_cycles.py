# SPDX-License-Identifier: Apache-2.0
"""The import-cycle guard (run by ``nox -s lint`` before the guard itself): it finds cycles
planted in a small tree of packages, also through ``if TYPE_CHECKING:`` and through
imports inside functions, and passes a tree without one."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import import_cycles as ic

NS = "vllm_ascend/distributed"


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """``files`` (``"<dist>/<path under src>"`` -> source) as packages/*/src under ``root``;
    the namespace levels get no ``__init__.py``, as in the real packages."""
    for rel, source in files.items():
        dist, _, path = rel.partition("/")
        target = root / "packages" / dist / "src" / NS / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(source))
    return root


def cycles_in(root: Path) -> list[list[str]]:
    graph = ic.import_graph(ic.find_modules(ic.src_roots(root)))
    return [[ic._short(m) for m in group] for group in ic.find_cycles(graph)]


#: Imports in one direction only, in every form the guard resolves: absolute, relative at
#: two levels, a submodule taken by name from its package, a name from a package's
#: __init__, a module of another distribution in the shared namespace, the standard
#: library and third-party modules (not ours: no edge), TYPE_CHECKING and a function.
CLEAN = {
    "core/core/__init__.py": "from .engine import Engine\n",
    "core/core/engine.py": """\
        from __future__ import annotations
        import os
        from typing import TYPE_CHECKING
        from . import errors
        from .polling import poll
        if TYPE_CHECKING:
            import torch
        class Engine: ...
        """,
    "core/core/polling.py": """\
        import vllm_ascend.distributed.core.errors
        def poll() -> None:
            from .errors import Failed
        """,
    "core/core/errors.py": "class Failed(Exception): ...\n",
    "p2p/p2p/__init__.py": "",
    "p2p/p2p/reader.py": """\
        from typing import TYPE_CHECKING
        from vllm_ascend.distributed.core import Engine
        from ..core.polling import poll
        from . import window
        if TYPE_CHECKING:
            from .window import Window
        """,
    "p2p/p2p/window.py": "from ..core import errors\nclass Window: ...\n",
}


def test_a_tree_without_a_cycle_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    root = write_tree(tmp_path, CLEAN)
    graph = ic.import_graph(ic.find_modules(ic.src_roots(root)))
    edges = {(ic._short(e.source), ic._short(e.target)) for es in graph.values() for e in es}
    # the edges the module docstring promises (and none to the standard library or torch)
    assert edges == {
        ("core", "core.engine"),
        ("core.engine", "core.errors"), ("core.engine", "core.polling"),
        ("core.polling", "core.errors"),
        ("p2p.reader", "core"), ("p2p.reader", "core.polling"), ("p2p.reader", "p2p.window"),
        ("p2p.window", "core.errors"),
    }
    assert ic.find_cycles(graph) == []
    assert ic.main(["--root", str(root)]) == 0
    assert "no import cycle among 7 modules (8 imports)" in capsys.readouterr().out


def test_a_cycle_through_type_checking_is_found(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {**CLEAN, "core/core/polling.py": """\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from .engine import Engine
        def poll(engine: Engine) -> None: ...
        """})
    assert cycles_in(root) == [["core.engine", "core.polling"]]


def test_a_cycle_through_a_function_and_across_distributions_is_found(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {**CLEAN, "core/core/errors.py": """\
        class Failed(Exception):
            def hint(self) -> str:
                from vllm_ascend.distributed.p2p.window import Window
                return Window.__name__
        """})
    assert cycles_in(root) == [["core.errors", "p2p.window"]]


def test_a_name_from_the_package_is_an_edge_to_its_init(tmp_path: Path) -> None:
    # ``from . import window`` names a module (no edge to p2p/__init__); a name defined in
    # the __init__ is an edge to it, and __init__ importing the module closes the cycle
    tree = {**CLEAN, "p2p/p2p/__init__.py": "from .window import Window\nLIMIT = 3\n"}
    assert cycles_in(write_tree(tmp_path / "a", tree)) == []
    tree["p2p/p2p/window.py"] = "from . import LIMIT\nclass Window: ...\n"
    assert cycles_in(write_tree(tmp_path / "b", tree)) == [["p2p", "p2p.window"]]


def test_the_report_lists_each_cycle_with_the_imports_to_break(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_tree(tmp_path, {
        **CLEAN,
        "core/core/polling.py": "def poll() -> None:\n    from . import engine\n",
        "p2p/p2p/window.py": "import vllm_ascend.distributed.p2p.reader\nclass Window: ...\n",
    })
    assert ic.main(["--root", str(root)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("2 import cycle(s)")
    assert "1. 2 modules: core.engine, core.polling" in out
    assert ("core.polling -> core.engine  "
            f"(packages/core/src/{NS}/core/polling.py:2)") in out
    assert "2. 2 modules: p2p.reader, p2p.window" in out
    assert "shortest cycle: p2p.reader -> p2p.window -> p2p.reader" in out


def test_the_shortest_way_around_a_larger_cycle(tmp_path: Path) -> None:
    root = write_tree(tmp_path, {
        "x/m/__init__.py": "",
        "x/m/a.py": "from . import b\n",
        "x/m/b.py": "from . import c\nfrom . import d\n",
        "x/m/c.py": "from . import d\n",
        "x/m/d.py": "from . import a\n",
    })
    graph = ic.import_graph(ic.find_modules(ic.src_roots(root)))
    assert [[ic._short(m) for m in g] for g in ic.find_cycles(graph)] == [
        ["m.a", "m.b", "m.c", "m.d"]]
    around = ic.shortest_cycle(graph, f"{NS.replace('/', '.')}.m.a")
    assert [ic._short(e.target) for e in around] == ["m.b", "m.d", "m.a"]
