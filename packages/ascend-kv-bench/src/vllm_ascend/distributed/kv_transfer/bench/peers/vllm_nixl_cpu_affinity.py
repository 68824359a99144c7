# SPDX-License-Identifier: Apache-2.0
"""Keep a NixlConnector engine on the cores it was bound to (benchmarks only).

On a CPU engine, vLLM's ``NixlConnector`` worker moves the calling thread to the last
core of each NUMA node (``os.sched_setaffinity(0, ...)`` with the cores of
``CpuPlatform.discover_numa_topology()``), to "reserve different cores for
start_load_kv() from model_forward()". In vLLM's CPU worker that thread is the engine's
main thread, which is also OpenMP's thread 0 of every forward: on a machine of one NUMA
node and 2 cores, both the P and the D engine of a pair then compute on core 1, whatever
``VLLM_CPU_OMP_THREADS_BIND`` said (measured 2026-12-04: a P bound to core 0 prefilled
2,048 tokens in 4.0-4.2 s, against 1.3 s for the same engine with our connector, its
main thread's affinity read back as core 1). No option of the connector turns that off.
``bench serve`` imports this module first in both engines of the NixlConnector pair, so
the peer runs under the binding it is given, like every other engine of the run: NUMA
discovery returns no node, and the connector reserves no core.
"""

from __future__ import annotations

import logging

from vllm.platforms.cpu import CpuPlatform

logger = logging.getLogger(__name__)


def _no_reserved_cores(cls: type) -> list[list[int]]:
    return []


CpuPlatform.discover_numa_topology = classmethod(_no_reserved_cores)  # type: ignore[assignment,method-assign]
logger.warning("benchmark patch: NixlConnector keeps the engine's CPU binding "
               "(no core reserved for KV loads)")
