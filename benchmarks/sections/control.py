# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench control``: the P/D connectors' scheduler halves at fleet size, ours
(``MooncakeConnectorV1``) against vLLM's ``NixlConnector`` at the same requests in flight,
and P's lease holder (no engine; ``bench/control.py`` says what a step calls).

Every figure is read from the run's raw samples: per role, connector and requests in
flight, each round's per-step times (µs); per held count, each round's holder rates. A
figure over rounds is the median of the rounds' medians with a 95% bootstrap interval over
the rounds; ours / the peer pairs the rounds (they alternate).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ._common import (
    GoalSpec,
    Images,
    Measured,
    Section,
    fmt,
    judged_ratio,
    md_table,
    median_cell,
    medians_by_round,
    num,
    ratio_cell,
    worst,
)

logger = logging.getLogger(__name__)

#: Issue 53's goals: per-step scheduler cost at most NixlConnector's at every count, and
#: nothing O(all held) per step: from the fewest to the most requests in flight (16 times
#: as many), a step may cost at most GROWTH_MAX times as much (linear would be 16).
GROWTH_MAX = 2.0
HOLDER_METRICS = ("claims_per_s", "dones_per_s", "sweeps_per_s", "idle_sweeps_per_s",
                  "holds_per_s")
StepKey = tuple[str, int, str]  # role, in flight, connector
#: The hooks a step calls, as ``bench control`` reports them.
HOOKS = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
         "build_connector_meta", "update_connector_output", "request_finished")


def steps(entry: Mapping[str, Any]) -> dict[StepKey, list[float]]:
    """Each (role, in flight, connector)'s per-round median step time (µs)."""
    out: dict[StepKey, list[float]] = {}
    for s in entry.get("samples") or []:
        tags = s.get("tags") or {}
        if tags.get("metric") == "step":
            out[(str(tags.get("role")), int(tags.get("in_flight") or 0),
                 str(tags.get("connector")))] = medians_by_round(s)
    return out


def holder_rates(entry: Mapping[str, Any]) -> dict[tuple[int, str], list[float]]:
    """Each (held, metric)'s per-round rate of P's holder."""
    out: dict[tuple[int, str], list[float]] = {}
    for s in entry.get("samples") or []:
        tags = s.get("tags") or {}
        if tags.get("metric") in HOLDER_METRICS:
            out[(int(tags.get("held") or 0), str(tags["metric"]))] = medians_by_round(s)
    return out


def hook_times(entry: Mapping[str, Any]) -> dict[tuple[str, int, str, str], list[float]]:
    """Each (role, in flight, connector, hook)'s per-round mean µs a step (runs that
    recorded it)."""
    out: dict[tuple[str, int, str, str], list[float]] = {}
    for s in entry.get("samples") or []:
        tags = s.get("tags") or {}
        if tags.get("metric") == "hook":
            out[(str(tags.get("role")), int(tags.get("in_flight") or 0),
                 str(tags.get("connector")), str(tags.get("hook")))] = medians_by_round(s)
    return out


def part_times(entry: Mapping[str, Any]) -> dict[tuple[str, str, str], list[float]]:
    """Each (side, part, key mode)'s per-round µs a call of one request's params (runs
    that recorded them), in the run's order."""
    out: dict[tuple[str, str, str], list[float]] = {}
    for s in entry.get("samples") or []:
        tags = s.get("tags") or {}
        if tags.get("metric") == "part":
            out[(str(tags.get("side")), str(tags.get("part")), str(tags.get("key")))] = (
                medians_by_round(s))
    return out


