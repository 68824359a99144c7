# SPDX-License-Identifier: Apache-2.0
"""The bridge from :mod:`.metrics` to vLLM's KV connector stats and Prometheus.

Imports vLLM at module level: only connector modules (which need vLLM anyway)
import this one. A connector lists :class:`ConnectorStatsMixin` before
``KVConnectorBase_V1``, names its specs and keeps a recorder::

    class MyConnector(ConnectorStatsMixin, KVConnectorBase_V1):
        metric_specs = MY_METRICS

        def __init__(self, ...):
            ...
            self.recorder = MetricsRecorder(MY_METRICS)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from .auth import AUTH_METRICS
from .auth import RECORDER as AUTH_RECORDER
from .metrics import (
    MetricSpec,
    MetricsRecorder,
    empty_data,
    is_empty,
    merge_data,
    reduce_data,
    split_key,
)


@dataclass
class KVStats(KVConnectorStats):
    """vLLM ``KVConnectorStats`` holding a :meth:`MetricsRecorder.take` payload."""

    data: dict[str, Any] = field(default_factory=empty_data)

    @classmethod
    def from_recorder(cls, recorder: MetricsRecorder) -> KVStats | None:
        """The interval's data, or ``None`` when nothing was recorded."""
        data = recorder.take()
        return None if is_empty(data) else cls(data=data)

    def reset(self) -> None:
        self.data = empty_data()

    def aggregate(self, other: KVConnectorStats) -> KVStats:
        self.data = merge_data(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return reduce_data(self.data)

    def is_empty(self) -> bool:
        return is_empty(self.data)


class KVPromMetrics(KVConnectorPromMetrics):
    """Prometheus metrics (``vllm:ascend_kv_*``) built from :class:`MetricSpec` entries."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], *,
                 specs: Iterable[MetricSpec]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._labelnames = list(labelnames)
        self._metrics: dict[str, tuple[MetricSpec, Any]] = {}
        for spec in specs:
            cls = {"counter": self._counter_cls, "gauge": self._gauge_cls,
                   "histogram": self._histogram_cls}[spec.kind]
            kwargs: dict[str, Any] = {"name": spec.prom_name, "documentation": spec.doc,
                                      "labelnames": [*labelnames, *spec.labels]}
            if spec.kind == "histogram":
                kwargs["buckets"] = list(spec.buckets)
            self._metrics[spec.name] = (spec, cls(**kwargs))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = list(self.per_engine_labelvalues.get(engine_idx, []))
        for section in ("counters", "gauges", "histograms"):
            for key, value in transfer_stats_data.get(section, {}).items():
                name, labels = split_key(key)
                entry = self._metrics.get(name)
                if entry is None:
                    continue
                spec, metric = entry
                child = metric.labels(*base, *[labels.get(lbl, "") for lbl in spec.labels])
                if spec.kind == "counter":
                    if value > 0:
                        child.inc(value)
                elif spec.kind == "gauge":
                    child.set(value)
                else:
                    for v in value:
                        child.observe(v)


class ConnectorStatsMixin:
    """vLLM's stats hooks of a connector, from ``metric_specs`` and ``self.recorder``.

    ``get_kv_connector_stats`` hands vLLM the interval's data (worker side);
    ``build_kv_connector_stats`` and ``build_prom_metrics`` rebuild them on vLLM's
    logging side, where the Prometheus metrics are ``vllm:ascend_kv_<name>``.
    """

    metric_specs: ClassVar[Sequence[MetricSpec]] = ()
    recorder: MetricsRecorder

    def stats_recorder(self) -> MetricsRecorder | None:
        """The recorder whose interval data goes to vLLM (override to pick one per role)."""
        return getattr(self, "recorder", None)

    def get_kv_connector_stats(self) -> KVStats | None:
        recorder = self.stats_recorder()
        if recorder is None:
            return None
        # the process's refused control-plane frames (core.auth) ride along
        data = merge_data(recorder.take(), AUTH_RECORDER.take())
        return None if is_empty(data) else KVStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStats:
        return KVStats(data=data) if data is not None else KVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVPromMetrics:
        return KVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                             specs=(*cls.metric_specs, *AUTH_METRICS))
