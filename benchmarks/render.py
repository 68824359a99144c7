# SPDX-License-Identifier: Apache-2.0
"""Render ``docs/benchmarks.md`` and its plots from the results ledger (``benchmarks/results``).

    python benchmarks/render.py [--ledger benchmarks/results] [--docs docs] [--check]

Every figure, ratio and verdict of the page comes from the ledger's entries (one per run of a
``vllm-ascend-kv bench`` section, ``bench/ledger.py`` of ascend-kv-bench): nothing is typed by
hand. The page states the one rule of the goal rows once, then the goal table (each row
judged on the raw samples of the latest run of its section, by :func:`judge`), the plots, and
one part per section (its runs' facts and tables). ``--check`` renders into memory, draws no
plot, and fails when the committed page differs (``nox -s lint``); ``nox -s bench-report``
writes it. The page depends on the ledger and on HEAD (a run whose measured packages'
sources differ from HEAD's is stale), on nothing else: no clock, no machine.

Each section's text and goal rows live in ``sections/<name>.py`` (its ``SECTION``, see
``sections/_common.py``); explanations that do not come from a run live in
``docs/benchmarks-notes.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
SECTIONS_DIR = Path(__file__).resolve().parent / "sections"
DEFAULT_LEDGER = ROOT / "benchmarks" / "results"
_PACKAGE = "bench_sections"
# the ledger reader and the bootstrap, from this checkout's ascend-kv-bench sources
_BENCH_SRC = ROOT / "packages" / "ascend-kv-bench" / "src"
if str(_BENCH_SRC) not in sys.path:
    sys.path.insert(0, str(_BENCH_SRC))
from vllm_ascend.distributed.kv_transfer.bench import ledger  # noqa: E402


def _load_common() -> ModuleType:
    """The section package and its shared helpers, loaded from ``sections/`` by path."""
    if _PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            _PACKAGE, SECTIONS_DIR / "__init__.py", submodule_search_locations=[str(SECTIONS_DIR)])
        assert spec is not None and spec.loader is not None
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[_PACKAGE] = pkg
        spec.loader.exec_module(pkg)
    return importlib.import_module(f"{_PACKAGE}._common")


_common = _load_common()
fmt = _common.fmt
md_table = _common.md_table
verdict = _common.verdict
num = _common.num
GoalSpec = _common.GoalSpec
Measured = _common.Measured
Section = _common.Section
MIN_ROUNDS = _common.MIN_ROUNDS

#: The sections of ``nox -s bench``, in the order the page lists them when they have no
#: module; a section module of another name is rendered too.
CORE_BENCHMARKS = ("engine", "kernels", "p2p", "layerwise", "pool", "trace", "offload",
                   "serve", "auth")

RULE = (
    "**The rule of every goal row.** A row reads the **latest run of its section** in the "
    "ledger made with the options the row names (never a run chosen by its result), and "
    "judges it on that run's raw samples: at least **{rounds} alternating rounds**; each "
    "side's figure is the **median over the rounds** of its rounds' medians, the row's value "
    "their ratio (or difference) with its **95% paired bootstrap interval** over the rounds "
    "(rounds resampled together), **met only when the whole interval is on the right side** "
    "of the bound (a section's own tables may show other statistics of the same samples, "
    "such as the median of the per-round ratios); over several points (sizes, "
    "kernels) every point must be, and the point nearest to failing is shown. A run whose "
    "measured packages' sources differ from HEAD's is **stale** and counts as not met; a "
    "section with no run is **no run recorded**, not met. Against a peer, each side is "
    "taken at its own best binding; how each engine was bound is in its section.")


def load_sections() -> dict[str, Any]:
    """``SECTION`` of every module in ``sections/``, by benchmark name.

    A module that fails to import, or defines no ``SECTION``, is reported and left out.
    """
    out: dict[str, Any] = {}
    for path in sorted(SECTIONS_DIR.glob("*.py")):
        name = path.stem
        if name.startswith("_"):
            continue
        try:
            mod = importlib.import_module(f"{_PACKAGE}.{name}")
        except Exception as exc:  # a broken section must not break the page
            logger.warning("section module %s not loaded: %s: %s", path.name,
                           type(exc).__name__, exc)
            continue
        section = getattr(mod, "SECTION", None)
        if section is None:
            logger.warning("section module %s defines no SECTION: left out", path.name)
            continue
        plot = getattr(mod, f"plot_{name}", None)
        if section.plot is None and callable(plot):
            section = dataclasses.replace(section, plot=plot)
        out[name] = section
    return out


def benchmark_names(sections: dict[str, Any] | None = None) -> tuple[str, ...]:
    """The core benchmarks, then those only a section module names (sorted)."""
    sections = load_sections() if sections is None else sections
    return CORE_BENCHMARKS + tuple(sorted(n for n in sections if n not in CORE_BENCHMARKS))


# ---------------------------------------------------------------------- goals
@dataclasses.dataclass(frozen=True)
class Row:
    """One goal row as judged: its spec, the run it read, and the verdict of the rule."""

    spec: Any
    entry: Mapping[str, Any] | None
    stale: bool
    measured: Any
    met: bool
    why: str


def _matches(entry: Mapping[str, Any], config: Mapping[str, Any]) -> bool:
    """Whether the run was made with the options a row names: each equal to the row's value,
    or accepted by it where the row gives a test (a comma-separated list that holds 256)."""
    have = entry.get("config") or {}
    return all(v(have.get(k)) if callable(v) else have.get(k) == v for k, v in config.items())


def judge(spec: Any, entries: Sequence[Mapping[str, Any]],
          head: Mapping[str, str | None]) -> Row:
    """Apply the rule to one goal row: the latest run of its section with its options."""
    entry = ledger.latest(entries, spec.section, lambda e: _matches(e, spec.config))
    if entry is None:
        return Row(spec, None, False, None, False, "no run recorded")
    stale = ledger.is_stale(entry, head)
    measured = None
    if spec.measure is not None:
        try:
            measured = spec.measure(entry)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            logger.warning("goal %r: %s: %s", spec.goal, type(exc).__name__, exc)
    if measured is None or measured.value is None:
        why = ("its section records no raw samples for it yet" if spec.measure is None
               else "not measured by this run")
        return Row(spec, entry, stale, None, False, why)
    if measured.rounds < MIN_ROUNDS:
        return Row(spec, entry, stale, measured, False,
                   f"{measured.rounds} round{'s' if measured.rounds != 1 else ''}, fewer "
                   f"than {MIN_ROUNDS}")
    if stale:
        return Row(spec, entry, stale, measured, False, "stale")
    return Row(spec, entry, stale, measured, bool(measured.met), "")


def evaluate_goals(entries: Sequence[Mapping[str, Any]], head: Mapping[str, str | None],
                   sections: Mapping[str, Any] | None = None) -> list[Row]:
    """Every section module's goal rows, judged and ordered by rank."""
    sections = load_sections() if sections is None else sections
    specs = sorted((g for s in sections.values() for g in s.goals), key=lambda g: g.rank)
    return [judge(g, entries, head) for g in specs]