def _hook_tables(entry: Mapping[str, Any]) -> list[str]:
    """Per role, at the most requests in flight: each hook's µs a step, ours and the peer's,
    and, on P, each side's ``request_finished`` a request."""
    hooks = hook_times(entry)
    if not hooks:
        return []
    changed = num((entry.get("result") or {}).get("changed_per_step"))
    rows = []
    for role in sorted({k[0] for k in hooks}):
        n = max(k[1] for k in hooks if k[0] == role)
        for hook in HOOKS:
            ours, peer = hooks.get((role, n, "ours", hook)), hooks.get((role, n, "peer", hook))
            rows.append({"role": role, "n": n, "hook": f"`{hook}`",
                         "ours": median_cell(ours) if ours else "–",
                         "peer": median_cell(peer) if peer else "–"})
    out = ["\nWhere a step's time goes, at the most requests in flight: each hook's time "
           "a step (µs, the mean of a round's steps; median of the rounds [95% interval]):"
           "\n\n", md_table(rows, ["role", "n", "hook", "ours", "peer"],
                            ["role", "in flight", "hook", "ours µs", "peer µs"])]
    p_counts = sorted({k[1] for k in hooks if k[0] == "P"})
    if changed and p_counts:
        n = p_counts[-1]
        each = {side: hooks.get(("P", n, side, "request_finished")) for side in ("ours", "peer")}
        if all(each.values()):
            cells = {side: median_cell([v / changed for v in vals or []])
                     for side, vals in each.items()}
            out.append(f"\nP's `request_finished` a request (its time a step over the "
                       f"{fmt(int(changed))} requests that finish in it, {n} in flight): ours "
                       f"{cells['ours']} µs, the peer's {cells['peer']} µs.\n")
    return out


def _part_tables(entry: Mapping[str, Any]) -> list[str]:
    """One request's params, part by part, without a key and with one; each side's parts
    summed round by round."""
    parts = part_times(entry)
    if not parts:
        return []
    modes = list(dict.fromkeys(k[2] for k in parts))
    sides = list(dict.fromkeys(k[0] for k in parts))
    rows = []
    for side in sides:
        names = list(dict.fromkeys(k[1] for k in parts if k[0] == side))
        for name in names:
            rows.append({"part": f"{side}: {name}",
                         **{m: median_cell(parts[(side, name, m)])
                            if (side, name, m) in parts else "–" for m in modes}})
        total: dict[str, str] = {}
        for m in modes:
            series = [parts[(side, name, m)] for name in names if (side, name, m) in parts]
            if series and len({len(x) for x in series}) == 1:
                total[m] = median_cell([sum(r) for r in zip(*series, strict=True)])
        rows.append({"part": f"{side}: all of them (summed a round)", **total})
    return ["\nOne request's params, part by part (µs a call, the mean of a round's calls; "
            "median of the rounds [95% interval]), with the functions the schedulers call: "
            "on P, what `request_finished` adds for a request it holds for D; on D, what its "
            "scheduler checks of the params once a request:\n\n",
            md_table(rows, ["part", *modes], ["part", *modes])]


def section_control(d: dict[str, Any], images: Images) -> str:
    """Body of the section: what was driven, at which sizes."""
    del images
    conn = d.get("connectors") or {}
    return (f"Driven: {d.get('driven', '–')}, ours `{conn.get('ours', '–')}` against "
            f"`{conn.get('peer', '–')}`; {d.get('changed_per_step', '–')} requests change "
            f"per step, prompts of {d.get('prompt_tokens', '–')} tokens in blocks of "
            f"{d.get('block_size', '–')}; {d.get('rounds', '–')} alternating rounds of "
            f"{d.get('steps_per_round', '–')} steps at each count of requests in flight "
            f"({', '.join(str(c) for c in d.get('counts') or [])}).\n")


