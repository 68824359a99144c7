# SPDX-License-Identifier: Apache-2.0
"""Render ``docs/benchmarks.md`` and its plots from the JSON of ``vllm-ascend-kv bench``.

    python benchmarks/render.py [--results bench-results] [--docs docs]

Reads ``<results>/<name>.json`` (engine, kernels, p2p, layerwise, pool, trace,
offload, serve, auth, and any other benchmark that has a section module; any may be
missing), writes ``<docs>/benchmarks.md`` and small PNG plots in ``<docs>/img/``
(matplotlib, Agg backend). The page leads with the goals of the issues and whether this run
met each; then one section per benchmark with the ratios measured in the run (the figures to
quote) and the absolute numbers with the machine they came from.

Each benchmark's section text and goal rows live in ``sections/<name>.py`` (its ``SECTION``,
see ``sections/_common.py``); this module loads the JSON, finds the section modules, draws
the plots that span benchmarks and puts the page together.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

SECTIONS_DIR = Path(__file__).resolve().parent / "sections"
_PACKAGE = "bench_sections"


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
# the table helpers and the goal record, for the section modules' callers and the tests
fmt = _common.fmt
md_table = _common.md_table
verdict = _common.verdict
num = _common.num
Goal = _common.Goal
Section = _common.Section

#: The benchmarks of ``nox -s bench``, in the order the page lists what is missing; a JSON
#: of another name is read too when ``sections/<name>.py`` exists.
CORE_BENCHMARKS = ("engine", "kernels", "p2p", "layerwise", "pool", "trace", "offload",
                   "serve", "auth")
SHARED_VM_NOTE = ("a shared 2-core VM (other work ran beside the benchmarks): absolute times "
                  "vary by tens of percent between runs; ratios measured in one run are the "
                  "figures to quote")


def load_sections() -> dict[str, Any]:
    """``SECTION`` of every module in ``sections/``, by benchmark name.

    A module that fails to import, or defines no ``SECTION``, is reported and left out:
    its benchmark's JSON is then listed without a section.
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


BENCHMARKS = benchmark_names()


# ---------------------------------------------------------------------- loading
def load_results(results_dir: Path) -> dict[str, dict[str, Any]]:
    """Every ``<name>.json`` of the known benchmarks found in ``results_dir``.

    A file that is not valid JSON is reported and left out (the page says so).
    """
    out: dict[str, dict[str, Any]] = {}
    for name in benchmark_names():
        path = results_dir / f"{name}.json"
        if not path.exists():
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            logger.warning("%s is not valid JSON (%s): left out", path, exc)
            out[name] = {"_error": f"{path.name} is not valid JSON: {exc}"}
            continue
        if not isinstance(data, dict):
            out[name] = {"_error": f"{path.name} does not hold a JSON object"}
            continue
        out[name] = data
    return out


# ---------------------------------------------------------------------- goals
def evaluate_goals(res: dict[str, dict[str, Any]]) -> list[Any]:
    """The goals of the issues (every section module's rows, ordered by rank), each with what
    this run measured and whether it was met."""
    goals: list[Any] = []
    for name, section in load_sections().items():
        try:
            goals.extend(section.goals(res))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # changed format
            logger.warning("goals of %s skipped: %s: %s", name, type(exc).__name__, exc)
    return sorted(goals, key=lambda g: g.rank)


# ---------------------------------------------------------------------- plots
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    _plt().close(fig)
    return path


def plot_throughput(res: dict[str, dict[str, Any]], path: Path) -> Path | None:
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


def plot_ratios(res: dict[str, dict[str, Any]], path: Path) -> Path | None:
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


