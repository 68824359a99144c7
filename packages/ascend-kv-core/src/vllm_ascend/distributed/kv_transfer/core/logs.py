# SPDX-License-Identifier: Apache-2.0
"""Our loggers in a vLLM process write where, and as, vLLM's do.

Every module here logs to ``logging.getLogger(__name__)``: loggers under
``vllm_ascend.distributed``, outside vLLM's ``vllm`` logger. vLLM configures only its own
logger (a stream handler with the process prefix and a timestamp, level
``VLLM_LOGGING_LEVEL``). Left alone, an engine printed our warnings through Python's
last-resort handler, bare (no time, no process), and dropped our INFO lines.

:func:`follow_vllm_logging` puts a :class:`ToVllmHandler` on the namespace's logger, once,
in every process that registers a connector (the ``vllm.general_plugins`` entry points run
in each vLLM process), and sets its level to ``VLLM_LOGGING_LEVEL``. The handler hands each
record to the handlers vLLM's logger has at that moment (vLLM configures logging after the
plugins load in some processes, and again in its children). Nothing changes where someone
configured our logger (a handler or a level of its own) or turned vLLM's logging off
(``VLLM_CONFIGURE_LOGGING=0``). Records still propagate: an application's root handlers see
them as before.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

__all__ = ["NAMESPACE", "ToVllmHandler", "follow_vllm_logging"]

#: the logger every module of this project logs under
NAMESPACE = "vllm_ascend.distributed"

_lock = threading.Lock()


class ToVllmHandler(logging.Handler):
    """Hands a record to the handlers of vLLM's ``vllm`` logger (each applies its own level
    and format). With none there and none on the root logger either, a WARNING or worse goes
    to Python's last-resort handler, as it did before this handler was attached."""

    def __init__(self, target: str = "vllm") -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        handlers = logging.getLogger(self.target).handlers
        for handler in handlers:
            if record.levelno >= handler.level:
                handler.handle(record)
        if not handlers and not logging.getLogger().handlers \
                and logging.lastResort is not None and record.levelno >= logging.lastResort.level:
            logging.lastResort.handle(record)


def follow_vllm_logging(env: Mapping[str, str] | None = None) -> bool:
    """Attach a :class:`ToVllmHandler` to :data:`NAMESPACE`'s logger; True if it did now.

    Args:
        env: the environment to read ``VLLM_CONFIGURE_LOGGING`` and ``VLLM_LOGGING_LEVEL``
            from (``os.environ`` when None).
    """
    if env is None:
        env = os.environ
    if env.get("VLLM_CONFIGURE_LOGGING", "1").strip() == "0":
        return False
    level = logging.getLevelName(env.get("VLLM_LOGGING_LEVEL", "INFO").strip().upper())
    ours = logging.getLogger(NAMESPACE)
    with _lock:
        if ours.handlers or ours.level != logging.NOTSET:
            return False
        ours.addHandler(ToVllmHandler())
        ours.setLevel(level if isinstance(level, int) else logging.INFO)
    return True
