# SPDX-License-Identifier: Apache-2.0
"""Generate the configuration and metrics references of the docs from the code.

Every ``kv_connector_extra_config`` key comes from the connectors' config classes
(``ConfigSection.describe()``: the same descriptions ``vllm-ascend-kv config`` and
``vllm-ascend-kv doctor`` use), every metric from the connectors' ``MetricSpec``
lists, so the reference cannot drift from the code. ``tools/mkdocs_hooks.py``
renders both into the site at build time; run this script to print them::

    python tools/gen_config_docs.py config     # Markdown of every configuration key
    python tools/gen_config_docs.py metrics    # Markdown of every Prometheus metric

Only the packages' ``src`` folders are needed (no vLLM, no torch): the config and
metrics modules import nothing heavy.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES_DIR = ROOT / "packages"

#: The entry-point group through which packages add configuration sections.
CONFIG_GROUP = "vllm_ascend_kv.config"
CORE_CLI = "vllm_ascend.distributed.kv_transfer.core.tooling.cli"
#: Sections that are not a connector's extra config but are documented beside them.
EXTRA_SECTIONS = {
    "Mooncake Store client (MOONCAKE_CONFIG_PATH file, or the pool's 'mooncake' key)":
        "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config:MooncakeStoreConfig",
}


@dataclass(frozen=True)
class MetricSource:
    """Where a connector family declares its metrics."""

    title: str
    dist: str
    ref: str  # "module:ATTRIBUTE"
    recorded_by: str


#: Every connector family's metric list. A module declaring ``MetricSpec`` entries
#: that is not listed here fails the docs build (see :func:`check_metric_sources`).
METRIC_SOURCES = (
    MetricSource("P/D: MooncakeConnectorV1 and MooncakeLayerwiseConnector", "ascend-kv-p2p",
                 "vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics:P2P_METRICS",
                 "Pull (MooncakeConnectorV1): D records transfers, loads, failures and "
                 "deadlines; P records served requests, held requests and expired leases. "
                 "Layerwise: P records layer pushes and transfer bytes, D records loads, "
                 "virtual requests, failures and deadlines."),
    MetricSource("KV pool: AscendStoreConnector", "ascend-kv-pool",
                 "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.metrics:POOL_METRICS",
                 "The scheduler records lookups (tokens asked, hit, missed; latency); the "
                 "workers record loads and saves."),
    MetricSource("CPU offload: CPUOffloadingConnector", "ascend-cpu-offload",
                 "vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.metrics:OFFLOAD_METRICS",
                 "The scheduler records hits, misses, lookup latency, evictions, expired save "
                 "leases and the host pool gauges; the workers record copies."),
    MetricSource("Control plane: every connector", "ascend-kv-core",
                 "vllm_ascend.distributed.kv_transfer.core.auth:AUTH_METRICS",
                 "Frames refused by the deployment-key check (see the security page), by "
                 "socket and reason, in every process that serves or calls a control-plane "
                 "socket; reported with each connector's own metrics."),
)


def src_paths(root: Path = ROOT) -> list[Path]:
    """The ``src`` folder of every package (the namespace's portions)."""
    return sorted(p for p in (root / "packages").glob("*/src") if p.is_dir())


def use_sources(root: Path = ROOT) -> None:
    """Make every package importable from this checkout (namespace packages merge)."""
    for path in reversed(src_paths(root)):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))


