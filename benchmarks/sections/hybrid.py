# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench hybrid``: a sliding-window model through the P/D pull, vLLM's hybrid KV
cache manager on against off."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from ._common import GoalSpec, Images, Measured, Section, fmt, judged_ratio, md_table, num, worst

logger = logging.getLogger(__name__)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def window_share(tokens: int, block: int, window: int) -> float:
    """KV bytes D reads with the hybrid manager on over off, as the window keeps them: half
    the layers keep every block of the ``tokens - 1`` D loads, the window's half the blocks
    vLLM keeps for it; off, every layer keeps every block of the prompt."""
    loaded = tokens - 1
    full = _cdiv(loaded, block)
    kept = full - max(0, loaded - window + 1) // block
    return (full + kept) / (2 * _cdiv(tokens, block))


def bytes_as_the_window_keeps(entry: Mapping[str, Any]) -> Measured | None:
    """HMA on / off of the KV bytes D read, round by round, at each prompt length, against
    :func:`window_share`; the length whose interval lies highest decides."""
    result = entry.get("result") or {}
    block, window = int(result.get("block_size") or 0), int(result.get("window") or 0)
    if not block or not window:
        return None
    by_tags = {(s["tags"].get("mode"), s["tags"].get("prompt_tokens"), s["tags"].get("metric")):
               s for s in entry.get("samples") or [] if isinstance(s.get("tags"), dict)}
    points = []
    for n in result.get("lengths") or []:
        on, off = by_tags.get(("on", n, "bytes")), by_tags.get(("off", n, "bytes"))
        if on and off:
            points.append(judged_ratio([r[0] for r in on["rounds"]],
                                       [r[0] for r in off["rounds"]],
                                       at_most=window_share(int(n), block, window) + 1e-9,
                                       where=f"{n} tokens"))
    return worst(points, at_least=False)


def section_hybrid(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    rows = []
    for r in d.get("rows", []):
        ttft = r.get("ttft_on_over_off") or {}
        rows.append({
            "tokens": r.get("prompt_tokens"),
            "bytes_on": fmt(num(r.get("bytes_on"))), "bytes_off": fmt(num(r.get("bytes_off"))),
            "bytes_ratio": fmt(num((r.get("bytes_on_over_off") or {}).get("ratio"))),
            "window": fmt(window_share(int(r.get("prompt_tokens") or 1),
                                       int(d.get("block_size") or 1),
                                       int(d.get("window") or 1))),
            "ttft_on": fmt(_ms(num(r.get("ttft_on")))),
            "ttft_off": fmt(_ms(num(r.get("ttft_off")))),
            "ttft_ratio": f"{fmt(num(ttft.get('ratio')))} [{fmt(num(ttft.get('low')))}–"
                          f"{fmt(num(ttft.get('high')))}]",
            "fit_on": fmt(num(r.get("fit_on"))), "fit_off": fmt(num(r.get("fit_off"))),
            "agree": r.get("first_token_agrees")})
    model = d.get("model") or {}
    return (f"A random Llama of {model.get('num_hidden_layers', '?')} layers alternating a "
            f"{d.get('window', '?')}-token window and full attention, block size "
            f"{d.get('block_size', '?')}, through `MooncakeConnectorV1`: P and D with vLLM's "
            "hybrid KV cache manager on, P and D with it off, side by side, the pair that goes "
            f"first alternating over {d.get('rounds', '?')} rounds. TTFT is D's (the KV read "
            "and its first token); fit is how many requests of the length D's KV cache holds "
            "at once (vLLM's own count, a window group charged the window plus "
            f"{d.get('max_num_batched_tokens', '?')} batched tokens).\n\n"
            + md_table(rows, ["tokens", "bytes_on", "bytes_off", "bytes_ratio", "window",
                              "ttft_on", "ttft_off", "ttft_ratio", "fit_on", "fit_off",
                              "agree"],
                       ["prompt tokens", "KV bytes, on", "off", "on / off",
                        "what the window keeps", "D TTFT on (ms)", "off (ms)",
                        "on / off [95%]", "fit on", "fit off", "same first token"]))


GOALS = (GoalSpec("sliding-window model, hybrid KV cache manager on: KV bytes D reads fall to "
                  "what the window keeps (2,048 and 8,192 tokens)", "hybrid",
                  "the same model with the manager off", bytes_as_the_window_keeps, rank=60,
                  short="sliding window: D reads what it keeps"),)


SECTION = Section("Hybrid models: a sliding window with and without vLLM's hybrid KV cache "
                  "manager (`bench hybrid`)", "issue 52", 45, section_hybrid, GOALS)


def _ms(seconds: float | None) -> float | None:
    """Seconds in milliseconds (``None`` stays ``None``)."""
    return None if seconds is None else seconds * 1e3
