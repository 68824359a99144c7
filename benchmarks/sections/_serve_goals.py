# SPDX-License-Identifier: Apache-2.0
"""The goal rows of ``bench serve``, judged on the raw samples of its ledger entry.

A ``bench serve`` entry holds, for every scenario measured in rounds (its report name, with
the thread binding: ``pd/ours[pinned]``), each prompt length's times of each round
(``compare.ledger_series`` of ascend-kv-bench: D's TTFT and floor, a hit's TTFT and the
engine's device-cache hit, the cold TTFT, the recompute of the engine without a connector in
the same round, the serving throughput and the same round's without a connector). From them,
as ``bench serve`` computes its comparisons: per round, the median over the prompt lengths of
a scenario's TTFT / recompute (``norm``, ``hit_norm``), of the save overhead (cold -
recompute); per length, the overheads over the floor. Against a peer each side is taken at
its best binding (the lowest median D TTFT / recompute), among the variants whose D loaded
(vLLM's external-token count, else D's TTFT below 0.8 of the recompute).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._common import (
    Measured,
    judged_difference,
    judged_noninferior,
    judged_ratio,
    worst,
)

NAN = float("nan")
#: D's TTFT at or above this share of the recompute reads as a fallback to recompute.
FALLBACK_SHARE = 0.8
Series = dict[tuple[str, Any, str], list[float]]


def series_of(entry: Mapping[str, Any]) -> Series:
    """``(scenario, tokens, what)`` -> one value a round (NaN where the round has none)."""
    out: Series = {}
    for s in entry.get("samples") or []:
        t = s.get("tags") or {}
        if "scenario" in t and "what" in t:
            out[(str(t["scenario"]), t.get("tokens"), str(t["what"]))] = [
                statistics.median(r) if r else NAN for r in s.get("rounds") or []]
    return out


def variants(ser: Series, base: str) -> list[str]:
    """The report names of scenario ``base`` (one a binding)."""
    return sorted({k[0] for k in ser if k[0].split("[", 1)[0] == base})


def lengths(ser: Series, name: str) -> list[int]:
    return sorted({int(k[1]) for k in ser if k[0] == name and k[1] is not None})


def per_length(ser: Series, name: str, n: int | None, fn: Callable[..., float], *whats: str
               ) -> list[float]:
    """``fn`` of the times ``whats`` at length ``n`` (None: of the scenario, not of a
    length), round by round (NaN where missing)."""
    cols = [ser.get((name, n, w), []) for w in whats]
    rounds = max((len(c) for c in cols), default=0)
    out = []
    for i in range(rounds):
        xs = [c[i] if i < len(c) else NAN for c in cols]
        out.append(NAN if any(x != x for x in xs) else fn(*xs))
    return out


def per_round(ser: Series, name: str, fn: Callable[..., float], *whats: str) -> list[float]:
    """The median over the prompt lengths of ``fn`` of ``whats``, round by round."""
    cols = [per_length(ser, name, n, fn, *whats) for n in lengths(ser, name)]
    rounds = max((len(c) for c in cols), default=0)
    out = []
    for i in range(rounds):
        xs = [c[i] for c in cols if i < len(c) and c[i] == c[i]]
        out.append(statistics.median(xs) if xs else NAN)
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else NAN


def _minus(a: float, b: float) -> float:
    return a - b


def d_norm(ser: Series, name: str) -> list[float]:
    return per_round(ser, name, _ratio, "d_ttft_s", "recompute_s")


def hit_norm(ser: Series, name: str) -> list[float]:
    return per_round(ser, name, _ratio, "again_s", "recompute_s")


def thr_norm(ser: Series, name: str) -> list[float]:
    return per_length(ser, name, None, _ratio, "output_tok_per_s",
                      "reference_output_tok_per_s")


def _finite(xs: Sequence[float]) -> list[float]:
    return [x for x in xs if x == x]


def loaded(ser: Series, name: str) -> bool:
    """Whether D loaded P's KV in every round (vLLM's count), else by D's TTFT."""
    ext = _finite([x for n in lengths(ser, name) for x in ser.get((name, n, "d_external"), [])])
    if ext:
        return min(ext) > 0
    norms = _finite(d_norm(ser, name))
    return bool(norms) and statistics.median(norms) < FALLBACK_SHARE


def best(ser: Series, base: str) -> str | None:
    """The variant of a P/D scenario at its best binding: the lowest median D TTFT /
    recompute among those whose D loaded."""
    scored = [(statistics.median(v), name) for name in variants(ser, base)
              if loaded(ser, name) and (v := _finite(d_norm(ser, name)))]
    return min(scored)[1] if scored else None


