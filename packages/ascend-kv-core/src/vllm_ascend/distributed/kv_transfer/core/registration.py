# SPDX-License-Identifier: Apache-2.0
"""Lazy, idempotent connector registration with vLLM's ``KVConnectorFactory``.

Each connector package exposes ``register()`` behind the
``vllm.general_plugins`` entry point; it calls :func:`register_connectors`
with ``(name, module, class)`` triples. Nothing is imported until vLLM asks
for the class. Calling it twice is harmless, and a name vLLM (or anyone
else) already registered is left alone: vLLM owns ``MooncakeConnector``, ours
is ``MooncakeConnectorV1``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import NamedTuple

logger = logging.getLogger(__name__)

_lock = threading.Lock()
#: name -> (module, class) of what this project registered in this process.
_ours: dict[str, tuple[str, str]] = {}


class ConnectorEntry(NamedTuple):
    """One connector name and where its class lives."""

    name: str
    module: str
    class_name: str


def register_connectors(entries: Iterable[ConnectorEntry | tuple[str, str, str]]) -> list[str]:
    """Register connectors lazily; return the names newly registered.

    vLLM missing is not an error here (a plugin entry point can be loaded by
    tools without vLLM): nothing is registered and an empty list is returned.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        logger.debug("vLLM is not importable; connectors not registered")
        return []
    added: list[str] = []
    with _lock:
        registry = KVConnectorFactory._registry
        for entry in entries:
            name, module, class_name = ConnectorEntry(*entry)
            if name in registry:
                if _ours.get(name) != (module, class_name):
                    logger.debug("connector name %r is already registered by someone else; "
                                 "leaving it alone", name)
                continue
            KVConnectorFactory.register_connector(name, module, class_name)
            _ours[name] = (module, class_name)
            added.append(name)
    if added:
        logger.debug("registered KV connectors: %s", ", ".join(added))
    return added


def registered_by_us() -> dict[str, tuple[str, str]]:
    """Names registered by this project in this process (for ``doctor`` and tests)."""
    with _lock:
        return dict(_ours)
