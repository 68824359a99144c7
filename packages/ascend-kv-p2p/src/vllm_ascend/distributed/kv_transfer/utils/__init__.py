# SPDX-License-Identifier: Apache-2.0
"""Upstream's ``kv_transfer/utils`` package, shipped by ascend-kv-p2p.

* :mod:`.mooncake_transfer_engine`: ``GlobalTE`` and its process singleton
  ``global_te``, over ascend-kv-core's transfer engine (one engine a process,
  memory registered once);
* :mod:`.utils`: the P/D helpers upstream's connectors import (transfer
  timeout, ``parallel_info``, ``align_memory``, context-parallel and head
  mappings, the P-side head all-to-all).

Importing this package imports neither Mooncake nor vLLM.
"""

from __future__ import annotations
