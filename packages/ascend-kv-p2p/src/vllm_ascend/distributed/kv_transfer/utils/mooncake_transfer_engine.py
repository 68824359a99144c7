# SPDX-License-Identifier: Apache-2.0
"""``GlobalTE`` / ``global_te``: upstream's one Mooncake transfer engine a process.

Upstream's P/D workers call ``global_te.get_transfer_engine(hostname,
device_name)`` and then ``global_te.register_buffer(ptrs, sizes)``. Here both go
through ascend-kv-core's engine (:func:`~vllm_ascend.distributed.kv_transfer.core.transfer_engine.get_transfer_engine`),
so this singleton, our connectors and the pool's Mooncake backend share one
engine and one set of registrations (reference counted: a range registered by
two users is registered with Mooncake once).

Differences from upstream, on purpose:

* the protocol is the device's (``ascend`` on NPU, ``rdma`` on CUDA, ``tcp``
  on CPU, or ``VLLM_ASCEND_KV_PROTOCOL``) instead of always ``ascend``;
* a failed initialisation or registration raises core's ``TransferError``
  (a ``RuntimeError``, as upstream's), naming the engine and the return code.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_ascend.distributed.kv_transfer.core.transfer_engine import MooncakeTransferEngine

logger = logging.getLogger(__name__)

__all__ = ["GlobalTE", "global_te"]


class GlobalTE:
    """Lazily created transfer engine plus once-only buffer registration.

    Attributes:
        transfer_engine: The raw ``mooncake.engine.TransferEngine`` once
            created (what upstream callers use: ``get_rpc_port()``,
            ``batch_transfer_sync_write``, ...), else ``None``.
        is_register_buffer: :meth:`register_buffer` has run.
    """

    def __init__(self) -> None:
        self.transfer_engine: Any = None
        self.is_register_buffer = False
        self.additional_registered_buffers: set[tuple[int, int]] = set()
        self._engine: MooncakeTransferEngine | None = None
        self.transfer_engine_lock = threading.Lock()
        self.register_buffer_lock = threading.Lock()

    @property
    def engine(self) -> MooncakeTransferEngine | None:
        """ascend-kv-core's checked wrapper of the engine (``None`` before creation)."""
        return self._engine

    def get_transfer_engine(self, hostname: str, device_name: str | None = None) -> Any:
        """The process's Mooncake engine, created on the first call (``P2PHANDSHAKE``).

        Args:
            hostname: Address the engine advertises and binds.
            device_name: RDMA / Ascend device name(s); ``None`` or ``""`` for auto.

        Returns:
            The raw ``mooncake.engine.TransferEngine``.

        Raises:
            ImportError: Mooncake is not installed (names the extra to install).
            TransferError: the engine failed to initialise.
        """
        if self.transfer_engine is None:
            with self.transfer_engine_lock:
                if self.transfer_engine is None:  # double-checked: one engine a process
                    from vllm_ascend.distributed.kv_transfer.core.transfer_engine import (
                        get_transfer_engine,
                    )

                    engine = get_transfer_engine(hostname, device_name=device_name or "")
                    self._engine = engine
                    self.transfer_engine = engine.raw
        return self.transfer_engine

    def _require_engine(self) -> MooncakeTransferEngine:
        if self._engine is None:
            raise RuntimeError("Transfer engine must be initialized: call "
                               "global_te.get_transfer_engine(hostname, device_name) first")
        return self._engine

    def register_buffer(self, ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        """Register the KV cache regions with the engine, once a process.

        Later calls return at once (upstream's ``is_register_buffer`` flag).

        Raises:
            RuntimeError: no engine yet.
            ValueError: ``ptrs`` and ``sizes`` differ in length.
            TransferError: the engine refused a region.
        """
        if len(ptrs) != len(sizes):
            raise ValueError(f"register_buffer: {len(ptrs)} pointers but {len(sizes)} sizes")
        with self.register_buffer_lock:
            engine = self._require_engine()
            if self.is_register_buffer:
                return
            for ptr, size in zip(ptrs, sizes, strict=True):
                engine.register_memory(int(ptr), int(size))
            self.is_register_buffer = True
            logger.debug("registered %d KV cache regions with the transfer engine", len(ptrs))

    def register_additional_buffer(self, ptrs: Sequence[int], sizes: Sequence[int]) -> None:
        """Register regions allocated after the KV cache; each ``(ptr, size)`` once.

        Raises:
            RuntimeError: no engine yet.
            ValueError: ``ptrs`` and ``sizes`` differ in length.
            TransferError: the engine refused a region.
        """
        if len(ptrs) != len(sizes):
            raise ValueError(f"register_additional_buffer: {len(ptrs)} pointers but "
                             f"{len(sizes)} sizes")
        with self.register_buffer_lock:
            engine = self._require_engine()
            for ptr, size in zip(ptrs, sizes, strict=True):
                region = (int(ptr), int(size))
                if region in self.additional_registered_buffers:
                    continue
                engine.register_memory(*region)
                self.additional_registered_buffers.add(region)


#: The process's instance, as upstream's module singleton.
global_te = GlobalTE()
