# SPDX-License-Identifier: Apache-2.0
"""Memcache (``memcache_hybrid.DistributedObjectStore``, Ascend memfabric) as the pool.

``memcache_hybrid`` is imported when the backend is created. Its data path
needs an Ascend driver, so the tests run this module against the fake in
``ascend_kv_testing.fake_memcache``, which keeps the real method names,
signatures and return codes. The store is configured by memcache's own files
(``MMC_META_CONFIG_PATH`` / ``MMC_LOCAL_CONFIG_PATH``), as upstream.

Device generations differ as upstream: on A2 every rank takes part in one
all-gather before ``init`` and registers its KV buffers; elsewhere ``init``
alone and no registration.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import BackendError
from .base import ChunkedBackend

if TYPE_CHECKING:
    from ..context import PoolContext

logger = logging.getLogger(__name__)


class MmcDirect(enum.Enum):
    """Copy direction of memcache's layer calls (``memcache_hybrid.L2G`` ...)."""

    COPY_L2G = 0  # device (local HBM) -> global pool
    COPY_G2L = 1  # global pool -> device
    COPY_G2H = 2  # global pool -> host memory
    COPY_H2G = 3  # host memory -> global pool


def detect_device_type() -> str:
    """``a2``, ``a3`` or ``other``, from the NPU's name (``other`` without an NPU)."""
    try:
        import torch

        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return "other"
        name = str(npu.get_device_name(0))
    except Exception:  # no NPU runtime: not an A2/A3
        return "other"
    if "910_93" in name:
        return "a3"
    if "910B" in name:
        return "a2"
    return "other"


class MemcacheBackend(ChunkedBackend):
    """The pool in memcache.

    Args:
        parallel_config: vLLM's parallel config; ``rank`` is the default device id.
        config: the pool's ``AscendStoreConfig`` (``memcache_device_type``).
        device_id: device handed to ``init`` (default: ``parallel_config.rank`` or 0).
        host_memory: the KV cache lives in host memory (CPU), so copies use H2G/G2H.

    Raises:
        DependencyError: ``memcache_hybrid`` is not installed.
        BackendError: ``init`` or ``register_buffer`` failed.
    """

    name: ClassVar[str] = "memcache"

    def __init__(self, parallel_config: Any = None, *, config: Any = None,
                 device_id: int | None = None, host_memory: bool = False,
                 **kwargs: Any) -> None:
        if config is not None:
            kwargs.setdefault("max_batch_keys", config.max_batch_keys)
        super().__init__(parallel_config, **kwargs)
        from vllm_ascend.distributed.kv_transfer.core.vllm_compat import optional_dependency

        module = optional_dependency(
            "memcache_hybrid", extra="memcache", package="ascend-kv-pool",
            feature="the 'memcache' pool backend (memfabric, "
                    "https://gitee.com/ascend/memfabric_hybrid)")
        kind = getattr(config, "memcache_device_type", "auto") if config is not None else "auto"
        self.device_type = detect_device_type() if kind == "auto" else kind
        if device_id is None:
            device_id = int(getattr(parallel_config, "rank", 0) or 0)
        self.device_id = device_id
        self._put_direct = (MmcDirect.COPY_H2G if host_memory else MmcDirect.COPY_L2G).value
        self._get_direct = (MmcDirect.COPY_G2H if host_memory else MmcDirect.COPY_G2L).value
        if self.device_type == "a2":
            _all_gather_barrier()
        self._store = module.DistributedObjectStore()
        rc = self._store.init(device_id)
        if rc != 0:
            raise BackendError(
                f"memcache DistributedObjectStore.init({device_id}) failed: rc={rc} (is the "
                "meta service up, and MMC_META_CONFIG_PATH / MMC_LOCAL_CONFIG_PATH set? the "
                "data path needs an Ascend driver)", backend=self.name, op="init", rc=rc)
        self._closed = False

    @classmethod
    def create(cls, cfg: Any, ctx: PoolContext, *, parallel_config: Any = None,
               host_memory: bool = True) -> MemcacheBackend:
        """The worker's backend: its device is the rank's index within the TP x PP group."""
        return cls(parallel_config, config=cfg, device_id=ctx.tp_rank + ctx.pp_rank * ctx.tp_size,
                   host_memory=host_memory)

    @property
    def store(self) -> Any:
        """The underlying ``DistributedObjectStore``."""
        return self._store

    def register_buffer(self, ptrs: list[int], lengths: list[int]) -> None:
        if self.device_type != "a2":
            return  # only A2 registers buffers with memcache
        for ptr, length in zip(ptrs, lengths, strict=True):
            rc = self._store.register_buffer(ptr, length)
            if rc != 0:
                raise BackendError(f"memcache register_buffer({ptr:#x}, {length}) failed: "
                                   f"rc={rc}", backend=self.name, op="register", rc=rc)

    def exists_chunk(self, keys: list[str]) -> list[int]:
        return [int(r) for r in self._store.batch_is_exist(keys)]

    def put_chunk(self, keys: list[str], addrs: list[list[int]],
                  sizes: list[list[int]]) -> list[int]:
        return _per_key(self._store.batch_put_from_layers(keys, addrs, sizes, self._put_direct),
                        len(keys))

    def get_chunk(self, keys: list[str], addrs: list[list[int]],
                  sizes: list[list[int]]) -> list[int]:
        return _per_key(self._store.batch_get_into_layers(keys, addrs, sizes, self._get_direct),
                        len(keys))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._store.close()
            except Exception:  # closing must never take the engine down
                logger.debug("memcache close failed", exc_info=True)

    def __repr__(self) -> str:
        return f"MemcacheBackend(device_id={self.device_id}, device_type={self.device_type})"


def _per_key(res: Any, n: int) -> list[int]:
    """Per-key codes from a batch call (a list, or one code for the whole batch of ``n``)."""
    if isinstance(res, int):
        return [int(res)] * n
    return [int(r) for r in res]


def _all_gather_barrier() -> None:
    """A2: every rank joins one all-gather before ``init`` (as upstream), if torch.distributed is up."""
    try:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return
        t = torch.zeros(1)
        out = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t)
    except Exception:  # the barrier only orders init calls; never fatal
        logger.warning("memcache: the all-gather before init failed", exc_info=True)
