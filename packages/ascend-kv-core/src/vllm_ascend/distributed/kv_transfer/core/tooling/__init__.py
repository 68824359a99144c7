# SPDX-License-Identifier: Apache-2.0
"""Tooling of ascend-kv-core: the ``vllm-ascend-kv`` command and the shared bench helpers.

Nothing here runs inside vLLM: no runtime module of any package imports this
subpackage (a test of ascend-kv-core walks every package's sources and fails on
such an import). Every package keeps its own tooling in its own ``tooling``
subpackage and reaches the command line through entry points:

* :mod:`.plugins` - the entry-point groups (``vllm_ascend_kv.*``) and their loaders;
* :mod:`.cli` - ``vllm-ascend-kv`` (``version``, ``config``, and every plugin's subcommands);
* :mod:`.doctor` - ``vllm-ascend-kv doctor`` and the :class:`~.doctor.Doctor` the
  packages' doctor checks receive;
* :mod:`.benchutil` - results, tables, ratios and progress of the benchmarks;
* :mod:`.bench_engine` - ``bench engine``, the raw Mooncake transfer engine;
* :mod:`.bench_serve` (with :mod:`.serve_child`, :mod:`.serve_scenarios`,
  :mod:`.serve_report`) - ``bench serve``, real vLLM CPU engines per connector;
* :mod:`.mooncake_store` - a ``mooncake_master`` (and segment holder) on loopback;
* :mod:`.engine_env` - the environment of every CPU engine started by a tool or a test.
"""

from __future__ import annotations
