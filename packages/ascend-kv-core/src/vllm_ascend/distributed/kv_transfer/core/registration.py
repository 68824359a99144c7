# SPDX-License-Identifier: Apache-2.0
"""Lazy, idempotent connector registration with vLLM's ``KVConnectorFactory``.

Each connector package exposes ``register()`` behind the
``vllm.general_plugins`` entry point; it calls :func:`register_connectors`
with ``(name, module, class)`` triples. Nothing is imported until vLLM asks
for the class. Calling it twice is harmless, and a name vLLM (or any third
party) already registered is left alone: vLLM owns ``MooncakeConnector``,
ours is ``MooncakeConnectorV1``.

Beside vLLM-Ascend (see ``docs/deployment-ascend.md``): its
``vllm_ascend.distributed.kv_transfer.register_connector()`` registers the
same names (``MooncakeConnectorV1``, ``AscendStoreConnector``, ...) without
checking, and vLLM's factory raises on a name registered twice; vLLM's
plugin loader does not catch that, and the order in which it runs the two
plugins is not defined. So, whichever runs first:

* a name that vLLM-Ascend registered (its loader imports a module under
  ``vllm_ascend.``, not ours) is taken over: ours replaces it;
* vLLM-Ascend's ``register_connector`` is wrapped, in its module, by a
  tolerant version (:func:`tolerate_vllm_ascend`): inside it, a name already
  registered is skipped instead of raising, and ours are put back afterwards.
  Its top-level ``vllm_ascend.register_connector`` imports the function at
  call time, so it calls the wrapper.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from .logs import follow_vllm_logging

logger = logging.getLogger(__name__)

_lock = threading.RLock()
#: name -> (module, class) of what this project registered in this process.
_ours: dict[str, tuple[str, str]] = {}
#: name -> the loader this project put in vLLM's registry.
_our_loaders: dict[str, Callable[[], Any]] = {}

#: Where vLLM-Ascend's own ``register_connector()`` lives.
VLLM_ASCEND_KV_TRANSFER = "vllm_ascend.distributed.kv_transfer"
_WRAPPED_MARK = "_vllm_ascend_kv_tolerant"


class ConnectorEntry(NamedTuple):
    """One connector name and where its class lives."""

    name: str
    module: str
    class_name: str


def loader_target(loader: Callable[[], Any]) -> tuple[str, str] | None:
    """``(module, class)`` a registry loader imports, or None when it cannot be told.

    vLLM's ``register_connector`` stores a closure over ``module_path`` and
    ``class_name``; this reads them back (for takeover decisions and ``doctor``).
    """
    code = getattr(loader, "__code__", None)
    cells = getattr(loader, "__closure__", None)
    if code is None or not cells:
        return None
    free = dict(zip(code.co_freevars, cells, strict=False))
    try:
        module = free["module_path"].cell_contents
        cls = free["class_name"].cell_contents
    except (KeyError, ValueError):
        return None
    if isinstance(module, str) and isinstance(cls, str):
        return module, cls
    return None


def _registered_by_vllm_ascend(loader: Callable[[], Any]) -> bool:
    """True when a registry entry came from vLLM-Ascend (not vLLM, not us)."""
    target = loader_target(loader)
    return target is not None and target[0].startswith("vllm_ascend.")


def register_connectors(entries: Iterable[ConnectorEntry | tuple[str, str, str]]) -> list[str]:
    """Register connectors lazily; return the names newly registered.

    A name already registered by this project is skipped; a name registered
    by vLLM-Ascend is taken over; a name registered by anyone else (vLLM) is
    left alone. Afterwards vLLM-Ascend's ``register_connector``, when it is
    installed, is made tolerant (:func:`tolerate_vllm_ascend`) so that it can
    run after this without raising.

    vLLM missing is not an error here (a plugin entry point can be loaded by
    tools without vLLM): nothing is registered and an empty list is returned.
    """
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        logger.debug("vLLM is not importable; connectors not registered")
        return []
    follow_vllm_logging()
    added: list[str] = []
    with _lock:
        registry = KVConnectorFactory._registry
        for entry in entries:
            name, module, class_name = ConnectorEntry(*entry)
            current = registry.get(name)
            if current is not None:
                if current is _our_loaders.get(name):
                    continue
                if not _registered_by_vllm_ascend(current):
                    logger.debug("connector name %r is already registered by someone else; "
                                 "leaving it alone", name)
                    continue
                logger.info("connector %r: vLLM-Ascend's registration %s is replaced by %s.%s",
                            name, loader_target(current), module, class_name)
                del registry[name]
            KVConnectorFactory.register_connector(name, module, class_name)
            _ours[name] = (module, class_name)
            _our_loaders[name] = registry[name]
            added.append(name)
        tolerate_vllm_ascend()
    if added:
        logger.debug("registered KV connectors: %s", ", ".join(added))
    return added


def tolerate_vllm_ascend() -> bool:
    """Wrap vLLM-Ascend's ``register_connector`` so it runs after ours without raising.

    Returns True when vLLM-Ascend's function is present and wrapped (now or
    earlier). Absent vLLM-Ascend (our namespace package has no such
    function), nothing happens.
    """
    try:
        module = importlib.import_module(VLLM_ASCEND_KV_TRANSFER)
    except Exception:  # a broken foreign package must not stop ours
        logger.debug("%s is not importable; nothing to wrap", VLLM_ASCEND_KV_TRANSFER,
                     exc_info=True)
        return False
    original = getattr(module, "register_connector", None)
    if original is None or not callable(original):
        return False
    if getattr(original, _WRAPPED_MARK, False):
        return True

    @functools.wraps(original)
    def register_connector(*args: Any, **kwargs: Any) -> Any:
        return _run_tolerantly(original, *args, **kwargs)

    setattr(register_connector, _WRAPPED_MARK, True)
    module.register_connector = register_connector  # type: ignore[attr-defined]
    logger.debug("%s.register_connector wrapped: names registered by ascend-kv packages "
                 "stay theirs", VLLM_ASCEND_KV_TRANSFER)
    return True


def _run_tolerantly(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run vLLM-Ascend's registration with a factory that skips taken names."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with _lock:
        strict = KVConnectorFactory.__dict__["register_connector"]
        registry = KVConnectorFactory._registry

        def tolerant(cls: type, name: str, module_path: str, class_name: str) -> None:
            if name in registry:
                logger.debug("vLLM-Ascend's %r -> %s.%s skipped: already registered",
                             name, module_path, class_name)
                return
            strict.__func__(cls, name, module_path, class_name)

        KVConnectorFactory.register_connector = classmethod(tolerant)  # type: ignore[method-assign,assignment]
        try:
            return original(*args, **kwargs)
        finally:
            KVConnectorFactory.register_connector = strict  # type: ignore[method-assign]
            # It may have popped a name first (it does so for names it overrides).
            for name, loader in _our_loaders.items():
                if registry.get(name) is not loader:
                    logger.info("connector %r: put back ascend-kv's registration after "
                                "vLLM-Ascend's", name)
                    registry[name] = loader


def registered_by_us() -> dict[str, tuple[str, str]]:
    """Names registered by this project in this process (for ``doctor`` and tests)."""
    with _lock:
        return dict(_ours)
