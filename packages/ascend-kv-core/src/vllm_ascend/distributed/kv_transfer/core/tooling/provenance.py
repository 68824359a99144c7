# SPDX-License-Identifier: Apache-2.0
"""Which installed distribution provides each ``vllm_ascend.distributed`` file.

Beside the vLLM-Ascend wheel, some paths are shipped by two distributions
(``docs/deployment-ascend.md``): the last ``pip install`` writes its copy, and
``pip uninstall`` of either deletes every file its RECORD lists, whoever wrote
it last. Every connector of this project registers its names at, and imports at
run time, only files no other distribution ships; the shared files are
upstream's module paths, kept as re-exports. This module reads the RECORDs and
the files on disk, without importing anything under ``vllm_ascend``, and says:

* which distribution's copy each file holds (the one whose recorded hash
  matches the bytes on disk);
* what is wrong, as :class:`Problem` records: an upstream path of ours that
  holds another distribution's copy (a warning: imports of that path get the
  other copy, the connector names stay ours); a file of ours that is gone, or
  ours shadowed because ``vllm_ascend`` is a regular package in another site
  directory (errors).

No list of distribution names is kept: a distribution is *ours* when it ships
modules under ``vllm_ascend/distributed/`` with an ``__about__.py`` (each
package's version file) and no ``vllm_ascend/__init__.py`` (ours are portions of
the namespace); any other distribution shipping there (the vLLM-Ascend wheel,
which ships the regular ``vllm_ascend`` package) is *foreign*.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import importlib.util
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

#: The platform plugin's distribution (named in messages as "vLLM-Ascend").
VLLM_ASCEND = "vllm-ascend"
PREFIX = "vllm_ascend/distributed/"
_VERSION_FILE = "__about__.py"
_REGULAR_ROOT = "vllm_ascend/__init__.py"


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _label(dist: str) -> str:
    return "vLLM-Ascend" if dist == VLLM_ASCEND else dist


def _digest(path: Path, algo: str) -> str:
    h = hashlib.new(algo, path.read_bytes())
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def repair_hint(dists: Iterable[str]) -> str:
    """The command that puts our copies back (reinstall ours last)."""
    names = " ".join(sorted(dists)) or "<the ascend-kv packages you use>"
    return f"reinstall ours last: pip install --force-reinstall --no-deps {names}"


@dataclass
class FileProvenance:
    """One file under ``vllm_ascend/distributed/`` listed in some RECORD."""

    path: str
    location: Path
    #: distribution -> the hash its RECORD gives (``algo=value``), or "".
    listed_by: dict[str, str] = field(default_factory=dict)

    @property
    def exists(self) -> bool:
        """Whether the file is on disk."""
        return self.location.is_file()

    @property
    def provider(self) -> str | None:
        """The distribution whose recorded hash matches the file on disk."""
        if not self.exists:
            return None
        for dist, recorded in sorted(self.listed_by.items()):
            algo, _, value = recorded.partition("=")
            if value and _digest(self.location, algo) == value:
                return dist
        return None

    @property
    def module(self) -> str:
        """The dotted module name of the file."""
        name = self.path.removesuffix(".py").replace("/", ".")
        return name.removesuffix(".__init__")


@dataclass(frozen=True)
class Problem:
    """Something that keeps ours from being the code behind a module path."""

    module: str
    detail: str
    fix: str
    #: True: something of ours is broken (doctor fails); False: a warning.
    fatal: bool

    def __str__(self) -> str:
        return f"{self.module}: {self.detail}; {self.fix}"


@dataclass
class Inventory:
    """What the installed distributions ship under ``vllm_ascend/distributed/``."""

    ours: set[str] = field(default_factory=set)
    foreign: set[str] = field(default_factory=set)
    #: site directory of each of our distributions
    roots: dict[str, Path] = field(default_factory=dict)
    files: list[FileProvenance] = field(default_factory=list)


def inventory(path: list[str] | None = None) -> Inventory:
    """Read every RECORD once (``path``: search these directories instead of ``sys.path``)."""
    inv = Inventory()
    files: dict[str, FileProvenance] = {}
    seen: set[str] = set()
    for dist in md.distributions(path=path) if path is not None else md.distributions():
        name = _norm(dist.metadata["Name"] or "")
        if not name or name in seen:
            continue
        seen.add(name)
        try:
            listed = list(dist.files or ())
        except Exception:  # a broken RECORD of one distribution must not hide the rest
            logger.debug("cannot read the RECORD of %s", name, exc_info=True)
            continue
        rels = [str(f).replace(os.sep, "/") for f in listed]
        under = [(f, rel) for f, rel in zip(listed, rels, strict=True) if rel.startswith(PREFIX)]
        if not under:
            continue
        is_ours = (_REGULAR_ROOT not in rels
                   and any(rel.endswith("/" + _VERSION_FILE) for _, rel in under))
        (inv.ours if is_ours else inv.foreign).add(name)
        if is_ours:
            inv.roots[name] = Path(str(dist.locate_file(""))).resolve()
        for f, rel in under:
            if not rel.endswith(".py"):
                continue
            location = Path(str(dist.locate_file(f))).resolve()
            entry = files.setdefault(f"{location}", FileProvenance(rel, location))
            entry.listed_by[name] = f"{f.hash.mode}={f.hash.value}" if f.hash else ""
    inv.files = sorted(files.values(), key=lambda e: e.path)
    return inv


def scan(path: list[str] | None = None) -> list[FileProvenance]:
    """Every ``.py`` file under ``vllm_ascend/distributed/`` that a RECORD lists."""
    return inventory(path).files


def our_distributions(path: list[str] | None = None) -> frozenset[str]:
    """The installed distributions of this project that ship under ``vllm_ascend/distributed/``."""
    return frozenset(inventory(path).ours)


def our_roots(path: list[str] | None = None) -> set[Path]:
    """Site directories our distributions are installed in."""
    return set(inventory(path).roots.values())


def shadowing(roots: Iterable[Path] | None = None) -> list[Problem]:
    """Errors when ``vllm_ascend`` is a regular package that hides our site directory."""
    roots = our_roots() if roots is None else roots
    spec = importlib.util.find_spec("vllm_ascend")
    if spec is None or spec.origin in (None, "namespace"):
        return []  # a namespace package spans every sys.path entry
    search = {Path(p).resolve() for p in spec.submodule_search_locations or ()}
    return [Problem("vllm_ascend",
                    f"ours in {root} are shadowed: vllm_ascend is the regular package "
                    f"{spec.origin} (vLLM-Ascend in another site directory)",
                    "install ours into that environment", fatal=True)
            for root in sorted(set(roots)) if (root / "vllm_ascend").resolve() not in search]


def problems(inv: Inventory | None = None) -> list[Problem]:
    """What keeps ours from being the code behind our module paths, errors first."""
    inv = inventory() if inv is None else inv
    found = []
    for e in inv.files:
        ours = sorted(set(e.listed_by) & inv.ours)
        if not ours:
            continue
        others = sorted(set(e.listed_by) - inv.ours)
        if not e.exists:
            why = (f"removed by an uninstall of {', '.join(others)}" if others
                   else "deleted")
            found.append(Problem(e.module, f"{e.path} of {ours[0]} is gone ({why})",
                                 repair_hint(ours), fatal=True))
            continue
        provider = e.provider
        if provider in inv.foreign:
            found.append(Problem(
                e.module, f"{e.path} holds {_label(provider)}'s copy, not {ours[0]}'s: "
                f"imports of this upstream path (and kv_connector_module_path naming it) get "
                f"{_label(provider)}'s code (the connector names stay ours)",
                repair_hint(ours), fatal=True))
    found += shadowing(inv.roots.values())
    return sorted(found, key=lambda p: not p.fatal)


def errors(inv: Inventory | None = None) -> list[Problem]:
    """The fatal problems only: a file of ours gone, holding vLLM-Ascend's copy, or ours
    shadowed."""
    return [p for p in problems(inv) if p.fatal]
