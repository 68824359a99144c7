# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench serve``: real vLLM CPU engines with and without each connector.

In import order: :mod:`.spec` (what a run and a scenario declare), :mod:`.child` (the
engine process), :mod:`.needs` (what a scenario needs and whether it is here),
:mod:`.scenarios` (the run's state and the single-engine flow), :mod:`.pd` (the P/D
flow), the scenarios (:mod:`.builtin`: no connector and vLLM's own; :mod:`.p2p`,
:mod:`.pool`, :mod:`.offload`: ours), :mod:`.rounds` (alternating rounds),
:mod:`.compare` and :mod:`.report` (ratios, intervals, goals), :mod:`.command` (the
subcommand).
"""

from __future__ import annotations
