# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench client``: vLLM's own benchmark client against real servers.

:mod:`.command` (the subcommand) runs every target of :mod:`.deploy` once, and
:mod:`.rounds` alternates our P/D pair with vLLM's; :mod:`.procs` runs the client and
reads the servers' metrics, :mod:`.model` writes the served model and its tokenizer.
"""

from __future__ import annotations
