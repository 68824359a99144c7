# SPDX-License-Identifier: Apache-2.0
"""The metadata server of ``CPUOffloadingConnector``, at upstream's module path.

"Metadata" in this package means this server and nothing else: the process-wide
bookkeeping of the host pool (which host block holds which KV block), served to
the scheduler and the ranks of one instance. Its parts live in
:mod:`.cpu_offload_manager` (block manager, host segments, msgspec protocol,
server and client); this module keeps upstream's public names:

* :class:`MetadataServer`: the server (the same class as
  :class:`.cpu_offload_manager.server.MetadataServer`).
  ``MetadataServer.from_vllm_config(vllm_config)`` builds it the way upstream's
  ``MetadataServer(vllm_config)`` did; ``shutdown()`` stops it.
* :class:`MetadataServerProc`: ``run_metadata_server(vllm_config)`` serves until
  asked to stop, then shuts the server down (also in :mod:`.cpu_offload_manager.server`).
* :func:`get_cpu_offload_connector`: the connector's ``KVTransferConfig``, also
  inside a ``MultiConnector`` (from :mod:`.config`).

Unlike upstream, requests are msgspec messages (never pickle) and the host
memory is created once every rank has registered its layout, so upstream's
``init_cpu_kv_caches``/``post_init`` RPCs and its ``ZMQRPCClient`` are
:class:`~.cpu_offload_manager.protocol.RegisterRank` messages sent by
:class:`~.cpu_offload_manager.client.MetadataClient`.

This file is only a re-export at upstream's path: vLLM-Ascend's wheel ships its own
``metadata.py`` here and, installed after ours, overwrites it, so nothing of ours imports
it; the code lives in modules only we ship.
"""

from __future__ import annotations

from . import CONNECTOR_NAME
from .config import get_cpu_offload_connector
from .cpu_offload_manager.server import MetadataServer, MetadataServerProc

__all__ = ["CONNECTOR_NAME", "MetadataServer", "MetadataServerProc",
           "get_cpu_offload_connector"]
