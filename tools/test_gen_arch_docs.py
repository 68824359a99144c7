# SPDX-License-Identifier: Apache-2.0
"""The module tables of docs/architecture.md (run by ``nox -s lint`` and ``nox -s docs``).

A module planted in a small tree of packages appears in its folder's table with its summary
and its imports; a module without a docstring, or whose summary runs over one line, is an
error naming it; ``--check`` fails on a stale page and ``--write`` makes it current; and the
committed page matches the code.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gen_arch_docs as gen

NS = "vllm_ascend/distributed"


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """``files`` (``"<dist>/<path under the namespace>"`` -> source) as packages/*/src."""
    for rel, source in files.items():
        dist, _, path = rel.partition("/")
        target = root / "packages" / dist / "src" / NS / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(textwrap.dedent(source))
    return root


TREE = {
    "kv-a/kv/pkg/__init__.py": '"""The package: what it is for."""\n',
    "kv-a/kv/pkg/__about__.py": '__version__ = "0"\n',
    "kv-a/kv/pkg/contract.py": '"""What the scheduler tells ``Worker`` each step.\n\nMore."""\n',
    "kv-a/kv/pkg/worker.py": '''\
        """Worker side: reads, see :class:`~.contract.Meta`."""
        from typing import TYPE_CHECKING

        from . import contract
        from .sub.deep import x
        import json

        if TYPE_CHECKING:
            from vllm_ascend.distributed.kv.other import y
        ''',
    "kv-a/kv/pkg/sub/__init__.py": '"""A subpackage | with a pipe."""\n',
    "kv-a/kv/pkg/sub/deep.py": '"""Deep."""\nx = 1\n',
    "kv-a/kv/other.py": '"""Another folder."""\ny = 1\n',
    # a second distribution's portion of the same folder (the namespace merges them)
    "kv-b/kv/pkg/planted.py": '"""The planted module."""\nfrom .worker import z\n',
}


def test_a_planted_module_appears_with_its_summary_and_imports(tmp_path: Path) -> None:
    root = write_tree(tmp_path, TREE)
    table = gen.render_table("kv/pkg", root)
    assert table.splitlines() == [
        "| module | what it is for | imports from `pkg/` |",
        "|---|---|---|",
        "| `__init__.py` | The package: what it is for. | – |",
        "| `contract.py` | What the scheduler tells `Worker` each step. | – |",
        "| `planted.py` | The planted module. | `worker` |",
        "| `worker.py` | Worker side: reads, see `contract.Meta`. | `contract`, `sub.deep` |",
        "| `sub/` | A subpackage \\| with a pipe. | – |",
    ]


@pytest.mark.parametrize(("source", "why"), [
    ("x = 1\n", "no module docstring"),
    ('"""   """\n', "no module docstring"),
    ('"""A summary that runs\nover two lines."""\n', "summary runs over"),
    ('"""No period at the end"""\n', "not a sentence ending in a period"),
])
def test_an_unfit_docstring_is_an_error_naming_the_module(tmp_path: Path, source: str,
                                                          why: str) -> None:
    root = write_tree(tmp_path, {**TREE, "kv-b/kv/pkg/bad.py": source})
    with pytest.raises(gen.DocsError, match=why) as err:
        gen.render_table("kv/pkg", root)
    assert "kv/pkg/bad.py" in str(err.value)


def test_a_folder_no_package_has_is_an_error(tmp_path: Path) -> None:
    root = write_tree(tmp_path, TREE)
    with pytest.raises(gen.DocsError, match="no package has the folder 'kv/nope'"):
        gen.render_table("kv/nope", root)


PAGE = """# Page

Hand-written prose stays.

<!-- generated: modules kv/pkg -->
| stale | table |
<!-- end generated -->

More prose.
"""


def test_check_fails_on_a_stale_page_and_write_makes_it_current(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_tree(tmp_path, TREE)
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    args = ["--page", str(page), "--root", str(root)]
    assert gen.main(["--check", *args]) == 1
    assert "differ from the code" in capsys.readouterr().err
    assert gen.main(["--write", *args]) == 0
    text = page.read_text()
    assert text.startswith("# Page\n\nHand-written prose stays.\n\n<!-- generated: modules ")
    assert "| `planted.py` | The planted module. | `worker` |" in text
    assert "stale" not in text and text.endswith("<!-- end generated -->\n\nMore prose.\n")
    assert gen.main(["--check", *args]) == 0
    # a planted module makes the written page stale again
    write_tree(root, {"kv-b/kv/pkg/later.py": '"""Added later."""\n'})
    assert gen.main(["--check", *args]) == 1


def test_a_marker_without_its_end_is_an_error(tmp_path: Path) -> None:
    root = write_tree(tmp_path, TREE)
    with pytest.raises(gen.DocsError, match="has no <!-- end generated -->"):
        gen.render_page("<!-- generated: modules kv/pkg -->\n| x |\n", root)


def test_the_committed_page_matches_the_code() -> None:
    text = gen.PAGE.read_text(encoding="utf-8")
    assert {"kv_transfer/kv_p2p/pull", "kv_transfer/kv_p2p/layerwise",
            "kv_transfer/kv_pool/ascend_store/backend"} <= set(gen.regions(text))
    assert gen.render_page(text) == text, (
        "docs/architecture.md's module tables differ from the code: run "
        "`python tools/gen_arch_docs.py --write`")
