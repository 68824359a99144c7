# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of the ``vllm-ascend-kv bench`` subcommands.

A benchmark measures a path and its raw baseline in the same run and reports
ratios; absolute numbers are recorded with the machine they came from. Every
benchmark writes one JSON file (``bench-results/<name>.json`` by default), appends
its run to the results ledger (:mod:`.ledger`, ``--ledger``) and prints a table;
none ever fails on a number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .ledger import add_ledger_arg, record

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_OUT_DIR = "bench-results"


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """``--quick`` (smoke size), ``--out`` (results directory) and ``--ledger`` (where the
    run's ledger entry goes)."""
    parser.add_argument("--quick", action="store_true",
                        help="smallest configuration (a smoke run for CI, seconds)")
    parser.add_argument("--out", default=os.environ.get("VLLM_ASCEND_KV_BENCH_DIR", DEFAULT_OUT_DIR),
                        help="directory of the JSON results (default: %(default)s)")
    add_ledger_arg(parser)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    memcpy = glibc_copy_facts()
    if memcpy:
        info["memcpy"] = memcpy
    return info


#: glibc tunables that decide how ``memcpy`` / ``memmove`` copy large ranges on x86
_COPY_TUNABLES = {"glibc.cpu.x86_non_temporal_threshold": "non_temporal_threshold",
                  "glibc.cpu.x86_rep_movsb_threshold": "rep_movsb_threshold",
                  "glibc.cpu.x86_shared_cache_size": "shared_cache_size"}


def glibc_copy_facts() -> dict[str, Any]:
    """How this machine's glibc copies memory: its version and, where the dynamic loader
    lists them (glibc 2.33 and later, x86), the thresholds in bytes above which
    ``memcpy`` uses ``rep movsb`` and non-temporal stores (a copy above the latter
    writes around the cache, which makes large copies into untouched memory faster).
    glibc derives them from the cache sizes the CPU reports, so two virtual machines of
    one kind can differ. Empty where none of this can be read."""
    facts: dict[str, Any] = {}
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):
        version = None
    if version:
        facts["glibc"] = version.split()[-1]
    loader = _dynamic_loader()
    if loader is None:
        return facts
    try:
        out = subprocess.run([loader, "--list-tunables"], capture_output=True, text=True,
                             timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return facts
    for line in out.splitlines():
        name, _, rest = line.partition(":")
        key = _COPY_TUNABLES.get(name.strip())
        if key is None or not rest.split():
            continue
        try:
            facts[key] = int(rest.split()[0], 0)
        except ValueError:
            continue
    return facts


def _dynamic_loader() -> str | None:
    """Path of the dynamic loader mapped into this process (``ld-linux*``), if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "/ld-linux" in path and os.path.exists(path):
                    return path
    except OSError:
        pass
    return None


def write_results(name: str, payload: dict[str, Any], out_dir: str | os.PathLike[str], *,
                  args: argparse.Namespace | None = None,
                  samples: Sequence[dict[str, Any]] | None = None) -> Path:
    """Write ``<out_dir>/<name>.json`` with the machine info added; returns the path.

    With the command's ``args``, the run is also appended to the ledger they name
    (:func:`.ledger.record`), with its raw ``samples`` (:func:`.ledger.series`).
    """
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "machine": machine_info(), **payload}
    path.write_text(json.dumps(doc, indent=2, default=float) + "\n")
    if args is not None:
        record(args, name, json.loads(json.dumps(doc, default=float)), samples)
    return path


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain-text table of ``rows`` (floats to 3 significant digits)."""
    if not rows:
        return "(no rows)"
    cols = list(columns or rows[0].keys())

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    body = [[cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def progress(items: Iterable[T], label: str, total: int | None = None) -> Iterator[T]:
    """Yield ``items`` printing ``label i/n`` to stderr (long benchmarks show progress)."""
    seq = list(items)
    n = total or len(seq)
    for i, item in enumerate(seq, 1):
        print(f"\r{label} {i}/{n}", end="", file=sys.stderr, flush=True)
        yield item
    print(file=sys.stderr, flush=True)


def best_rate(fn: Callable[[], int], *, repeat: int = 5, min_time: float = 0.05) -> float:
    """Best observed bytes/second of ``fn`` (which returns the bytes it moved).

    Each sample runs ``fn`` enough times to last ``min_time`` seconds; the best
    of ``repeat`` samples is kept, which is the usual way to measure a copy
    rate on a noisy machine.
    """
    best = 0.0
    for _ in range(repeat):
        n_bytes = 0
        start = time.perf_counter()
        while True:
            n_bytes += fn()
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        best = max(best, n_bytes / elapsed)
    return best


# ---------------------------------------------------------------------- ratios and steps
def median(values: Iterable[float | None]) -> float | None:
    """Median of the finite values, or ``None`` when there is none."""
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return statistics.median(vals) if vals else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` when either is missing or the divisor is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return float(numerator) / float(denominator)


def goal_check(value: float | None, *, at_least: float | None = None,
               at_most: float | None = None) -> bool | None:
    """Whether ``value`` meets a goal; ``None`` when it was not measured.

    Raises:
        ValueError: neither or both bounds given.
    """
    if (at_least is None) == (at_most is None):
        raise ValueError(f"give exactly one bound (at_least={at_least}, at_most={at_most})")
    if value is None:
        return None
    return value >= at_least if at_least is not None else value <= at_most  # type: ignore[operator]


class Steps:
    """Progress of a long benchmark made of slow steps: ``[i/n] label (elapsed)`` on stderr."""

    def __init__(self, total: int, name: str = "bench") -> None:
        self.total = total
        self.name = name
        self.done = 0
        self.start = time.monotonic()

    def step(self, label: str) -> None:
        """Announce the next step."""
        self.done += 1
        self.note(f"[{self.done}/{self.total}] {label}")

    def note(self, text: str) -> None:
        """A line of progress inside the current step."""
        print(f"{self.name} {time.monotonic() - self.start:7.1f}s  {text}", file=sys.stderr,
              flush=True)


@contextlib.contextmanager
def environ(values: dict[str, str | None]) -> Iterator[None]:
    """The environment with ``values`` set (``None``: unset) meanwhile."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
