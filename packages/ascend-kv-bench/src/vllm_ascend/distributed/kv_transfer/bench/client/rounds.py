# SPDX-License-Identifier: Apache-2.0
"""``bench client --rounds N``: our P/D pull pair against vLLM's own, alternating.

Our pair, vLLM's own ``MooncakeConnector`` pair and vLLM's ``NixlConnector`` pair (those of
the two that can run here: :func:`~.deploy.peer_missing`) under vLLM's client, in
alternating rounds.

Every pair stays up for the whole comparison (the P's on core 0, the D's on core 1), the
pairs not measured paused (SIGSTOP: vLLM's NixlConnector engine spins while idle, which
took the cores from the pair measured); a pair continued gets :data:`SETTLE_S` and one
short request before its run. Each round runs vLLM's client against one pair after the
other (who goes first rotates every round), at each concurrency, with the same prompts for
all (one dataset seed per round and concurrency, new to every pair). Per peer, concurrency
and metric (TTFT mean and p50, TPOT p50, output tokens/s): ours / theirs as the ratio of
the medians over the rounds, the per-round min-max and the paired bootstrap interval
(:func:`~vllm_ascend.distributed.kv_transfer.bench.stats.compare`). A run with
a failed request is left out of the ratios and counted.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ..benchutil import Steps
from ..ledger import series
from ..stats import compare, spread
from .deploy import one_run, peer_missing, start_target, targets
from .procs import warm_up

logger = logging.getLogger(__name__)

#: the P/D pairs of the rounds: ours, then the peers
ROUND_TARGETS = ("pd-pull", "pd-vllm-mooncake", "pd-vllm-nixl")
#: (metric of a run, True when higher is better)
METRICS = (("ttft_mean_ms", False), ("ttft_p50_ms", False), ("tpot_p50_ms", False),
           ("output_tok_per_s", True))
#: the first dataset seed of the rounds (the single runs use 100 + i)
SEED0 = 1000
#: seconds a continued pair gets (its proxy's health round, every second) before its
#: short request and its run
SETTLE_S = 2.0
#: prompt tokens of that request (random ids: no run's prompt shares its blocks)
SETTLE_TOKENS = 32


def settle(dep: Any, cfg: Any, seed: int) -> None:
    """Continue a paused pair and let it settle: :data:`SETTLE_S`, then one short request
    through its proxy (answered: every server of the pair runs again)."""
    dep.resume()
    time.sleep(SETTLE_S)
    warm_up(dep.url, cfg.model, cfg.vocab, SETTLE_TOKENS, seed=seed)


def round_order(names: tuple[str, ...], r: int) -> tuple[str, ...]:
    """Who runs in which turn in round ``r``: the names rotated by ``r`` (two of them: ours
    first in even rounds, the peer in odd ones)."""
    k = r % len(names)
    return (*names[k:], *names[:k])


def summarize_rounds(runs: dict[str, dict[int, list[dict[str, Any]]]],
                     concurrency: tuple[int, ...]) -> list[dict[str, Any]]:
    """Ours / each peer per concurrency and metric, from each round's run of each
    (``runs[target][concurrency]``, one row a round, in round order; ours is the first)."""
    ours, *peers = list(runs)
    out = []
    for peer_name in peers:
        for conc in concurrency:
            a_rows, b_rows = runs[ours][conc], runs[peer_name][conc]
            for metric, higher in METRICS:
                a = [None if r.get("failed") else r.get(metric) for r in a_rows]
                b = [None if r.get("failed") else r.get(metric) for r in b_rows]
                stats = compare(a, b)
                out.append({"peer_target": peer_name, "concurrency": conc, "metric": metric,
                            "higher_is_better": higher, **stats.as_dict(),
                            "ours": spread(a), "peer": spread(b)})
    return out


def run_rounds(cfg: Any, steps: Steps, work: Path, rounds: int) -> dict[str, Any]:
    """The alternating rounds (``cfg``: the run's ``ClientConfig``); their entry of the
    results."""
    chosen = {t.name: t for t in targets() if t.name in ROUND_TARGETS}
    missing = {n: why for n in ROUND_TARGETS[1:] if (why := peer_missing(chosen[n], cfg))}
    names = tuple(n for n in ROUND_TARGETS if n not in missing)
    entry: dict[str, Any] = {"pair": list(names), "rounds": rounds,
                             "concurrency": list(cfg.concurrency), "not_run": missing,
                             "idle_pairs": "paused", "settle_s": SETTLE_S,
                             "settle_tokens": SETTLE_TOKENS}
    for n, why in missing.items():
        steps.note(f"rounds: {n}: {why}")
    if len(names) < 2:
        reason = "; ".join(missing.values())
        return {**entry, "status": "not run", "reason": reason}
    logs = cfg.out / "client-logs"
    logs.mkdir(parents=True, exist_ok=True)
    deps: dict[str, Any] = {}
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {
        n: {c: [] for c in cfg.concurrency} for n in names}
    try:
        for name in names:
            deps[name] = start_target(chosen[name], cfg, logs)
            warm_up(deps[name].url, cfg.model, cfg.vocab, cfg.input_len, seed=7)
            deps[name].pause()
        steps.note(f"rounds: {' and '.join(names)} up")
        for r in range(rounds):
            for ci, conc in enumerate(cfg.concurrency):
                for name in round_order(names, r):
                    settle(deps[name], cfg, seed=SEED0 + 100 * r + ci + 50)
                    try:
                        row = one_run(deps[name], cfg, conc, seed=SEED0 + 100 * r + ci,
                                      extra=(), work=work / "rounds" / name, tag=f"-r{r}")
                    finally:
                        deps[name].pause()
                    runs[name][conc].append({"round": r, **row})
            steps.note(f"rounds: round {r + 1} of {rounds}: " + "; ".join(
                f"{n} c{c} TTFT p50 {runs[n][c][-1].get('ttft_p50_ms') or 0:.0f} ms, "
                f"{runs[n][c][-1].get('failed')} failed"
                for c in cfg.concurrency for n in names))
    except Exception as exc:  # recorded, not fatal, as the single runs are
        logger.exception("client rounds failed")
        return {**entry, "status": "failed", "reason": str(exc)[-2000:], "runs": runs}
    finally:
        for dep in deps.values():
            for s in reversed(dep.servers):
                s.stop()
    failed = {n: sum(int(row.get("failed") or 0) for c in runs[n] for row in runs[n][c])
              for n in names}
    return {**entry, "status": "ok" if not any(failed.values()) else "failed requests",
            "failed": failed, "runs": runs,
            "comparisons": summarize_rounds(runs, tuple(cfg.concurrency))}


def ledger_series(results: dict[str, Any], rounds: dict[str, Any] | None
                  ) -> list[dict[str, Any]]:
    """Every successful request's TTFT and TPOT (seconds) for the ledger, taken out of the
    runs' rows (``request_samples``): the single run of each target and concurrency
    (``part`` single, one round), and each alternating round of the pair (``part`` rounds,
    a run a round in round order; a run without samples an empty round, so the pair stays
    paired)."""
    def take(row: dict[str, Any]) -> dict[str, list[float]]:
        return dict(row.pop("request_samples", None) or {})

    out = []
    for name, entry in results.items():
        for row in entry.get("runs") or []:
            got = take(row)
            for what in ("ttft_s", "tpot_s"):
                out.append(series({"part": "single", "target": name,
                                   "dataset": row.get("dataset"),
                                   "concurrency": row.get("concurrency"), "what": what},
                                  [got.get(what) or []]))
    for name, by_conc in ((rounds or {}).get("runs") or {}).items():
        for conc, rows in by_conc.items():
            got_rows = [take(r) for r in rows]
            for what in ("ttft_s", "tpot_s"):
                out.append(series({"part": "rounds", "target": name,
                                   "concurrency": int(conc), "what": what},
                                  [g.get(what) or [] for g in got_rows]))
    return out
