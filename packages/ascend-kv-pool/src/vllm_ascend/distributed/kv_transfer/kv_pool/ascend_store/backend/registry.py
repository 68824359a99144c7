# SPDX-License-Identifier: Apache-2.0
"""The pool's backends by name: the one place a backend is registered.

A backend is one module plus one entry here. :data:`BUILTIN_BACKENDS` holds a
line per backend this package ships (the ``backend`` config value, the
``module:Class`` that defines it, and a phrase for the docs);
:func:`register_backend` adds one from elsewhere. Everything that names backends
derives from this table: the ``backend`` key's accepted values and its
documentation (``config.POOL_BACKENDS``, a live view, so the configuration
reference, ``vllm-ascend-kv config`` and config validation list every registered
backend), the worker's :func:`backend_class` lookup, and the lazy exports of
``backend/__init__.py``. How a backend is built from the pool's config is the
backend's own business: ``Backend.create`` (the worker calls nothing else).

Why a registry line and not an entry point group: the built-in backends are
modules of this distribution, so a line finds them from a source checkout, from
a wheel, and beside vLLM-Ascend alike, without reading installed metadata (which
can be stale next to a checkout) at every config parse. A backend living in
another distribution registers itself with :func:`register_backend` from its
own ``vllm.general_plugins`` plugin, which vLLM runs in every process before a
connector reads its config; no second discovery mechanism is needed for it.

The worker finds its backend here, never through ``backend/__init__.py``:
vLLM-Ascend's wheel ships its own ``backend/__init__.py`` (and ``backend.py``,
``mooncake_backend.py``, ``memcache_backend.py``), which replace ours when it
is installed after ours; every module named below is one only ascend-kv-pool
ships. Importing this module imports no backend and no store client (nor any
other module of the pool: the config imports it).
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Backend

logger = logging.getLogger(__name__)

_PKG = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend"
_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")


@dataclass(frozen=True)
class BackendEntry:
    """One registered backend.

    Attributes:
        name: the ``backend`` config value (lower case).
        target: ``"package.module:Class"`` (imported on first use) or the class itself.
        summary: what the store is, in a few words (the ``backend`` key's documentation).
    """

    name: str
    target: str | type[Backend]
    summary: str = ""

    def load(self) -> type[Backend]:
        """The backend class, importing its module if ``target`` names one."""
        if not isinstance(self.target, str):
            return self.target
        module, _, attr = self.target.partition(":")
        cls: type[Backend] = getattr(importlib.import_module(module), attr)
        return cls


#: The backends this package ships, in the order the docs list them: adding one is
#: its module plus one line here.
BUILTIN_BACKENDS = (
    BackendEntry("local", f"{_PKG}.local_backend:LocalBackend",
                 "host memory of this process, LRU; zero configuration"),
    BackendEntry("mooncake", f"{_PKG}.mooncake_store:MooncakeBackend", "Mooncake Store"),
    BackendEntry("memcache", f"{_PKG}.memcache_store:MemcacheBackend", "memcache_hybrid"),
)

_REGISTRY: dict[str, BackendEntry] = {e.name: e for e in BUILTIN_BACKENDS}

#: Names ``backend/__init__.py`` exports lazily (upstream's) -> the module (ours only)
#: defining each: the ABC and the built-in backend classes.
EXPORTS = {
    "Backend": f"{_PKG}.base",
    **{str(e.target).partition(":")[2]: str(e.target).partition(":")[0]
       for e in BUILTIN_BACKENDS},
}

__all__ = ["BUILTIN_BACKENDS", "EXPORTS", "BackendEntry", "BackendNames", "backend_class",
           "backend_entries", "backend_names", "load_export", "register_backend",
           "unregister_backend"]


class BackendNames(Sequence[str]):
    """The registered backend names, read at each use (so a later registration shows)."""

    def __getitem__(self, index: Any) -> Any:
        return tuple(_REGISTRY)[index]

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(_REGISTRY))

    def __contains__(self, name: object) -> bool:
        return name in _REGISTRY

    def __repr__(self) -> str:
        return repr(tuple(_REGISTRY))


def backend_names() -> BackendNames:
    """A live view of the registered names (the ``backend`` key's choices)."""
    return BackendNames()


def backend_entries() -> tuple[BackendEntry, ...]:
    """Every registered backend, built-ins first, then in registration order."""
    return tuple(_REGISTRY.values())


def register_backend(name: str, target: str | type[Backend], summary: str = "", *,
                     replace: bool = False) -> BackendEntry:
    """Make ``name`` a valid ``backend`` config value, served by ``target``.

    Args:
        name: the config value (lower case letters, digits, ``_`` and ``-``).
        target: ``"package.module:Class"`` (imported when the backend is first looked
            up, so registering imports nothing) or a :class:`~.base.Backend` subclass.
        summary: what the store is, in a few words, for the docs.
        replace: allow replacing a registered backend of the same name.

    Raises:
        ValueError: a malformed name or target, or ``name`` is registered already.
    """
    if not _NAME.match(name):
        raise ValueError(f"pool backend name {name!r} must be lower case letters, digits, "
                         "'_' or '-', starting with a letter")
    if isinstance(target, str) and not re.match(r"^[\w.]+:\w+$", target):
        raise ValueError(f"pool backend {name!r}: target {target!r} is not 'module:Class'")
    if name in _REGISTRY and not replace:
        raise ValueError(f"pool backend {name!r} is registered already "
                         f"({_REGISTRY[name].target!r}); pass replace=True to replace it")
    entry = BackendEntry(name, target, summary)
    _REGISTRY[name] = entry
    logger.debug("pool backend %r registered: %r", name, target)
    return entry


def unregister_backend(name: str) -> None:
    """Forget a backend registered with :func:`register_backend` (no-op if unknown).

    Raises:
        ValueError: ``name`` is a built-in backend.
    """
    if any(e.name == name for e in BUILTIN_BACKENDS):
        raise ValueError(f"pool backend {name!r} is built in; it cannot be unregistered")
    _REGISTRY.pop(name, None)


def load_export(name: str) -> Any:
    """The object ``name`` (a key of :data:`EXPORTS`), importing only its module.

    Raises:
        AttributeError: ``name`` is not exported.
    """
    module = EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {_PKG!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def backend_class(name: str) -> type[Backend]:
    """The backend class for a ``backend`` config value (case and spaces ignored).

    Raises:
        ValueError: ``name`` is not a registered backend (the message lists them).
        TypeError: its target is not a :class:`~.base.Backend` subclass.
    """
    from .base import Backend

    entry = _REGISTRY.get(name.strip().lower())
    if entry is None:
        raise ValueError(f"unknown pool backend {name!r}; expected one of "
                         f"{', '.join(sorted(_REGISTRY))}")
    cls = entry.load()
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise TypeError(f"pool backend {entry.name!r}: {entry.target!r} is not a subclass of "
                        f"{Backend.__module__}.Backend")
    return cls