def _load(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def config_sections(root: Path = ROOT) -> dict[str, str]:
    """Connector name -> ``module:Class`` of its config section, as ``vllm-ascend-kv config``
    sees them once every package is installed (core's own plus the packages' entry points,
    read from their ``pyproject.toml``)."""
    use_sources(root)
    sections: dict[str, str] = {}
    for pyproject in sorted((root / "packages").glob("*/pyproject.toml")):
        data = tomllib.loads(pyproject.read_text())
        eps = data.get("project", {}).get("entry-points", {}).get(CONFIG_GROUP, {})
        sections.update(eps)
    return sections


def _cell(text: str) -> str:
    """Plain text in a table cell (a pipe would end the cell)."""
    return text.replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    """Code in a table cell (pipes inside a code span do not end the cell)."""
    return f"`{text.replace('`', '')}`"


def render_section(title: str, cls: Any, *, anchor: str | None = None) -> list[str]:
    """One configuration section as a Markdown table."""
    doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
    head = f"## {title}" + (f" {{ #{anchor} }}" if anchor else "")
    lines = [head, "", f"{doc} Class: `{cls.__module__}.{cls.__qualname__}`.", "",
             "| key | type | default | meaning |", "|---|---|---|---|"]
    docs = list(cls.describe())
    if not docs:
        raise ValueError(f"{cls.__qualname__} describes no key")
    for d in docs:
        if not d.doc.strip():
            raise ValueError(f"{cls.__qualname__}: key {d.key!r} has no documentation")
        meaning = d.doc.strip()
        if d.aliases:
            meaning += " Also accepted as " + ", ".join(f"`{a}`" for a in d.aliases) + "."
        if d.deprecated_aliases:
            meaning += (" Deprecated spelling: " + ", ".join(f"`{a}`" for a in d.deprecated_aliases)
                        + " (logs a warning).")
        lines.append(f"| `{d.key}` | {_code(d.type)} | {_code(d.default)} | {_cell(meaning)} |")
    lines.append("")
    return lines


def _anchor(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def render_config(root: Path = ROOT) -> str:
    """Markdown of every configuration section: connectors first, then the Store client."""
    sections = config_sections(root)
    lines: list[str] = []
    for name in sorted(sections):
        cls = _load(sections[name])
        lines += render_section(f"`{name}`", cls, anchor=_anchor(name))
    for title, ref in EXTRA_SECTIONS.items():
        lines += render_section(title, _load(ref), anchor="mooncake-store-client")
    return "\n".join(lines)


# ---------------------------------------------------------------------- metrics
def check_metric_sources(root: Path = ROOT, sources: Sequence[MetricSource] = METRIC_SOURCES
                         ) -> None:
    """Fail when a module declares ``MetricSpec`` entries the reference does not list.

    Raises:
        ValueError: naming the unlisted module.
    """
    listed = {s.ref.partition(":")[0] for s in sources}
    for src in src_paths(root):
        for path in src.rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if "MetricSpec(" not in text or path.name == "metrics.py" and "/core/" in \
                    path.as_posix():
                continue
            module = ".".join(path.relative_to(src).with_suffix("").parts)
            if module not in listed:
                raise ValueError(f"{path} declares MetricSpec entries that the metrics "
                                 f"reference does not list: add it to METRIC_SOURCES in "
                                 f"{Path(__file__).name}")


def _bucket(value: float) -> str:
    """A bucket bound: bytes for large ones (the byte buckets are powers of two), else seconds."""
    if value >= 1024:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value >= size:
                return f"{value / size:g} {unit}"
    return f"{value:g} s"


def prom_series(spec: Any) -> str:
    """The Prometheus series names of one metric as ``/metrics`` shows them."""
    if spec.kind == "counter":
        return f"`{spec.prom_name}_total`"
    if spec.kind == "histogram":
        return f"`{spec.prom_name}_bucket`, `_sum`, `_count`"
    return f"`{spec.prom_name}`"


def render_metrics(root: Path = ROOT, sources: Iterable[MetricSource] = METRIC_SOURCES) -> str:
    """Markdown tables of every connector's metrics."""
    use_sources(root)
    check_metric_sources(root, tuple(sources))
    lines: list[str] = []
    for source in sources:
        specs = list(_load(source.ref))
        lines += [f"## {source.title}", "",
                  f"Package `{source.dist}`; declared in `{source.ref.replace(':', '.')}`. "
                  f"{source.recorded_by}", "",
                  "| series | type | labels | meaning |", "|---|---|---|---|"]
        for spec in specs:
            labels = ", ".join(f"`{lbl}`" for lbl in spec.labels) or "–"
            extra = ""
            if spec.kind == "histogram":
                extra = f" Buckets: {_bucket(spec.buckets[0])} … {_bucket(spec.buckets[-1])}."
            lines.append(f"| {prom_series(spec)} | {spec.kind} | {labels} | "
                         f"{_cell(spec.doc + extra)} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("config", "metrics"))
    args = parser.parse_args(argv)
    print(render_config() if args.what == "config" else render_metrics())
    return 0


if __name__ == "__main__":
    sys.exit(main())
