# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import threading

import pytest

from ascend_kv_testing.requires import require
from vllm_ascend.distributed.kv_transfer.core.metrics import (
    MetricSpec,
    MetricsRecorder,
    merge_data,
    reduce_data,
)

SPECS = [
    MetricSpec("transfer_bytes", "counter", "bytes moved"),
    MetricSpec("failures", "counter", "failures", labels=("cause",)),
    MetricSpec("transfer_seconds", "histogram", "time"),
    MetricSpec("held_blocks", "gauge", "blocks held"),
]


def test_recorder_take_and_totals_from_threads() -> None:
    rec = MetricsRecorder(SPECS)

    def work() -> None:
        for _ in range(1000):
            rec.inc("transfer_bytes", 2)
            rec.observe("transfer_seconds", 0.01)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rec.inc("failures", cause="timeout")
    rec.set("held_blocks", 7)
    data = rec.take()
    assert data["counters"]["transfer_bytes"] == 8000
    assert data["counters"]["failures|cause=timeout"] == 1
    assert len(data["histograms"]["transfer_seconds"]) == 4000
    assert rec.take()["counters"] == {} and rec.total("transfer_bytes") == 8000
    assert rec.gauge("held_blocks") == 7
    with pytest.raises(KeyError):
        rec.inc("undeclared")
    with pytest.raises(ValueError):
        rec.inc("transfer_bytes", -1)


def test_merge_and_reduce() -> None:
    a = {"counters": {"x": 1.0}, "gauges": {"g": 2.0}, "histograms": {"h": [1.0, 3.0]}}
    b = {"counters": {"x": 2.0, "y": 1.0}, "gauges": {"g": 1.0}, "histograms": {"h": [2.0]}}
    m = merge_data(a, b)
    assert m == {"counters": {"x": 3.0, "y": 1.0}, "gauges": {"g": 3.0},
                 "histograms": {"h": [1.0, 3.0, 2.0]}}
    r = reduce_data(m)
    assert r["x"] == 3.0 and r["h.count"] == 3 and r["h.avg"] == 2.0 and r["h.p95"] == 3.0


def test_vllm_stats_and_prometheus() -> None:
    require("vllm", why="KVStats subclasses vLLM's KVConnectorStats")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from vllm_ascend.distributed.kv_transfer.core.vllm_metrics import KVPromMetrics, KVStats

    rec = MetricsRecorder(SPECS)
    assert KVStats.from_recorder(rec) is None
    rec.inc("transfer_bytes", 100)
    rec.inc("failures", cause="timeout")
    rec.observe("transfer_seconds", 0.2)
    rec.set("held_blocks", 3)
    stats = KVStats.from_recorder(rec)
    assert stats is not None and not stats.is_empty()
    other = KVStats(data={"counters": {"transfer_bytes": 50.0}, "gauges": {}, "histograms": {}})
    stats.aggregate(other)
    assert stats.reduce()["transfer_bytes"] == 150.0

    registry = CollectorRegistry()

    def bind(cls: type) -> type:
        class Bound(cls):  # type: ignore[valid-type,misc]
            def __init__(self, *a: object, **kw: object) -> None:
                super().__init__(*a, registry=registry, **kw)
        return Bound

    types = {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}
    cfg = type("VC", (), {"kv_transfer_config": None})()
    prom = KVPromMetrics(cfg, types, ["model_name", "engine"], {0: ["m", "0"]}, specs=SPECS)
    prom.observe(stats.data, engine_idx=0)
    text = generate_latest(registry).decode()
    assert 'vllm:ascend_kv_transfer_bytes_total{engine="0",model_name="m"} 150.0' in text
    assert 'vllm:ascend_kv_failures_total{cause="timeout",engine="0",model_name="m"} 1.0' in text
    assert 'vllm:ascend_kv_held_blocks{engine="0",model_name="m"} 3.0' in text
    assert "vllm:ascend_kv_transfer_seconds_count" in text