def value_cell(m: Any, *, where: bool = True) -> str:
    """``0.93 (95%: 0.91–0.95), 16 blocks`` (without ``, 16 blocks`` where ``where`` is
    false)."""
    if m is None:
        return "–"
    at = f", {m.where}" if m.where and where else ""
    if m.rounds < 2:  # one round has no interval
        return f"{fmt(m.value)}{m.unit} (1 round: no interval)" + at
    return f"{fmt(m.value)}{m.unit} ({fmt(m.low)}–{fmt(m.high)}{m.unit})" + at


def run_cell(entry: Mapping[str, Any] | None, stale: bool = False, *,
             time: bool = True) -> str:
    """``2026-12-06 13:45, 1a2b3c4`` (the run's end and commit; the day alone without
    ``time``), ``stale`` where it is."""
    if entry is None:
        return "–"
    when = str(entry.get("ended") or "?").replace("T", " ")[:16 if time else 10]
    src = entry.get("source") or {}
    commit = str(src.get("commit") or "no commit")[:7] + ("+dirty" if src.get("dirty") else "")
    return f"[{when}, `{commit}`](#{_anchor(entry)})" + (" (stale)" if stale else "")


def _anchor(entry: Mapping[str, Any]) -> str:
    return "run-" + str(entry.get("id", "")).replace("/", "-").lower()


