# SPDX-License-Identifier: Apache-2.0
"""Counters, gauges and histograms that connectors feed.

A connector declares its metrics as :class:`MetricSpec` entries and records
into a :class:`MetricsRecorder` from any thread. Once per engine step vLLM
asks the worker-side connector for ``get_kv_connector_stats()``; the
connector returns ``recorder.take()`` wrapped in :class:`KVStats` (see
:mod:`.vllm_metrics`), vLLM aggregates it across workers, logs it, and feeds
the Prometheus metrics built from the same specs (``vllm:ascend_kv_*``).
This module has no vLLM dependency, so the recorder is usable in tools and
tests.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["counter", "gauge", "histogram"]

#: Default histogram buckets for durations in seconds.
TIME_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0, 60.0)
#: Default histogram buckets for sizes in bytes.
BYTE_BUCKETS = tuple(float(1 << s) for s in range(10, 34, 2))

PROM_PREFIX = "vllm:ascend_kv_"


@dataclass(frozen=True)
class MetricSpec:
    """One metric a connector reports.

    Attributes:
        name: short name, e.g. ``transfer_bytes``; Prometheus name is
            ``vllm:ascend_kv_<name>`` (counters get ``_total`` from the client library).
        kind: ``counter``, ``gauge`` or ``histogram``.
        doc: help text.
        labels: label names (e.g. ``("cause",)`` for failures).
        buckets: histogram buckets.
    """

    name: str
    kind: Kind
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = TIME_BUCKETS

    @property
    def prom_name(self) -> str:
        """Full Prometheus name."""
        return PROM_PREFIX + self.name


def _key(name: str, labels: Mapping[str, str] | None) -> str:
    if not labels:
        return name
    return name + "|" + ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def split_key(key: str) -> tuple[str, dict[str, str]]:
    """Inverse of the internal key format: ``"failures|cause=timeout"`` -> name, labels."""
    name, _, rest = key.partition("|")
    labels = dict(part.split("=", 1) for part in rest.split(",")) if rest else {}
    return name, labels


class MetricsRecorder:
    """Thread-safe accumulation of observations between two :meth:`take` calls.

    Counters also keep a running total (:meth:`total`) for tests and ``/stats``
    style endpoints; :meth:`take` returns and clears only the interval data.
    """

    def __init__(self, specs: Iterable[MetricSpec] = ()) -> None:
        self.specs: dict[str, MetricSpec] = {s.name: s for s in specs}
        self._lock = threading.Lock()
        self._counters: dict[str, float] = defaultdict(float)
        self._totals: dict[str, float] = defaultdict(float)
        self._gauges: dict[str, float] = {}
        self._hists: dict[str, list[float]] = defaultdict(list)

    def _check(self, name: str, kind: Kind) -> None:
        spec = self.specs.get(name)
        if self.specs and (spec is None or spec.kind != kind):
            raise KeyError(f"metric {name!r} is not a declared {kind}")

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        """Add ``value`` to a counter (negative values are refused)."""
        if value < 0:
            raise ValueError(f"counter {name} cannot decrease (got {value})")
        self._check(name, "counter")
        key = _key(name, labels)
        with self._lock:
            self._counters[key] += value
            self._totals[key] += value

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set a gauge."""
        self._check(name, "gauge")
        with self._lock:
            self._gauges[_key(name, labels)] = value

    def observe(self, name: str, value: float, **labels: str) -> None:
        """Record one histogram observation."""
        self._check(name, "histogram")
        with self._lock:
            self._hists[_key(name, labels)].append(float(value))

    def total(self, name: str, **labels: str) -> float:
        """Running total of a counter since creation."""
        with self._lock:
            return self._totals.get(_key(name, labels), 0.0)

    def totals(self) -> dict[str, float]:
        """Running totals of every counter series (keys as in :meth:`take`)."""
        with self._lock:
            return dict(self._totals)

    def gauge(self, name: str, **labels: str) -> float | None:
        """Current value of a gauge."""
        with self._lock:
            return self._gauges.get(_key(name, labels))

    def take(self) -> dict[str, Any]:
        """Return and clear the interval's data (gauges are kept, not cleared)."""
        with self._lock:
            data = {
                "counters": dict(self._counters),
                "gauges": dict(self._gauges),
                "histograms": {k: list(v) for k, v in self._hists.items()},
            }
            self._counters.clear()
            self._hists.clear()
        return data


def empty_data() -> dict[str, Any]:
    """The shape of an empty :meth:`MetricsRecorder.take` result."""
    return {"counters": {}, "gauges": {}, "histograms": {}}


def merge_data(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Aggregate two ``take()`` results: counters add, histograms concatenate, gauges add.

    Gauges add because the inputs come from different workers (e.g. blocks
    held per rank sum to blocks held by the instance).
    """
    out = empty_data()
    for src in (a, b):
        for k, v in src.get("counters", {}).items():
            out["counters"][k] = out["counters"].get(k, 0.0) + v
        for k, v in src.get("gauges", {}).items():
            out["gauges"][k] = out["gauges"].get(k, 0.0) + v
        for k, v in src.get("histograms", {}).items():
            out["histograms"].setdefault(k, []).extend(v)
    return out


def reduce_data(data: Mapping[str, Any]) -> dict[str, float]:
    """One number per series for a log line: totals, gauge values, histogram count/avg/p95."""
    out: dict[str, float] = {}
    for k, v in sorted(data.get("counters", {}).items()):
        out[k] = v
    for k, v in sorted(data.get("gauges", {}).items()):
        out[k] = v
    for k, values in sorted(data.get("histograms", {}).items()):
        if not values:
            continue
        ordered = sorted(values)
        out[f"{k}.count"] = len(values)
        out[f"{k}.avg"] = round(sum(values) / len(values), 6)
        out[f"{k}.p95"] = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return out


def is_empty(data: Mapping[str, Any]) -> bool:
    """True when nothing was recorded in the interval."""
    return not (data.get("counters") or data.get("histograms") or data.get("gauges"))
