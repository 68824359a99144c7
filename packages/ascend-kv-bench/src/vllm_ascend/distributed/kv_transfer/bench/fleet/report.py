# SPDX-License-Identifier: Apache-2.0
"""Markdown tables of ``bench fleet`` results (``fleet.json`` files), for the docs.

``python -m vllm_ascend.distributed.kv_transfer.bench.fleet.report FILE...`` prints one table
of every run (router-added latency, hit rate against the offline best, modelled TTFT,
achieved rate, failures) and one of the churn runs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def runs_table(runs: Sequence[dict[str, Any]]) -> str:
    """Every run without churn, a row each."""
    head = ("| N | trace | router | policy | rate/s | done/s | failed | router p50 ms | "
            "router p99 ms | router CPU ms/req | hit rate | best | hit/best | TTFT p50 ms | "
            "TTFT p99 ms |")
    rows = [head, "|" + "---|" * 15]
    for r in runs:
        if r.get("churn"):
            continue
        if r.get("status") != "ok":
            rows.append(f"| {r['instances']} | {r['trace']} | {r['router']} | {r['policy']} | "
                        f"{_f(r['rate'])} | failed to start: {r.get('reason', '')[-80:]} |")
            continue
        rows.append(" | ".join([
            f"| {r['instances']}", r["trace"], r["router"], r["policy"], _f(r["rate"]),
            _f(r["achieved_rps"]), str(r["failed"]), _f(r["router_p50_ms"]),
            _f(r["router_p99_ms"]), _f(r.get("router_cpu_ms_per_request")),
            _f(r["hit_rate"]), _f(r["best_hit_rate"]),
            _f(r["hit_vs_best"]), _f(r["ttft_model_p50_ms"]),
            _f(r["ttft_model_p99_ms"])]) + " |")
    return "\n".join(rows)


def churn_table(runs: Sequence[dict[str, Any]]) -> str:
    """The churn runs: failures, take-in and stop-routing times, the routers' answers."""
    head = ("| N | router | policy | rate/s | requests | failed | router p99 ms | "
            "new P's first request after add (s) | dead P's last attempt after death (s) | "
            "attempts on the dead P | add answered |")
    rows = [head, "|" + "---|" * 11]
    for r in runs:
        if not r.get("churn") or r.get("status") != "ok":
            continue
        cf = r.get("churn_figures") or {}
        kills = [e for e in cf.get("events", []) if e["what"] == "kill"]
        adds = [e for e in cf.get("events", []) if e["what"] == "add"]
        rows.append(" | ".join([
            f"| {r['instances']}", r["router"], r["policy"], _f(r["rate"]), str(r["requests"]),
            str(r["failed"]), _f(r["router_p99_ms"]),
            ", ".join(_f(x) for x in cf.get("take_in_s", [])),
            ", ".join(_f(x) for x in cf.get("stop_routing_s", [])),
            ", ".join(str(e.get("attempts_after_death")) for e in kills),
            "; ".join("ok" if e["router_ok"] else str(e["router_answer"])[:60]
                      for e in adds[:1])]) + " |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    runs: list[dict[str, Any]] = []
    for name in (sys.argv[1:] if argv is None else argv):
        runs += json.loads(Path(name).read_text())["runs"]
    print(runs_table(runs))
    print()
    print(churn_table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