#: The most characters of a goal's ``short`` words (the table on top keeps a line a row).
SHORT_MAX = 48


def goal_table(rows: Sequence[Row]) -> str:
    """The table on top of the page: a line a goal (its ``short`` words, the value with its
    interval, the peer, the verdict, the run's day and commit); :func:`goals_in_full`
    follows it."""
    cells = []
    for i, r in enumerate(rows, 1):
        v = verdict(r.met) + (f" ({r.why})" if r.why else "")
        cells.append({"n": i, "goal": r.spec.short or r.spec.goal,
                      "value": value_cell(r.measured, where=False) if r.measured
                      else ("no run recorded" if r.entry is None else "–"),
                      "peer": r.spec.peer, "verdict": v,
                      "run": run_cell(r.entry, r.stale, time=False)})
    return md_table(cells, ["n", "goal", "value", "peer", "verdict", "run"],
                    ["#", "goal", "value (95% interval)", "against", "verdict", "run"])


def goals_in_full(rows: Sequence[Row]) -> str:
    """Each goal of the table in full, by its number, with where its value was read (the
    size, prompt length, binding or trace nearest to failing)."""
    out = ["The goals in full, by their number in the table, and where each value was "
           "read:\n\n"]
    for i, r in enumerate(rows, 1):
        where = r.measured.where if r.measured is not None and r.measured.where else ""
        out.append(f"{i}. {r.spec.goal}" + (f" — {where}" if where else "") + ".\n")
    return "".join(out) + "\n"


#: The time the whole set may take on the 2-core machine (issue 54: "a working day").
SET_BUDGET_MIN = 120.0


def _minutes(entry: Mapping[str, Any]) -> float | None:
    """A run's wall time in minutes, from its start and end in the ledger."""
    import datetime as dt

    try:
        start, end = (dt.datetime.strptime(str(entry.get(k)), "%Y-%m-%dT%H:%M:%SZ")
                      for k in ("started", "ended"))
    except ValueError:
        return None
    return (end - start).total_seconds() / 60.0


def set_time(rows: Sequence[Row], entries: Sequence[Mapping[str, Any]],
             names: Sequence[str]) -> str:
    """What the runs behind the page took: every run a goal row reads and the latest run of
    each section (``names``), their wall times from the ledger, the sum against
    :data:`SET_BUDGET_MIN`."""
    runs: dict[str, Mapping[str, Any]] = {}
    for r in rows:
        if r.entry is not None:
            runs[str(r.entry.get("id"))] = r.entry
    for n in names:
        last = ledger.latest(entries, n)
        if last is not None:
            runs.setdefault(str(last.get("id")), last)
    if not runs:
        return ""
    timed = [(str(e.get("section")), _minutes(e)) for e in runs.values()]
    by: dict[str, list[float]] = {}
    for sec, m in timed:
        by.setdefault(sec, []).append(m if m is not None else float("nan"))
    total = sum(m for ms in by.values() for m in ms if m == m)
    parts = ", ".join(f"{sec} {' + '.join(f'{m:.1f}' for m in sorted(ms, reverse=True))}"
                      for sec, ms in sorted(by.items(), key=lambda kv: -sum(kv[1])))
    missing = [n for n in names if n not in by]
    within = total <= SET_BUDGET_MIN
    return (f"**What these runs took.** The {len(runs)} runs the page shows (those the goal "
            f"rows read and the latest of each section) took {total:.0f} minutes of wall time "
            f"together, by section: {parts} minutes; "
            + ("within" if within else "**over**")
            + f" the {SET_BUDGET_MIN:.0f} minutes the whole set may take on the 2-core machine"
            + (f" (sections without a run, not counted: {', '.join(missing)})" if missing
               else "") + ".\n\n")


