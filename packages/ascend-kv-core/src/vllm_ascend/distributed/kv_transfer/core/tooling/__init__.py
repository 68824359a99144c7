# SPDX-License-Identifier: Apache-2.0
"""Tooling of ascend-kv-core: the ``vllm-ascend-kv`` command and its ``doctor``.

Nothing here runs inside vLLM: no runtime module of any package imports this
subpackage, and it holds no benchmark (a test of ascend-kv-core walks every package's
sources and fails on either). Every package keeps its doctor checks in its own
``tooling`` subpackage; the benchmarks and serve harnesses are the ascend-kv-bench
distribution (``vllm_ascend.distributed.kv_transfer.bench``). Both reach the command line
through entry points:

* :mod:`.plugins` - the entry-point groups (``vllm_ascend_kv.*``) and their loaders;
* :mod:`.cli` - ``vllm-ascend-kv`` (``version``, ``config``, ``doctor``, and every plugin's
  subcommands; ``bench`` when ascend-kv-bench is installed);
* :mod:`.doctor` - ``vllm-ascend-kv doctor`` and the :class:`~.doctor.Doctor` the
  packages' doctor checks receive, with its checks :mod:`.doctor_auth`,
  :mod:`.doctor_listeners` and :mod:`.doctor_provenance` (which reads :mod:`.provenance`:
  who provides each ``vllm_ascend.distributed`` file);
* :mod:`.cpu_binding` - what ``VLLM_CPU_OMP_THREADS_BIND`` pins (the p2p doctor's OpenMP
  check, and the engines ``bench serve`` binds).
"""

from __future__ import annotations
