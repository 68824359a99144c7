# SPDX-License-Identifier: Apache-2.0
"""Which installed distribution provides each ``vllm_ascend.distributed`` file.

Beside the vLLM-Ascend wheel, the same paths are shipped by two
distributions (``docs/deployment-ascend.md``): the last ``pip install``
writes its copy, and ``pip uninstall`` of either deletes every file its
RECORD lists, whoever wrote it last. This module reads the RECORDs and the
files on disk, without importing anything under ``vllm_ascend``, and says:

* which distribution's copy each file holds (the one whose recorded hash
  matches the bytes on disk);
* what is wrong: a file of ours that holds vLLM-Ascend's copy or is gone,
  or our files shadowed because ``vllm_ascend`` is a regular package in
  another site directory.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import importlib.util
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

#: The distributions of this project that ship files under ``vllm_ascend/``.
OUR_DISTRIBUTIONS = frozenset({
    "ascend-kv-core", "ascend-kv-p2p", "ascend-kv-pool", "ascend-cpu-offload",
    "ascend-dist-utils", "ascend-kernels",
})
VLLM_ASCEND = "vllm-ascend"
_PREFIX = "vllm_ascend/distributed/"
REPAIR_HINT = ("reinstall ours last: pip install --force-reinstall --no-deps "
               "<the ascend-kv packages you use>")


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _digest(path: Path, algo: str) -> str:
    h = hashlib.new(algo, path.read_bytes())
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


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


def scan() -> list[FileProvenance]:
    """Every ``.py`` file under ``vllm_ascend/distributed/`` that a RECORD lists."""
    files: dict[str, FileProvenance] = {}
    for dist in md.distributions():
        name = _norm(dist.metadata["Name"] or "")
        if name not in OUR_DISTRIBUTIONS and name != VLLM_ASCEND:
            continue
        for f in dist.files or ():
            rel = str(f).replace(os.sep, "/")
            if not rel.startswith(_PREFIX) or not rel.endswith(".py"):
                continue
            location = Path(str(dist.locate_file(f))).resolve()
            entry = files.setdefault(f"{location}", FileProvenance(rel, location))
            entry.listed_by[name] = f"{f.hash.mode}={f.hash.value}" if f.hash else ""
    return sorted(files.values(), key=lambda e: e.path)


def our_roots() -> set[Path]:
    """Site directories our distributions are installed in."""
    roots = set()
    for dist in md.distributions():
        if _norm(dist.metadata["Name"] or "") in OUR_DISTRIBUTIONS:
            roots.add(Path(str(dist.locate_file(""))).resolve())
    return roots


def shadowing() -> list[str]:
    """Errors when ``vllm_ascend`` is a regular package that hides our site directory."""
    spec = importlib.util.find_spec("vllm_ascend")
    if spec is None or spec.origin in (None, "namespace"):
        return []  # a namespace package spans every sys.path entry
    search = {Path(p).resolve() for p in spec.submodule_search_locations or ()}
    return [f"ours in {root} are shadowed: vllm_ascend is the regular package {spec.origin} "
            f"(vLLM-Ascend in another site directory); install ours into that environment"
            for root in sorted(our_roots()) if (root / "vllm_ascend").resolve() not in search]


def problems(entries: list[FileProvenance] | None = None) -> list[str]:
    """What keeps ours from being the code behind our module paths."""
    entries = scan() if entries is None else entries
    errors = []
    for e in entries:
        ours = sorted(set(e.listed_by) & OUR_DISTRIBUTIONS)
        if not ours:
            continue
        if not e.exists:
            errors.append(f"{e.module}: {e.path} of {ours[0]} is gone (removed by an "
                          f"uninstall of {', '.join(sorted(set(e.listed_by) - set(ours)))}); "
                          f"{REPAIR_HINT}")
        elif e.provider == VLLM_ASCEND:
            errors.append(f"{e.module}: {e.path} holds vLLM-Ascend's copy, not {ours[0]}'s; "
                          f"{REPAIR_HINT}")
    return errors + shadowing()
