# SPDX-License-Identifier: Apache-2.0
"""What a ``bench serve`` run measures and what its scenarios declare.

:class:`ServeConfig`, :class:`Scenario` (with what it ``needs``, see :mod:`.needs`), the
:class:`Comparison` rows it wants reported and their :class:`Goal`; the P/D thread bindings
and the families' order.

Plain data, importing nothing of the harness: every other module of :mod:`..serve` reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: ``VLLM_CPU_OMP_THREADS_BIND`` of the P/D engines; empty: vLLM's default. Pinning
#: both to one core (``"1"``) starves NixlConnector, which also pins its own thread
#: to the last core: its D-side TTFT then equals a recompute (measured on the 2-core
#: machine), while ours and vLLM's MooncakeConnector are unaffected.
PD_THREADS_BIND = ""
#: Thread bindings the P/D scenarios run under, as ``VLLM_CPU_OMP_THREADS_BIND`` of P and
#: of D: ``pinned`` gives each engine its own core, ``nobind`` leaves the threads to the OS.
#: vLLM applies the value only to its multiprocess executor's workers; the engine process
#: of ``bench serve`` applies a CPU list itself (:func:`.child.bind_in_process`).
#: Each P/D scenario is reported under each; ours is compared with each peer's best.
PD_BINDINGS: dict[str, tuple[str, str]] = {"pinned": ("0", "1"), "nobind": ("nobind", "nobind")}
#: The full-size model: the peer report's random Llama (8 layers, 4 KV heads of 64).
BENCH_MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1280,
                   num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=64, max_position_embeddings=4096, initializer_range=0.08)
#: The --quick model (2 layers): seconds per engine.
QUICK_MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, max_position_embeddings=4096, initializer_range=0.08)
#: Run order of the families; within one, ours first, then in declaration order.
FAMILY_ORDER = ("baseline", "pd", "pool", "offload", "peer")


# ====================================================================== configuration
@dataclass
class ServeConfig:
    """What one run measures, and on what."""

    model: str
    model_spec: dict[str, Any]
    dtype: str
    block_size: int
    lengths: list[int]
    throughput_batch: int
    throughput_prompt: int
    throughput_tokens: int
    max_model_len: int
    out: Path
    nixl_python: str | None = None
    peers_path: str | None = None
    startup_timeout: float = 300.0
    seed: int = 0
    repeats: int = 1
    pd_threads_bind: str = PD_THREADS_BIND
    #: alternating rounds: every scenario of a family is measured once a round, in turns
    rounds: int = 1
    #: prompt lengths of the P/D scenarios (default: ``lengths``)
    pd_lengths: list[int] = field(default_factory=list)
    #: names of :data:`PD_BINDINGS` (or ``bind=<value>``) the P/D scenarios run under
    pd_bindings: tuple[str, ...] = ("nobind",)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token occupies across all layers."""
        s = self.model_spec
        itemsize = 2 if self.dtype in ("bfloat16", "float16") else 4
        return (2 * int(s["num_hidden_layers"]) * int(s["num_key_value_heads"])
                * int(s["head_dim"]) * itemsize)


@dataclass(frozen=True)
class Goal:
    """A goal of a ratio: its text, and the bound it is checked against (if any)."""

    text: str
    at_most: float | None = None
    at_least: float | None = None


@dataclass(frozen=True)
class Comparison:
    """One row of the comparisons: a scenario's ``metric`` against a peer scenario's.

    ``inverse`` reports peer / ours (a throughput from a time).
    """

    what: str
    metric: str
    peer: str
    goal: Goal | None = None
    inverse: bool = False
    #: goal of the ratio of the overheads (over the floor, or of the save); ``None``: the
    #: report's default (P/D: <= 0.8; else ``goal`` when it has a bound)
    overhead_goal: Goal | None = None


@dataclass
class Scenario:
    """One engine setup of the run."""

    name: str
    family: str  # baseline | pd | pool | offload | peer
    who: str  # ours | vllm | -
    connector: str
    describe: str
    needs: list[str] = field(default_factory=list)
    run: Callable[..., dict[str, Any]] | None = None
    #: part of ``--quick``
    quick: bool = False
    #: rows comparing this scenario with peers
    comparisons: tuple[Comparison, ...] = ()
    #: goal of its hit TTFT / recompute
    hit_goal: Goal | None = None