# ---------------------------------------------------------------------- plots
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80, metadata={"Software": None})
    _plt().close(fig)
    return path


def plot_throughput(res: dict[str, dict[str, Any]], path: Path, draw: bool = True
                    ) -> Path | None:
    """GB/s against block size: raw transfer engine (read/write ceiling), memcpy, offload."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in res.get("engine", {}).get("best") or []:
        series.setdefault(f"Mooncake TE {r['op']} (best point)", []).append(
            (r["block_kib"], r["GBps"]))
    for r in res.get("engine", {}).get("rows") or []:
        if r.get("batch") == 1 and r.get("concurrency") == 1:
            series.setdefault(f"Mooncake TE {r['op']}, 1 block/call", []).append(
                (r["block_kib"], r["GBps"]))
    for r in res.get("offload", {}).get("bandwidth") or []:
        series.setdefault("offload save", []).append((r["block_kib"], r["save_gbps"]))
        series.setdefault("offload load", []).append((r["block_kib"], r["load_gbps"]))
        series.setdefault("memcpy (offload run)", []).append((r["block_kib"], r["memcpy_gbps"]))
    for r in res.get("kernels", {}).get("results") or []:
        if num(r.get("memcpy_gbps")) is not None and num(r.get("gather")) is not None:
            series.setdefault("kernels gather", []).append(
                (r["block_kib"], r["memcpy_gbps"] * r["gather"]))
    if not series:
        return None
    if not draw:
        return path
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 4))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    _block_axis(ax, series)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s")
    ax.set_title("Throughput against block size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


def _block_axis(ax: Any, series: dict[str, list[tuple[float, float]]]) -> None:
    ticks = sorted({p[0] for pts in series.values() for p in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t:g}" for t in ticks], fontsize=7)
    ax.minorticks_off()
    ax.set_xlabel("block size (KiB)")


def plot_ratios(res: dict[str, dict[str, Any]], path: Path, draw: bool = True
                ) -> Path | None:
    """Ratio to memcpy against block size (kernels, offload), with the 0.8 goal line."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in res.get("kernels", {}).get("results") or []:
        for k in ("gather", "scatter"):
            if num(r.get(k)) is not None:
                series.setdefault(f"kernels {k}", []).append((r["block_kib"], r[k]))
    for r in res.get("offload", {}).get("bandwidth") or []:
        series.setdefault("offload save", []).append((r["block_kib"], r["save_ratio"]))
        series.setdefault("offload load", []).append((r["block_kib"], r["load_ratio"]))
    if not series:
        return None
    if not draw:
        return path
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.5, 3.5))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.axhline(0.8, color="grey", linestyle="--", label="goal 0.8")
    _block_axis(ax, series)
    ax.set_ylabel("throughput / memcpy")
    ax.set_title("Copy paths as a ratio of memcpy (same run)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


def plot_hit_rate(res: dict[str, dict[str, Any]], path: Path, draw: bool = True
                  ) -> Path | None:
    """Trace replay: hit rate against pool capacity, with the unbounded pool's."""
    rows = res.get("trace", {}).get("rows") or []
    if not rows:
        return None
    if not draw:
        return path
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = [r["capacity_fraction"] for r in rows]
    ax.plot(xs, [r["hit_rate"] for r in rows], marker="o", label="local pool (LRU)")
    best = res["trace"].get("unbounded", {}).get("hit_rate")
    if best is not None:
        ax.axhline(best, color="grey", linestyle="--", label="unbounded pool (best possible)")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (fraction of the trace's distinct blocks)")
    ax.set_ylabel("block hit rate")
    ax.set_ylim(0, max(0.05, (best or 0) * 1.15, *(r["hit_rate"] for r in rows)))
    ax.set_title("Mooncake conversation trace: hit rate against capacity")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_serve(res: dict[str, dict[str, Any]], path: Path, draw: bool = True
               ) -> Path | None:
    """Serve: TTFT of each scenario (hit / D side) against recompute."""
    summary = res.get("serve", {}).get("summary") or {}
    items = []
    for name, s in summary.items():
        if name == "baseline":
            continue
        v = num(s.get("hit_over_recompute", s.get("d_ttft_over_recompute")))
        if v is not None:
            items.append((name, v))
    if not items:
        return None
    if not draw:
        return path
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 0.5 + 0.4 * len(items)))
    names = [i[0] for i in items]
    colors = ["tab:blue" if "ours" in n else "tab:orange" for n in names]
    ax.barh(names, [i[1] for i in items], color=colors)
    ax.axvline(1.0, color="grey", linestyle="--")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT / recompute TTFT (blue: ours, orange: vLLM's)")
    ax.set_title("Time to first token of a hit (P/D: on D) against recompute")
    ax.invert_yaxis()
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


# ---------------------------------------------------------------------- page
def run_facts(entry: Mapping[str, Any], stale: bool) -> str:
    """What a run measured, where, and with what: from its ledger entry."""
    src = entry.get("source") or {}
    m = entry.get("machine") or {}
    v = entry.get("versions") or {}
    mem = num(m.get("mem_total_kib"))
    aff = m.get("affinity")
    cfg = entry.get("config") or {}
    opts = " ".join(f"{k}={cfg[k]}" for k in sorted(cfg) if k not in ("bench", "command",
                                                                       "verbose"))
    ours = ", ".join(f"{k} {x}" for k, x in sorted(v.items())
                     if k.startswith("ascend") and x is not None)
    return (f"- **{entry.get('id')}**: {entry.get('started')} to {entry.get('ended')}, commit "
            f"`{str(src.get('commit'))[:12]}`" + (" (tree dirty)" if src.get("dirty") else "")
            + (", **stale**: the measured packages' sources differ from HEAD's" if stale
               else ", the measured packages' sources as at HEAD")
            + f" ({', '.join(sorted(src.get('packages') or {})) or 'none recorded'})\n"
            f"- machine: {m.get('cpu_model')}, {m.get('cpus')} CPUs, "
            f"{fmt(mem / 2**20 if mem else None)} GiB memory, bound to CPUs {aff}; load "
            f"average {m.get('loadavg_start')} at the start, {m.get('loadavg_end')} at the "
            f"end; {m.get('platform')}\n"
            f"- versions: {ours}; vLLM {v.get('vllm')}, Mooncake {v.get('mooncake')}, torch "
            f"{v.get('torch')}\n"
            f"- options: `{opts}`; {len(entry.get('samples') or [])} series of raw samples\n")


def _runs_shown(name: str, section: Any, rows: Sequence[Row],
                entries: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The runs a section's part shows: those its goal rows read, and its latest run."""
    shown = {id(r.entry): r.entry for r in rows if r.spec.section == name and r.entry}
    last = ledger.latest(entries, name)
    if last is not None:
        shown.setdefault(id(last), last)
    return sorted(shown.values(), key=lambda e: (str(e.get("ended")), str(e.get("id"))))


def render(entries: Sequence[Mapping[str, Any]], head: Mapping[str, str | None], docs: Path,
           *, draw: bool = True) -> str:
    """The Markdown page; plots written to ``docs/img`` when ``draw``."""
    sections = load_sections()
    rows = evaluate_goals(entries, head, sections)
    latest = {n: ledger.latest(entries, n) for n in benchmark_names(sections)}
    res = {n: dict(e.get("result") or {}) for n, e in latest.items() if e is not None}
    img_dir = docs / "img"

    def plot(fn: Callable[..., Path | None], name: str) -> str | None:
        try:
            path = fn(res, img_dir / name, draw=draw)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # changed format
            logger.warning("plot %s skipped: %s: %s", name, type(exc).__name__, exc)
            return None
        return f"img/{path.name}" if path else None

    met = sum(r.met for r in rows)
    parts = ["<!-- Generated by benchmarks/render.py from the ledger benchmarks/results/: do "
             "not edit. Regenerate with `nox -s bench-report`. -->\n",
             "# Benchmarks\n\n",
             "Every figure on this page is computed from the results ledger "
             "(`benchmarks/results/`, one entry per run of a `vllm-ascend-kv bench` section, "
             "with every raw sample; see `benchmarks/README.md`). Run a section with "
             "`vllm-ascend-kv bench <section>` from a checkout (it appends its entry), then "
             "`nox -s bench-report`. What the results mean, and the investigations behind "
             "them: [benchmarks-notes.md](benchmarks-notes.md).\n\n",
             RULE.format(rounds=MIN_ROUNDS), "\n\n",
             f"## Goals\n\n{met} of {len(rows)} met.\n\n", goal_table(rows), "\n",
             goals_in_full(rows), set_time(rows, entries, benchmark_names(sections))]
    plots = [(title, plot(fn, f)) for title, fn, f in (
        ("Throughput against block size", plot_throughput, "bench-throughput-vs-block.png"),
        ("Ratio to memcpy against block size", plot_ratios, "bench-ratio-vs-memcpy.png"),
        ("Hit rate against capacity", plot_hit_rate, "bench-hit-rate-vs-capacity.png"))]
    if any(p for _t, p in plots):
        parts.append("## Plots\n\nFrom the latest run of each section.\n\n")
        parts += [f"![{t}]({p})\n\n" for t, p in plots if p]
    images: dict[str, str | None] = {"serve": plot(plot_serve, "bench-serve-ttft.png")}
    for name, section in sorted(sections.items(), key=lambda kv: kv[1].order):
        parts.append(f"## {section.title}\n\n")
        if section.source is not None:
            parts.append(f"_{section.source}_.\n\n")
        runs = _runs_shown(name, section, rows, entries)
        if not runs:
            parts.append("No run recorded in the ledger.\n\n")
            continue
        if section.plot is not None:
            images[name] = plot(section.plot, f"bench-{name}.png")
        for entry in runs:
            stale = ledger.is_stale(entry, head)
            parts.append(f'<a id="{_anchor(entry)}"></a>\n\n' + run_facts(entry, stale) + "\n")
            try:
                parts.append(section.render(dict(entry.get("result") or {}), images))
                if section.samples is not None:
                    parts.append(section.samples(entry))
            except (AttributeError, KeyError, TypeError, ValueError) as exc:  # changed format
                parts.append(f"\n(could not render {entry.get('id')}: "
                             f"{type(exc).__name__}: {exc})\n")
            parts.append("\n")
    names = set(sections) | {str(e.get("section")) for e in entries}
    counts = {n: len([e for e in entries if e.get("section") == n]) for n in names}
    parts.append("## The ledger\n\n" + ", ".join(
        f"{n}: {c} run{'s' if c != 1 else ''}" for n, c in sorted(counts.items())) + ".\n")
    unshown = sorted(n for n in names if n not in sections)
    if unshown:
        parts.append(f"\nRuns of sections without a module in `benchmarks/sections/` (not "
                     f"rendered): {', '.join(unshown)}.\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Command line of the renderer."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ledger", default=str(DEFAULT_LEDGER), help="the results ledger")
    ap.add_argument("--docs", default=str(ROOT / "docs"), help="docs directory (page, img/)")
    ap.add_argument("--check", action="store_true",
                    help="render without plots and fail when <docs>/benchmarks.md differs")
    args = ap.parse_args(argv)
    entries = ledger.read_entries(Path(args.ledger)) if Path(args.ledger).is_dir() else []
    packages = sorted({p for e in entries for p in (e.get("source") or {}).get("packages") or {}})
    head = ledger.head_trees(ROOT, packages)
    docs = Path(args.docs)
    page = render(entries, head, docs, draw=not args.check)
    target = docs / "benchmarks.md"
    if args.check:
        if not target.exists() or target.read_text() != page:
            print(f"{target} is not what the ledger renders (a new run, or a commit that "
                  "changed a measured package: its rows are stale now): run "
                  "`nox -s bench-report` and commit the page", file=sys.stderr)
            return 1
        print(f"{target} is what the ledger renders ({len(entries)} runs)")
        return 0
    docs.mkdir(parents=True, exist_ok=True)
    target.write_text(page)
    print(f"wrote {target} from {len(entries)} runs of the ledger")
    return 0


if __name__ == "__main__":
    sys.exit(main())
