#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generate the module tables of ``docs/architecture.md`` from the code.

Each table lists the modules of one folder of ``vllm_ascend/distributed`` (every package's
``src`` merged, as the shared namespace merges them): the module, the first line of its
docstring, and the modules of the same folder it imports. The page marks each table::

    <!-- generated: modules kv_transfer/kv_p2p/pull -->
    ...                               (written by this script, never by hand)
    <!-- end generated -->

Run by ``nox -s lint`` (after its own tests)::

    python tools/gen_arch_docs.py --check    # exit 1 when the page differs from the code
    python tools/gen_arch_docs.py --write    # rewrite the marked regions of the page

A module without a docstring, or whose docstring does not open with a one-line summary
(a first line ending in a period, followed by a blank line or nothing), is an error
naming the module: that line is what the table shows. Only the packages' sources are
read (``ast``); nothing is imported.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import import_cycles

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "architecture.md"
#: The namespace the tables' folders are relative to.
NAMESPACE = ("vllm_ascend", "distributed")
BEGIN = re.compile(r"^<!-- generated: modules (?P<folder>[\w/]+) -->$")
END = "<!-- end generated -->"
#: Files that are not modules a reader looks for (the version of a distribution).
SKIPPED = {"__about__.py"}


class DocsError(ValueError):
    """The page or a module cannot give a table: names the module or the marker."""


@dataclass(frozen=True)
class Row:
    """One line of a module table."""

    name: str  # "reader.py", "__init__.py", or "proxy/" for a subpackage
    summary: str
    uses: tuple[str, ...]  # modules of the same folder it imports, relative to the folder


def summary_of(path: Path) -> str:
    """The one-line summary of a module's docstring.

    Raises:
        DocsError: naming the module, when it has no docstring or the docstring does not
            open with a one-line summary ending in a period.
    """
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    if not doc or not doc.strip():
        raise DocsError(f"{path}: no module docstring (its first line is what "
                        f"docs/architecture.md shows)")
    lines = doc.strip().splitlines()
    first = lines[0].strip()
    if len(lines) > 1 and lines[1].strip():
        raise DocsError(f"{path}: the docstring's summary runs over {first!r}: make it one "
                        f"line, then a blank line")
    if not first.endswith("."):
        raise DocsError(f"{path}: the docstring's first line {first!r} is not a sentence "
                        f"ending in a period")
    return first


_ROLE = re.compile(r":[\w:]+:`~?\.?([^`]+)`")


def markdown(text: str) -> str:
    """reStructuredText of a docstring line as Markdown in a table cell."""
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


def folder_rows(folder: str, root: Path = ROOT) -> list[Row]:
    """The rows of one folder's table: its modules (``__init__.py`` first), then its
    subpackages, each with the modules of this folder it imports.

    Raises:
        DocsError: when no package has the folder, or a module's docstring is unfit.
    """
    roots: list[Path] = import_cycles.src_roots(root)
    dirs = [r.joinpath(*NAMESPACE, *folder.split("/")) for r in roots]
    dirs = [d for d in dirs if d.is_dir()]
    if not dirs:
        raise DocsError(f"no package has the folder {folder!r} (vllm_ascend/distributed/"
                        f"{folder})")
    modules = import_cycles.find_modules(roots)
    package = ".".join((*NAMESPACE, *folder.split("/")))
    files = sorted({p for d in dirs for p in d.glob("*.py") if p.name not in SKIPPED},
                   key=lambda p: (p.name != "__init__.py", p.name))
    subdirs = sorted({p for d in dirs for p in d.iterdir()
                      if p.is_dir() and (p / "__init__.py").is_file()}, key=lambda p: p.name)
    skipped = {f"{package}.{Path(s).stem}" for s in SKIPPED}
    rows: list[Row] = []
    errors: list[str] = []
    entries = [(p, False) for p in files] + [(d / "__init__.py", True) for d in subdirs]
    for path, is_subpackage in entries:
        try:
            summary = markdown(summary_of(path))
        except DocsError as err:
            errors.append(str(err))
            continue
        if is_subpackage:
            rows.append(Row(f"{path.parent.name}/", summary, ()))
            continue
        name = package if path.stem == "__init__" else f"{package}.{path.stem}"
        uses = {edge.target[len(package) + 1:]
                for edge in import_cycles.imports_of(modules[name], modules)
                if edge.target.startswith(package + ".") and edge.target not in skipped}
        rows.append(Row(path.name, summary, tuple(sorted(uses))))
    if errors:
        raise DocsError("\n".join(errors))
    return rows


def render_table(folder: str, root: Path = ROOT) -> str:
    """The Markdown table of one folder (what goes between its markers)."""
    here = folder.rsplit("/", 1)[-1]
    lines = [f"| module | what it is for | imports from `{here}/` |", "|---|---|---|"]
    for row in folder_rows(folder, root):
        uses = ", ".join(f"`{u}`" for u in row.uses) or "–"
        lines.append(f"| `{row.name}` | {row.summary} | {uses} |")
    return "\n".join(lines)


def render_page(text: str, root: Path = ROOT) -> str:
    """``text`` with every marked region rewritten from the code.

    Raises:
        DocsError: for a begin marker without its end, or an unfit module.
    """
    out: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        match = BEGIN.match(line.strip())
        i += 1
        if not match:
            continue
        try:
            end = next(j for j in range(i, len(lines)) if lines[j].strip() == END)
        except StopIteration:
            raise DocsError(f"{line.strip()} has no {END} after it") from None
        out.append(render_table(match["folder"], root))
        out.append(END)
        i = end + 1
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def regions(text: str) -> list[str]:
    """The folders the page has generated tables of, in page order."""
    return [m["folder"] for line in text.splitlines() if (m := BEGIN.match(line.strip()))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    mode.add_argument("--write", action="store_true", help="rewrite the page's tables")
    parser.add_argument("--page", type=Path, default=PAGE)
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args(argv)
    text = args.page.read_text(encoding="utf-8")
    try:
        fresh = render_page(text, args.root)
    except DocsError as err:
        print(f"gen_arch_docs: {err}", file=sys.stderr)
        return 1
    if args.write:
        if fresh != text:
            args.page.write_text(fresh, encoding="utf-8")
        print(f"{args.page}: {len(regions(text))} module tables written")
        return 0
    if fresh != text:
        print(f"{args.page}: its module tables differ from the code; run "
              f"`python tools/gen_arch_docs.py --write` and commit the page", file=sys.stderr)
        return 1
    print(f"{args.page}: {len(regions(text))} module tables match the code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
