# SPDX-License-Identifier: Apache-2.0
"""ascend-kv-bench: the benchmarks and serve harnesses of vllm-ascend-distributed.

A tool, not a library: no module of a runtime package (ascend-kv-core, ascend-kv-p2p,
ascend-kv-pool, ascend-cpu-offload, ascend-kernels) imports this package, and the
meta-package does not install it. It plugs into core's ``vllm-ascend-kv`` command through
the ``vllm_ascend_kv.bench`` and ``vllm_ascend_kv.serve`` entry points of its
``pyproject.toml``; without it, ``vllm-ascend-kv bench`` says to ``pip install
ascend-kv-bench``.

* one module a benchmark: :mod:`.engine`, :mod:`.auth`, :mod:`.p2p`, :mod:`.layerwise`,
  :mod:`.pool` (``bench pool`` and ``bench trace``, with :mod:`.trace_gen` and
  :mod:`.trace_replay`), :mod:`.offload`, :mod:`.kernels`, :mod:`.router`;
* :mod:`.client` - ``bench client``, vLLM's benchmark client against real servers;
* :mod:`.serve` - ``bench serve``, real vLLM CPU engines with and without each connector;
* :mod:`.fleet` - ``bench fleet``, routers in front of a simulated fleet of instances;
* what they share: :mod:`.benchutil` (results, tables, ratios, progress), :mod:`.stats`
  (ratios of alternating rounds), and the launchers the tests use too: :mod:`.engine_env`
  (the environment of every CPU engine), :mod:`.procs` (child processes),
  :mod:`.mooncake_store` (a ``mooncake_master`` on loopback);
* ``peers/`` - not a subpackage: modules the engines of vLLM's own connectors import by
  their top-level names (this directory on their ``sys.path``), to run them on CPU
  (``serve.needs.PEERS_DIR``).
"""

from __future__ import annotations
