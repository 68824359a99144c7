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
  asked to stop, then shuts the server down.
* :func:`get_cpu_offload_connector`: the connector's ``KVTransferConfig``, also
  inside a ``MultiConnector``.

Unlike upstream, requests are msgspec messages (never pickle) and the host
memory is created once every rank has registered its layout, so upstream's
``init_cpu_kv_caches``/``post_init`` RPCs and its ``ZMQRPCClient`` are
:class:`~.cpu_offload_manager.protocol.RegisterRank` messages sent by
:class:`~.cpu_offload_manager.client.MetadataClient`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .cpu_offload_manager.server import MetadataServer

logger = logging.getLogger(__name__)

__all__ = ["CONNECTOR_NAME", "MetadataServer", "MetadataServerProc",
           "get_cpu_offload_connector"]

CONNECTOR_NAME = "CPUOffloadingConnector"


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def get_cpu_offload_connector(vllm_config: Any) -> Any:
    """The ``kv_transfer_config`` of ``CPUOffloadingConnector``, or None.

    The engine's own config when it names the connector; otherwise the first child
    of a ``MultiConnector`` that does (a child given as a dict comes back as a dict).
    """
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None:
        return None
    if _field(kv, "kv_connector") == CONNECTOR_NAME:
        return kv
    if _field(kv, "kv_connector") == "MultiConnector":
        extra = _field(kv, "kv_connector_extra_config") or {}
        for child in extra.get("connectors") or ():
            if _field(child, "kv_connector") == CONNECTOR_NAME:
                if isinstance(child, dict):
                    return _ChildConfig(child)
                return child
    return None


class _ChildConfig:
    """Attribute access to a ``MultiConnector`` child given as a dict."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)
        self.kv_connector_extra_config = fields.get("kv_connector_extra_config") or {}


class MetadataServerProc:
    """Upstream's entry point that runs the metadata server until told to stop."""

    @staticmethod
    def run_metadata_server(vllm_config: Any, stop: threading.Event | None = None) -> None:
        """Serve the instance's metadata until ``stop`` is set (or the process exits).

        Does nothing when prefix caching is off or no ``CPUOffloadingConnector`` is
        configured, as upstream. The server shuts down (segments and socket file
        removed) however the wait ends.

        Args:
            vllm_config: the engine's config.
            stop: set it to return; default: wait until ``SystemExit``/``KeyboardInterrupt``.
        """
        cache = getattr(vllm_config, "cache_config", None)
        if not getattr(cache, "enable_prefix_caching", False):
            return
        if get_cpu_offload_connector(vllm_config) is None:
            return
        stop = stop or threading.Event()
        server: MetadataServer | None = None
        try:
            server = MetadataServer.from_vllm_config(vllm_config).start()
            logger.info("Metadata server started on %s.", server.endpoint)
            while not stop.wait(0.5):
                pass
        except (SystemExit, KeyboardInterrupt):
            logger.info("Metadata server exiting.")
            raise
        finally:
            if server is not None:
                server.shutdown()