def section_samples(entry: Mapping[str, Any]) -> str:
    """The tables, from the raw samples: per-step time of each side, ours / the peer, the
    growth from the fewest to the most in flight, and P's holder."""
    st = steps(entry)
    rows = []
    for role, n in sorted({(k[0], k[1]) for k in st}, key=lambda k: (k[0], k[1])):
        ours, peer = st.get((role, n, "ours")), st.get((role, n, "peer"))
        rows.append({"role": role, "n": n,
                     "ours": median_cell(ours, 1e-3) if ours else "–",
                     "peer": median_cell(peer, 1e-3) if peer else "–",
                     "ratio": ratio_cell(ours, peer) if ours and peer else "–"})
    out = ["\nPer-step time of the connector's scheduler hooks (ms, median of the rounds "
           "[95% interval]):\n\n",
           md_table(rows, ["role", "n", "ours", "peer", "ratio"],
                    ["role", "in flight", "ours ms", "peer ms", "ours / peer"])]
    grow = []
    for role in sorted({k[0] for k in st}):
        counts = sorted({k[1] for k in st if k[0] == role})
        if len(counts) < 2:
            continue
        row: dict[str, Any] = {"role": role, "span": f"{counts[0]} → {counts[-1]}"}
        for side in ("ours", "peer"):
            hi, lo = st.get((role, counts[-1], side)), st.get((role, counts[0], side))
            row[side] = ratio_cell(hi, lo) if hi and lo else "–"
        grow.append(row)
    if grow:
        out += ["\nGrowth of a step's time with the requests in flight (time at the most / "
                "at the fewest, rounds paired; 1: flat, the count's ratio: linear):\n\n",
                md_table(grow, ["role", "span", "ours", "peer"],
                         ["role", "in flight", "ours", "peer"])]
    hold = holder_rates(entry)
    held = sorted({k[0] for k in hold})
    if held:
        hrows = [{"held": n, **{m: median_cell(hold[(n, m)], 1e-3) if (n, m) in hold else "–"
                                for m in HOLDER_METRICS}} for n in held]
        out += ["\nP's lease holder (`pull.holder.LeaseHolder`) through its side-channel "
                "handler, thousands per second (median of the rounds [95% interval]):\n\n",
                md_table(hrows, ["held", *HOLDER_METRICS],
                         ["held", "claims k/s", "Dones k/s", "sweeps k/s",
                          "idle sweeps k/s", "holds k/s"])]
    out += _hook_tables(entry)
    out += _part_tables(entry)
    return "".join(out)


def step_vs_nixl(entry: Mapping[str, Any]) -> Measured | None:
    """Ours / NixlConnector's per-step time, paired by round, at every role and count; the
    point whose interval lies highest decides."""
    st = steps(entry)
    found = [judged_ratio(st[(r, n, "ours")], st[(r, n, "peer")], at_most=1.0,
                          where=f"{r}, {n} in flight")
             for r, n, side in sorted(st) if side == "ours" and (r, n, "peer") in st]
    return worst(found, at_least=False)


def growth_bounded(entry: Mapping[str, Any]) -> Measured | None:
    """Our step time at the most requests in flight / at the fewest, per role (rounds
    paired by index); met when the interval's high end is at most :data:`GROWTH_MAX`."""
    st = steps(entry)
    found = []
    for role in sorted({k[0] for k in st}):
        counts = sorted({k[1] for k in st if k[0] == role and k[2] == "ours"})
        if len(counts) >= 2:
            found.append(judged_ratio(st[(role, counts[-1], "ours")],
                                      st[(role, counts[0], "ours")], at_most=GROWTH_MAX,
                                      where=f"{role}, {counts[0]} → {counts[-1]}"))
    return worst(found, at_least=False)


GOALS = (
    GoalSpec("control plane: per-step scheduler cost <= vLLM NixlConnector's at every role "
             "and count in flight (1k to 16k)", "control", "vLLM NixlConnector (scheduler half)",
             step_vs_nixl, rank=73,
             short="control step <= Nixl's (1k-16k in flight)"),
    GoalSpec(f"control plane: nothing O(all held) per step: a step at 16x the requests in "
             f"flight costs <= {fmt(num(GROWTH_MAX))}x", "control",
             "ours at the fewest in flight", growth_bounded, rank=74,
             short=f"control step at 16x in flight <= {fmt(num(GROWTH_MAX))}x"),
)

SECTION = Section("The connectors' control plane at fleet size (`bench control`)", "issue 53",
                  72, section_control, GOALS, samples=section_samples)
