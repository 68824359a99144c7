# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench fleet``: routers in front of a simulated fleet of hundreds of instances.

* :mod:`.instance` - one stand-in for ``vllm serve`` (OpenAI endpoints, ``/health``,
  ``/metrics``, a bounded LRU prefix cache of vLLM's block hashes, P/D roles), its times from
  :mod:`.model`, the cost model :mod:`.costfit` fitted on the real CPU engine
  (``costmodel.json``);
* :mod:`.events` - its KV events in vLLM's ZeroMQ wire format, with replay;
* :mod:`.http` - the minimal HTTP/1.1 server and client they and the driver use;
* :mod:`.fleet` - N instances in one process and a control endpoint (add, drain, kill);
* :mod:`.routers` - the routers in front of it (ours, ``vllm-router``, none);
* :mod:`.load` - the open-loop load, churn, and what is measured;
* :mod:`.command` - the ``bench fleet`` command; :mod:`.report` - the docs' tables.
"""

from __future__ import annotations