def plot_hit_rate(res: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """Trace replay: hit rate against pool capacity, with the unbounded pool's."""
    rows = res.get("trace", {}).get("rows") or []
    if not rows:
        return None
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


def plot_serve(res: dict[str, dict[str, Any]], path: Path) -> Path | None:
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
def _machine(res: dict[str, dict[str, Any]]) -> str:
    machines: dict[tuple[Any, Any, Any], list[tuple[str, Any]]] = {}
    for name, data in res.items():
        m = data.get("machine") or {}
        key = (m.get("platform"), m.get("cpus"), m.get("torch"))
        machines.setdefault(key, []).append((name, m.get("time", "?")))
    lines = []
    for (plat, cpus, torch), runs in machines.items():
        when = sorted(t for _n, t in runs)
        lines.append(f"- {plat}, {cpus} CPUs, torch {torch}; runs {when[0]} to {when[-1]} "
                     f"({', '.join(n for n, _t in runs)})")
    return "\n".join(lines)


def render(res: dict[str, dict[str, Any]], docs: Path) -> str:
    """The Markdown page (plots written to ``docs/img``)."""
    img_dir = docs / "img"

    def plot(fn: Callable[[dict[str, dict[str, Any]], Path], Path | None],
             name: str) -> Path | None:
        try:
            return fn(res, img_dir / name)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:  # changed format
            logger.warning("plot %s skipped: %s: %s", name, type(exc).__name__, exc)
            return None

    plots = {
        "throughput": plot(plot_throughput, "bench-throughput-vs-block.png"),
        "ratios": plot(plot_ratios, "bench-ratio-vs-memcpy.png"),
        "hit_rate": plot(plot_hit_rate, "bench-hit-rate-vs-capacity.png"),
        "serve": plot(plot_serve, "bench-serve-ttft.png"),
    }

    def rel(p: Path | None) -> str | None:
        return f"img/{p.name}" if p else None

    parts = ["<!-- Generated by benchmarks/render.py from bench-results/*.json: do not edit. "
             "Regenerate with `nox -s bench`. -->\n",
             "# Benchmarks\n\n",
             "Every benchmark measures a path and its baseline in the same run and reports the "
             "ratio; the absolute numbers are those of the machine below, "
             f"{SHARED_VM_NOTE}. Run them yourself with `vllm-ascend-kv bench <name>` "
             "(`--quick` for a smoke run) or all of them with `nox -s bench`.\n\n",
             "Machine of this run:\n\n", _machine(res) or "- (no results)", "\n\n",
             "## Goals\n\n"]
    try:
        parts.append(md_table([{"goal": g.goal, "source": g.source, "measured": g.measured,
                                "met": verdict(g.met)} for g in evaluate_goals(res)],
                              ["goal", "source", "measured", "met"]))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # changed format
        parts.append(f"(could not check the goals: {type(exc).__name__}: {exc})\n")
    parts.append("\n")
    sections = load_sections()
    names = benchmark_names(sections)
    missing = [n for n in names if n not in res]
    broken = [n for n in names if "_error" in res.get(n, {})]
    if missing:
        parts.append(f"Not in this run: {', '.join(missing)}.\n\n")
    for n in broken:
        parts.append(f"Unreadable: {res[n]['_error']}.\n\n")
    if any(rel(p) for k, p in plots.items() if k != "serve"):
        parts.append("## Plots\n\n")
        for key, title in (("throughput", "Throughput against block size"),
                           ("ratios", "Ratio to memcpy against block size"),
                           ("hit_rate", "Hit rate against capacity")):
            if plots[key]:
                parts.append(f"![{title}]({rel(plots[key])})\n\n")
    images = {k: rel(p) for k, p in plots.items()}
    for name, section in sections.items():  # a section's own plot, shown in the section
        if section.plot is not None and name in res and "_error" not in res[name] \
                and name not in images:
            images[name] = rel(plot(section.plot, f"bench-{name}.png"))
    for name, section in sorted(sections.items(), key=lambda kv: kv[1].order):
        if name in res and "_error" not in res[name]:
            parts.append(f"## {section.title}\n\n")
            if section.source is not None:
                parts.append(f"_{section.source}_. ")
            try:
                parts.append(section.render(res[name], images))
            except (AttributeError, KeyError, TypeError, ValueError) as exc:  # changed format
                parts.append(f"\n(could not render {name}.json: {type(exc).__name__}: {exc})\n")
            parts.append("\n")
    for name in names:
        if name in res and "_error" not in res[name] and name not in sections:
            parts.append(f"## `bench {name}`\n\n(no section module `sections/{name}.py`: "
                         f"{name}.json is not rendered)\n\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Command line of the renderer."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="bench-results", help="directory of the JSON results")
    ap.add_argument("--docs", default="docs", help="docs directory (page and img/)")
    args = ap.parse_args(argv)
    res = load_results(Path(args.results))
    if not res:
        print(f"no benchmark results in {args.results}", file=sys.stderr)
        return 1
    docs = Path(args.docs)
    page = render(res, docs)
    (docs / "benchmarks.md").write_text(page)
    print(f"wrote {docs / 'benchmarks.md'} from {', '.join(sorted(res))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
