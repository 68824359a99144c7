# SPDX-License-Identifier: Apache-2.0
"""``MooncakeLayerwiseConnector``: the P/D connector where prefill pushes each layer.

The prefill instance (P) pushes each layer's KV into the decode instance (D) as soon as it
is computed; the subpackage is laid out as vLLM's ``kv_connector/v1/nixl/``.

In the order a push goes through them:

* :mod:`.connector`: the shell vLLM instantiates (registered as
  ``MooncakeLayerwiseConnector``), which hands each hook to the scheduler half or to the
  worker;
* :mod:`.scheduler`: the scheduler half of both roles (D's asynchronous hit and its post to
  the proxy's metaserver, :mod:`.metaserver`; P's pushes of each step; virtual requests);
* :mod:`.contract`: what the scheduler sends the worker each step;
* :mod:`.worker`: the worker, which composes P's side and D's side;
* P's side: :mod:`.sender` (the step's layers, the sender thread) over :mod:`.links` (the
  sessions with D's ranks, write leases, the writes);
* D's side: :mod:`.receiver` (the side channel P pushes through, the requests waiting for
  their KV) with :mod:`.staging` (heads P cannot write into D's blocks directly).

Importing this package imports nothing (no vLLM): the modules are imported by path.
"""
