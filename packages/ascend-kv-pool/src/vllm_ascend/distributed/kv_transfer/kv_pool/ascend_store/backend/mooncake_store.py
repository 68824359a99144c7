# SPDX-License-Identifier: Apache-2.0
"""Mooncake Store (``mooncake.store.MooncakeDistributedStore``) as the pool.

Configuration: the ``mooncake`` section of the extra config, else the JSON
file named by ``MOONCAKE_CONFIG_PATH`` (``metadata_server``,
``master_server_address``, ``global_segment_size``, ``local_buffer_size``,
``protocol``, ``device_name``). Every protocol works (upstream only set the
store up for ``ascend``). With ``metadata_server: "P2PHANDSHAKE"`` (or the
``ascend`` protocol) the store shares the process's transfer engine from
:func:`~vllm_ascend.distributed.kv_transfer.core.transfer_engine.get_transfer_engine`;
with an HTTP metadata server it starts its own.

Store quirks handled here: ``batch_get_into*`` return byte counts (turned into
0 or an error), a put larger than ``local_buffer_size`` fails with -600
(reported once, clearly), batches are chunked (:class:`~.base.ChunkedBackend`), and an unreachable master
(-900 and friends) raises :class:`BackendUnavailableError`. ``mooncake`` is
imported only when a backend is created.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, ClassVar

from vllm_ascend.distributed.kv_transfer.core.config.sizes import parse_size
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import MooncakeStoreConfig

from ..errors import BackendError, BackendUnavailableError
from .base import RC_ERROR, ChunkedBackend

logger = logging.getLogger(__name__)

#: Mooncake Store error codes (``mooncake-store/include/types.h``) seen by the pool.
MOONCAKE_ERRORS = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -200: "NO_AVAILABLE_HANDLE (the pool is full)",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS (e.g. an object larger than local_buffer_size, or a size mismatch)",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE (remove it with force=True)",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL (mooncake_master unreachable)",
    -1000: "ETCD_OPERATION_ERROR",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
}
#: Codes that mean the store as a whole is unreachable, not one key.
UNAVAILABLE_RCS = frozenset({-900, -1000, -1010})
RC_INVALID_PARAMS = -600



def _convert_to_bytes(number_str: str, multiplier: int, original_input: str) -> int:
    """``int(float(number_str) * multiplier)`` with clear errors.

    Raises:
        ValueError: ``number_str`` is not a number, or the result overflows.
    """
    try:
        return int(float(number_str) * multiplier)
    except ValueError as exc:
        raise ValueError(f"Invalid numeric value {number_str!r} in {original_input!r}") from exc
    except OverflowError as exc:
        raise ValueError(f"Storage size too large: {original_input!r}") from exc


def _parse_global_segment_size(value: Any) -> int:
    """Parse ``global_segment_size`` / ``local_buffer_size`` as upstream does.

    An ``int`` is bytes; a string is ``<number><gb|mb|kb|b>`` (1024-based,
    case-insensitive, spaces allowed, no unit = bytes); another type goes
    through ``int()``.

    Raises:
        ValueError: an empty or unparsable string (the message names it).
        TypeError: a value that is neither a string nor convertible by ``int()``.
    """
    if isinstance(value, bool):
        raise TypeError(f"Unsupported type for global_segment_size: bool ({value!r})")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("global_segment_size cannot be empty")
        # One size rule for the whole project (core.config.sizes); ConfigError is a ValueError.
        return parse_size(value, key="global_segment_size", source="Mooncake Store config")
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"Unsupported type for global_segment_size: "
                        f"{type(value).__name__} ({value!r})") from exc


def _probe_master(address: str, timeout: float = 3.0) -> None:
    """Fail fast when nothing listens at the master's address.

    ``MooncakeDistributedStore.setup`` waits about 90 s for a dead master;
    engine start-up should say what is wrong in seconds instead.
    """
    import socket

    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return
    except (OSError, ValueError) as exc:
        raise BackendUnavailableError(
            f"cannot reach mooncake_master at {address!r} ({exc}); start the master or fix "
            "master_server_address in the Mooncake Store config", backend="mooncake",
            op="setup") from exc


def describe_mooncake_rc(rc: int) -> str:
    """``"-704 OBJECT_NOT_FOUND"`` style text of a Mooncake return code."""
    return f"{rc} {MOONCAKE_ERRORS.get(rc, 'unknown Mooncake error')}"


class MooncakeBackend(ChunkedBackend):
    """The pool in a Mooncake Store.

    Args:
        parallel_config: vLLM's parallel config (unused beyond the upstream signature).
        config: the pool's ``AscendStoreConfig``; its ``mooncake`` section or
            ``MOONCAKE_CONFIG_PATH`` gives the store config.
        store_config: a :class:`MooncakeStoreConfig` (overrides ``config``).
        hostname: address to advertise (default: the host IP).

    Raises:
        DependencyError: ``mooncake`` is not installed.
        ConfigError: no or bad store configuration.
        BackendError: ``setup`` failed (return code and config in the message).
    """

    name: ClassVar[str] = "mooncake"

    def __init__(self, parallel_config: Any = None, *, config: Any = None,
                 store_config: MooncakeStoreConfig | None = None, hostname: str | None = None,
                 **kwargs: Any) -> None:
        if config is not None:
            kwargs.setdefault("max_batch_keys", config.max_batch_keys)
        super().__init__(parallel_config, **kwargs)
        from vllm_ascend.distributed.kv_transfer.core.net import get_host_ip
        from vllm_ascend.distributed.kv_transfer.core.transfer_engine import default_protocol
        from vllm_ascend.distributed.kv_transfer.core.vllm_compat import optional_dependency

        if store_config is None:
            store_config = (config.mooncake_store_config() if config is not None
                            else MooncakeStoreConfig.load_from_env())
        self.store_config = store_config
        _probe_master(store_config.master_server_address)
        module = optional_dependency("mooncake.store", extra="cpu", package="ascend-kv-pool",
                                     feature="the 'mooncake' pool backend (Mooncake Store; "
                                             "use the [cuda] or [npu] extra there)")
        self.protocol = store_config.protocol or default_protocol()
        self.hostname = hostname or get_host_ip()
        self._store = module.MooncakeDistributedStore()
        self._engine = None
        self._closed = False
        self._master_lost = False
        self._close_lock = threading.Lock()
        self._warned_too_large = False
        shared = (store_config.metadata_server.strip().upper() == "P2PHANDSHAKE"
                  or self.protocol == "ascend")
        if shared:
            from vllm_ascend.distributed.kv_transfer.core.transfer_engine import (
                get_transfer_engine,
            )

            self._engine = get_transfer_engine(self.hostname, self.protocol,
                                               device_name=store_config.device_name)
            local = self._engine.session_id
            rc = self._store.setup(local, store_config.metadata_server,
                                   store_config.global_segment_size,
                                   store_config.local_buffer_size, self.protocol,
                                   store_config.device_name, store_config.master_server_address,
                                   self._engine.raw.get_engine())
        else:
            local = self.hostname
            rc = self._store.setup(local, store_config.metadata_server,
                                   store_config.global_segment_size,
                                   store_config.local_buffer_size, self.protocol,
                                   store_config.device_name, store_config.master_server_address)
        if rc != 0:
            raise BackendError(
                f"Mooncake Store setup failed: rc={describe_mooncake_rc(rc)} (local {local}, "
                f"master {store_config.master_server_address}, metadata "
                f"{store_config.metadata_server!r}, protocol {self.protocol!r}, "
                f"global_segment_size {store_config.global_segment_size}, local_buffer_size "
                f"{store_config.local_buffer_size})", backend=self.name, op="setup", rc=rc)
        logger.info("Mooncake Store client up: %s -> master %s (protocol %s, %s engine)", local,
                    store_config.master_server_address, self.protocol,
                    "shared" if shared else "own")

    @property
    def store(self) -> Any:
        """The underlying ``MooncakeDistributedStore``."""
        return self._store

    # ------------------------------------------------------------ Backend
    def register_buffer(self, ptrs: list[int], lengths: list[int]) -> None:
        for ptr, length in zip(ptrs, lengths, strict=True):
            if self._engine is not None:
                self._engine.register_memory(ptr, length)
                continue
            rc = self._store.register_buffer(ptr, length)
            if rc != 0:
                raise BackendError(f"Mooncake Store register_buffer({ptr:#x}, {length}) failed: "
                                   f"rc={describe_mooncake_rc(rc)}", backend=self.name,
                                   op="register", rc=rc)

    def exists_chunk(self, keys: list[str]) -> list[int]:
        res = [int(r) for r in self._store.batch_is_exist(keys)]
        self._raise_if_unavailable("exists", res)
        self._master_lost = False
        return res

    def put_chunk(self, keys: list[str], addrs: list[list[int]],
                  sizes: list[list[int]]) -> list[int]:
        res = [int(r) for r in self._store.batch_put_from_multi_buffers(keys, addrs, sizes)]
        self._raise_if_unavailable("put", res)
        if RC_INVALID_PARAMS in res and not self._warned_too_large:
            i = res.index(RC_INVALID_PARAMS)
            logger.error("Mooncake Store refused to put %s (%d bytes): %s; is the object "
                         "larger than local_buffer_size (%d)?", keys[i], sum(sizes[i]),
                         describe_mooncake_rc(RC_INVALID_PARAMS),
                         self.store_config.local_buffer_size)
            self._warned_too_large = True
        return res

    def get_chunk(self, keys: list[str], addrs: list[list[int]],
                  sizes: list[list[int]]) -> list[int]:
        res = [int(r) for r in self._store.batch_get_into_multi_buffers(keys, addrs, sizes)]
        self._raise_if_unavailable("get", res)
        # get returns the bytes read; anything short is a failed load
        return [0 if r == sum(want) else (r if r < 0 else RC_ERROR)
                for r, want in zip(res, sizes, strict=False)]

    def remove(self, keys: list[str], *, force: bool = True) -> list[int]:
        """Remove keys (``force`` ignores leases, which otherwise give -706)."""
        return [int(r) for r in self._store.batch_remove(list(keys), force)]

    def health(self) -> int:
        """0 healthy, 1 not initialised or closed, 2 master unreachable."""
        return int(self._store.health_check())

    def close(self, timeout: float = 5.0) -> None:
        """Close the store.

        With a master that went away, ``close`` blocks for seconds while holding the
        GIL; it is skipped then (the process's exit releases the client).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._master_lost:
            logger.info("Mooncake Store master %s is gone; skipping the client's close",
                        self.store_config.master_server_address)
            return
        done = threading.Event()

        def _close() -> None:
            try:
                self._store.close()
            except Exception:  # closing must never take the engine down
                logger.debug("Mooncake Store close failed", exc_info=True)
            done.set()

        threading.Thread(target=_close, name="mooncake-store-close", daemon=True).start()
        if not done.wait(timeout):
            logger.warning("Mooncake Store close did not finish within %.1fs; left to a "
                           "daemon thread", timeout)

    def describe_rc(self, rc: int) -> str:
        return describe_mooncake_rc(rc)

    def _raise_if_unavailable(self, op: str, results: list[int]) -> None:
        bad = [r for r in results if r in UNAVAILABLE_RCS]
        if bad:
            self._master_lost = True
            raise BackendUnavailableError(
                f"Mooncake Store {op} failed: {describe_mooncake_rc(bad[0])} (master "
                f"{self.store_config.master_server_address})", backend=self.name, op=op,
                rc=bad[0])

    def __repr__(self) -> str:
        return (f"MooncakeBackend(master={self.store_config.master_server_address}, "
                f"protocol={self.protocol})")
