# SPDX-License-Identifier: Apache-2.0
"""Where each TP rank of an instance lives, for instances whose ranks span hosts.

Each worker binds its side channel on its own host (``VLLM_ASCEND_KV_HOST`` /
``VLLM_HOST_IP`` of that node, else the address that routes outwards). Its connector
publishes that address through vLLM's handshake-metadata path: the worker's
``get_handshake_metadata()`` returns a :class:`RankAddress`, vLLM's engine core
collects one per rank after the KV caches are registered and hands them to the
scheduler-side connector (``set_xfer_handshake_metadata``). The scheduler then writes
``remote_multi_nodes_meta_mapping`` (upstream's key: ``{"<tp_rank>": {"host": ...,
"engine_id": ...}}``) into the ``kv_transfer_params`` it sends the peer, and the peer
dials each rank where it lives (:func:`parse_rank_hosts`); a rank the mapping does not
name is dialled at ``remote_host``, as with an instance on one host.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import KVParamsError

__all__ = ["MULTI_NODES_KEY", "RankAddress", "hosts_of", "multi_nodes_mapping",
           "parse_rank_hosts"]

logger = logging.getLogger(__name__)

#: Upstream's key of the per-rank addresses in ``kv_transfer_params``.
MULTI_NODES_KEY = "remote_multi_nodes_meta_mapping"
_MAX_RANKS = 4096


@dataclass
class RankAddress:
    """What one worker publishes: the host its side channel listens on, and its port.

    (vLLM's ``KVConnectorHandshakeMetadata`` is an empty marker class; this one does not
    derive from it so that this module, which the proxy imports through ``params``, does
    not import vLLM.)"""

    host: str
    port: int
    tp_rank: int


def hosts_of(metadata: Mapping[Any, Any]) -> dict[int, str]:
    """TP rank -> host, from what vLLM collected (keys: TP rank, or ``(pp, tp)``)."""
    out: dict[int, str] = {}
    for key, meta in metadata.items():
        if isinstance(meta, RankAddress):
            out[meta.tp_rank] = meta.host
        elif meta is not None:
            logger.warning("ignoring handshake metadata of rank %s: %s", key,
                           type(meta).__name__)
    return out


def multi_nodes_mapping(hosts: Mapping[int, str], engine_id: str) -> dict[str, dict[str, str]]:
    """``remote_multi_nodes_meta_mapping`` of an instance whose ranks live at ``hosts``."""
    return {str(rank): {"host": host, "engine_id": engine_id}
            for rank, host in sorted(hosts.items())}


def parse_rank_hosts(params: Mapping[str, Any], *, tp_size: int) -> dict[int, str]:
    """TP rank -> host of the remote instance, from ``remote_multi_nodes_meta_mapping``
    (``{}`` when absent: every rank at ``remote_host``).

    Raises:
        KVParamsError: the mapping is not an object of ``"<rank>": {"host": str}`` with
            ranks below ``tp_size``.
    """
    mapping = params.get(MULTI_NODES_KEY)
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping) or len(mapping) > _MAX_RANKS:
        raise KVParamsError(f"kv_transfer_params: {MULTI_NODES_KEY!r} must be an object of "
                            f"at most {_MAX_RANKS} ranks, got a {type(mapping).__name__}")
    out: dict[int, str] = {}
    for key, entry in mapping.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) <= 6):
            raise KVParamsError(f"kv_transfer_params: {MULTI_NODES_KEY!r} has the key "
                                f"{str(key)[:40]!r}; keys are TP ranks as strings")
        rank = int(key)
        if rank >= tp_size:
            raise KVParamsError(f"kv_transfer_params: {MULTI_NODES_KEY!r} names rank {rank} "
                                f"of an instance of TP size {tp_size}")
        host = entry.get("host") if isinstance(entry, Mapping) else None
        if not isinstance(host, str) or not host or len(host) > 255:
            raise KVParamsError(f"kv_transfer_params: {MULTI_NODES_KEY!r}[{key!r}] must be an "
                                "object with a 'host' string")
        out[rank] = host
    return out
