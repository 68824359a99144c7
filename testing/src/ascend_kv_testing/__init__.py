# SPDX-License-Identifier: Apache-2.0
"""Test support for vllm-ascend-distributed (not published).

* :mod:`.fake_torch_npu` - a ``torch_npu`` stand-in with the real signatures;
* :mod:`.fake_memcache` - a ``memcache_hybrid`` stand-in (real signatures and return codes);
* :mod:`.mooncake` - start and stop ``mooncake_master`` / ``mooncake_client`` on loopback;
* :mod:`.models` - a tiny random-weight Llama and a locally trained tokenizer;
* :mod:`.engines` - real vLLM CPU engines in spawned processes; :mod:`.probes` - functions
  run inside them; :mod:`.pd` - helpers of the P/D tests;
* :mod:`.procs` - ports and child processes; :mod:`.peers` - peer processes;
  :mod:`.dist_workers` - multi-rank torch.distributed workers;
* fault and soak support: the remaining modules (fault hooks, network namespaces, fuzz
  strategies, ``vllm serve`` and proxy processes, the soak driver);
* :mod:`.pytest_plugin` - fixtures, activated as a pytest plugin.

Fakes are activated explicitly (a fixture or ``install()``), never by import order.
"""