# ---------------------------------------------------------------------- the goals
def kv_throughput(peer: str) -> Callable[[Mapping[str, Any]], Measured | None]:
    """Ours / the peer in KV throughput (the inverse of D's TTFT / recompute), each at its
    best binding: at least 1.2."""
    def measure(entry: Mapping[str, Any]) -> Measured | None:
        ser = series_of(entry)
        ov, pv = best(ser, "pd/ours"), best(ser, peer)
        if ov is None or pv is None:
            return None
        return judged_ratio(d_norm(ser, pv), d_norm(ser, ov), at_least=1.2,
                            where=f"{ov} against {pv}")
    return measure


def d_overhead(ours: str, peer: str) -> Callable[[Mapping[str, Any]], Measured | None]:
    """D's TTFT minus its floor, ours / the peer's, at every prompt length (each at its best
    binding): at most 0.8; the length whose interval lies highest decides."""
    def measure(entry: Mapping[str, Any]) -> Measured | None:
        ser = series_of(entry)
        ov, pv = best(ser, ours), best(ser, peer)
        if ov is None or pv is None:
            return None
        return worst([judged_ratio(per_length(ser, ov, n, _minus, "d_ttft_s", "d_floor_s"),
                                   per_length(ser, pv, n, _minus, "d_ttft_s", "d_floor_s"),
                                   at_most=0.8, where=f"{n} tokens, {ov} against {pv}")
                      for n in lengths(ser, ov) if n in lengths(ser, pv)], at_least=False)
    return measure


POOL, STORE = ("pool/ours-mooncake", "pool/ours-local"), "pool/vllm-mooncake-store"


def pool_hit_vs_recompute(entry: Mapping[str, Any]) -> Measured | None:
    """Each backend's hit TTFT / recompute: at most 0.5."""
    ser = series_of(entry)
    return worst([judged_ratio(h, [1.0] * len(h), at_most=0.5, where=name)
                  for name in POOL if (h := hit_norm(ser, name))], at_least=False)


def pool_hit_vs_store(entry: Mapping[str, Any]) -> Measured | None:
    """The Mooncake backend's hit TTFT / recompute over MooncakeStoreConnector's: <= 0.8."""
    ser = series_of(entry)
    ours, peer = hit_norm(ser, POOL[0]), hit_norm(ser, STORE)
    return judged_ratio(ours, peer, at_most=0.8) if ours and peer else None


def pool_overhead_vs_store(entry: Mapping[str, Any]) -> Measured | None:
    """A hit's TTFT minus the device-cache hit, ours / MooncakeStoreConnector's, at every
    length: at most 0.8."""
    ser = series_of(entry)
    return worst([judged_ratio(per_length(ser, POOL[0], n, _minus, "again_s", "device_hit_s"),
                               per_length(ser, STORE, n, _minus, "again_s", "device_hit_s"),
                               at_most=0.8, where=f"{n} tokens")
                  for n in lengths(ser, POOL[0]) if n in lengths(ser, STORE)], at_least=False)


def pool_save_vs_store(entry: Mapping[str, Any]) -> Measured | None:
    """The save overhead (cold TTFT - recompute, median over the lengths), ours minus
    MooncakeStoreConnector's in ms: at most 2 at the interval's upper end."""
    ser = series_of(entry)
    ours, peer = (per_round(ser, n, _minus, "cold_s", "recompute_s") for n in (POOL[0], STORE))
    if not ours or not peer:
        return None
    return judged_difference(ours, peer, at_most=2.0, scale=1e3, unit=" ms")


def pool_throughput_vs_store(entry: Mapping[str, Any]) -> Measured | None:
    """Serving throughput with saves / no connector, ours over MooncakeStoreConnector's:
    non-inferiority (0.97, low end 0.95)."""
    ser = series_of(entry)
    ours, peer = thr_norm(ser, POOL[0]), thr_norm(ser, STORE)
    return judged_noninferior(ours, peer) if ours and peer else None


def pool_throughput_vs_none(entry: Mapping[str, Any]) -> Measured | None:
    """Each backend's serving throughput with saves / the engine without a connector in the
    same round: at least 1.0."""
    ser = series_of(entry)
    return worst([judged_ratio(t, [1.0] * len(t), at_least=1.0, where=name)
                  for name in POOL if (t := thr_norm(ser, name))], at_least=True)


def offload_hit(entry: Mapping[str, Any]) -> Measured | None:
    """The offload connector's hit TTFT / recompute: at most 0.1."""
    h = hit_norm(series_of(entry), "offload/ours")
    return judged_ratio(h, [1.0] * len(h), at_most=0.1, where="offload/ours") if h else None
