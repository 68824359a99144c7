# SPDX-License-Identifier: Apache-2.0
"""ascend-kv-core: what every vllm-ascend-distributed connector shares.

Modules (import the one you need; this package imports nothing heavy):

* :mod:`.config` - typed ``kv_connector_extra_config`` sections and the size parser;
* :mod:`.layout` - where each KV block lives (CPU, CUDA and NPU layouts, MLA);
* :mod:`.device` - streams, events, synchronisation on NPU, CUDA and CPU;
* :mod:`.transfer_engine` - the process's Mooncake transfer engine;
* :mod:`.wire` and :mod:`.channel` - msgspec messages over ZeroMQ, never pickle;
* :mod:`.auth` and :mod:`.protected` - the deployment key, and without one protected mode
  (servers answer peers on their own host only);
* :mod:`.leases` - owners and deadlines for everything held for a peer;
* :mod:`.hashing` - block-hash keys equal across processes;
* :mod:`.registration` - lazy, idempotent registration with vLLM;
* :mod:`.metrics` / :mod:`.vllm_metrics` - counters and histograms for vLLM's stats;
* :mod:`.tooling` - the ``vllm-ascend-kv`` command and the bench helpers (never imported
  by the modules above).
"""

from __future__ import annotations

from .__about__ import __version__

__all__ = ["__version__"]
