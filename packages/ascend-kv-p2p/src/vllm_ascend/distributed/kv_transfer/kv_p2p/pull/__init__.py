# SPDX-License-Identifier: Apache-2.0
"""``MooncakeConnectorV1``: the P/D connector where the decode instance pulls P's KV.

D pulls the KV of the prefill instance (P); the subpackage is laid out as vLLM's
``kv_connector/v1/nixl/``.

In the order a pull goes through them:

* :mod:`.connector`: the shell vLLM instantiates (registered as ``MooncakeConnectorV1``),
  which hands each hook to the scheduler half or to the worker;
* :mod:`.scheduler`: the scheduler half of both roles (P's delayed free and the params D
  needs; D's asynchronous hit, lease renewals, claims sent ahead);
* :mod:`.contract`: what the scheduler and the workers agree on: the records it sends
  them each step, P's read window (a read that needs no claim) and P's pipeline stages;
* :mod:`.worker`: the worker, which composes P's side (:mod:`.holder`: leases, the side
  channel D claims through) and D's side (:mod:`.reader`: the pulls);
* D's side of one pull: :mod:`.reader` (claims, reads, retries, the ``Done`` owed),
  :mod:`.peers` (the calls to P's side channel), :mod:`.loads` (the loads in flight, each
  ended once), :mod:`.transfer` (the transfer plan: the bytes of one request), and
  :mod:`.inline` (reads started on vLLM's thread, with ``inline_reads``);
* :mod:`.groups`: the scheduler's pairing of each KV cache group's blocks (hybrid models).

Importing this package imports nothing (no vLLM): the modules are imported by path.
"""
