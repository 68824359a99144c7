# SPDX-License-Identifier: Apache-2.0
"""The simulated instances' cost model: prefill and decode seconds from a fit on a real engine.

The fit (:mod:`.costfit`, committed as ``costmodel.json`` beside this module) gives prefill
seconds ``a + b * n + c * n**2`` for ``n`` prompt tokens computed (a cached prefix costs
nothing) and decode seconds a token of one request. ``scale`` multiplies every modelled time:
the CPU engine here is far slower than an NPU, and a fleet that drowns in its own prefills
measures queues, not routers (the scale used is written with every result).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The committed fit.
DEFAULT_FIT = Path(__file__).with_name("costmodel.json")


@dataclass(frozen=True)
class CostModel:
    """Modelled seconds of an instance's work."""

    prefill_base_s: float
    prefill_s_per_token: float
    prefill_s_per_token2: float
    decode_s_per_token: float
    scale: float = 1.0
    source: str = ""

    @classmethod
    def load(cls, path: Path | None = None, scale: float = 1.0) -> CostModel:
        """The fit in ``path`` (default: the committed one), times ``scale``."""
        path = path or DEFAULT_FIT
        doc = json.loads(Path(path).read_text())
        fit = doc["fit"]
        return cls(float(fit["prefill_base_s"]), float(fit["prefill_s_per_token"]),
                   float(fit["prefill_s_per_token2"]), float(fit["decode_s_per_token"]),
                   scale, str(path))

    def prefill_s(self, computed_tokens: int) -> float:
        """Seconds of a prefill computing ``computed_tokens`` (at least one: vLLM computes the
        last prompt token even on a full hit)."""
        n = max(1, computed_tokens)
        return self.scale * (self.prefill_base_s + self.prefill_s_per_token * n
                             + self.prefill_s_per_token2 * n * n)

    def decode_s(self, tokens: int) -> float:
        """Seconds of ``tokens`` decode steps of one request."""
        return self.scale * self.decode_s_per_token * max(0, tokens)

    def describe(self) -> dict[str, Any]:
        return {"prefill_base_s": self.prefill_base_s,
                "prefill_s_per_token": self.prefill_s_per_token,
                "prefill_s_per_token2": self.prefill_s_per_token2,
                "decode_s_per_token": self.decode_s_per_token, "scale": self.scale,
                "fit": self.source}
