# SPDX-License-Identifier: Apache-2.0
"""The metadata server: one per instance, in the process of worker rank 0.

It owns the :class:`~.block_manager.HostBlockManager` and creates the host
segments once every rank has registered its layout (vLLM registers KV caches
in the workers before it builds the scheduler, so the workers are where the
pool can be sized). The scheduler asks it for matches, pins and save
allocations; ranks confirm their copies. It serves a ZeroMQ ROUTER socket
speaking :mod:`.protocol` through core's
:class:`~vllm_ascend.distributed.kv_transfer.core.channel.RpcServer`:
garbage, pickles and malformed messages get an error reply and the server
keeps serving; nothing received is ever unpickled.

:class:`MetadataServerProc` is upstream's entry point that runs it until told to stop
(upstream's path ``metadata.py`` re-exports both).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.channel import RpcServer
from vllm_ascend.distributed.kv_transfer.core.config.sizes import format_size
from vllm_ascend.distributed.kv_transfer.core.wire import Ack, ErrorReply, Message

from ..config import CPUOffloadConfig, get_cpu_offload_connector
from ..errors import OffloadError, OffloadProtocolError
from .block_manager import HostBlockManager
from .host_pool import HostSegment, plan_num_blocks, shm_dir
from .protocol import (
    Attached,
    GetPool,
    GetStats,
    Lookup,
    LookupReply,
    Pin,
    PinReply,
    PlannedSave,
    PlanReply,
    PlanStep,
    PoolInfo,
    RankGone,
    RegisterRank,
    Reset,
    ResetReply,
    SaveDone,
    StatsReply,
    make_codec,
)

logger = logging.getLogger(__name__)

SegmentKey = tuple[str, int]


class MetadataServer:
    """Host pool bookkeeping served over ZeroMQ.

    Args:
        endpoint: ``ipc://path`` or ``tcp://host:port`` (port 0 picks one).
        world_size: ranks of the instance (TP x PP) that must register.
        budget_bytes: host memory of the whole instance.
        save_ttl: lease of a save job (seconds).
        pin_ttl: lease of a pin (seconds).
        preallocate: reserve the segments' memory at creation.
        segment_dir: where segment files go (default :func:`.host_pool.shm_dir`).
        clock: monotonic clock of the leases (tests).
    """

    def __init__(self, endpoint: str, *, world_size: int, budget_bytes: int,
                 save_ttl: float = 120.0, pin_ttl: float = 60.0, preallocate: bool = True,
                 segment_dir: str | None = None, clock: Callable[[], float] | None = None,
                 name: str = "offload-metadata") -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.budget_bytes = budget_bytes
        self.save_ttl = save_ttl
        self.pin_ttl = pin_ttl
        self.preallocate = preallocate
        self.segment_dir = segment_dir or shm_dir()
        self._clock_kw: dict[str, Any] = {"clock": clock} if clock is not None else {}
        self._token = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._lock = threading.Lock()
        self._ranks: dict[int, RegisterRank] = {}
        self._attached: set[int] = set()
        self._segments: dict[SegmentKey, HostSegment] = {}
        self._pool_error: str | None = None
        self._reported_evictions = 0
        self._reported_expired = 0
        self.manager: HostBlockManager | None = None
        self.codec = make_codec()
        self._rpc: RpcServer[Message] = RpcServer(endpoint, self.codec, self._handle, name=name)
        self.endpoint = self._rpc.endpoint

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, *, endpoint: str | None = None
                         ) -> MetadataServer:
        """The server of an instance, as upstream builds it from the engine's config.

        Capacity, leases and the endpoint come from ``CPUOffloadingConnector``'s extra
        config (also when it is a child of a ``MultiConnector``); the world is TP x PP.

        Raises:
            ValueError: the config names no ``CPUOffloadingConnector``.
        """
        from ..contract import endpoint_for  # needs vLLM: only when built from its config

        kv = get_cpu_offload_connector(vllm_config)
        if kv is None:
            raise ValueError("kv_transfer_config names no CPUOffloadingConnector (directly or "
                             "as a MultiConnector child)")
        extra = getattr(kv, "kv_connector_extra_config", None) or {}
        cfg = CPUOffloadConfig.from_dict(
            extra, source="kv_connector_extra_config of CPUOffloadingConnector")
        parallel = vllm_config.parallel_config
        world = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
        return cls(endpoint or endpoint_for(vllm_config, cfg), world_size=world,
                   budget_bytes=cfg.swap_space_bytes, save_ttl=cfg.save_timeout_s,
                   preallocate=cfg.preallocate)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> MetadataServer:
        """Serve on a daemon thread; returns ``self``."""
        self._rpc.start()
        logger.debug("offload metadata server on %s (world size %d)", self.endpoint,
                     self.world_size)
        return self

    def stop(self) -> None:
        """Stop serving, unmap and remove the segments and the socket file."""
        self._rpc.stop()  # removes its socket file, if still its own
        with self._lock:
            for seg in self._segments.values():
                seg.unlink()
                seg.close()
            self._segments.clear()

    def shutdown(self) -> None:
        """Upstream's name for :meth:`stop`."""
        self.stop()

    @property
    def rpc_stats(self) -> dict[str, int]:
        """Requests, bad messages and handler errors seen by the socket."""
        return dict(self._rpc.stats)

    @property
    def ready(self) -> bool:
        """True once the pool exists."""
        return self.manager is not None

    # ------------------------------------------------------------------ dispatch
    def _handle(self, msg: Message) -> Message:
        with self._lock:
            if self.manager is not None:
                self.manager.expire()
            try:
                return self._dispatch(msg)
            except OffloadProtocolError as exc:
                logger.warning("offload metadata server rejected %s: %s", type(msg).__name__, exc)
                return ErrorReply(code="bad_request", message=str(exc))

    def _dispatch(self, msg: Message) -> Message:
        if isinstance(msg, Lookup):
            return LookupReply(num_blocks=self.manager.match(msg.hashes) if self.manager else 0)
        if isinstance(msg, PlanStep):
            return self._plan(msg)
        if isinstance(msg, Pin):
            if self.manager is None:
                return PinReply(block_ids=[])
            return PinReply(block_ids=self.manager.pin(msg.key, msg.hashes, owner=msg.owner))
        if isinstance(msg, SaveDone):
            self._check_rank(msg.rank)
            manager = self._require_manager()
            for job_id in msg.job_ids:
                manager.finish_save(job_id, msg.rank)
            for job_id in msg.failed:
                manager.fail_save(job_id)
            return Ack()
        if isinstance(msg, RegisterRank):
            return self._register(msg)
        if isinstance(msg, GetPool):
            return self._pool_info(msg.rank)
        if isinstance(msg, Attached):
            return self._on_attached(msg.rank)
        if isinstance(msg, RankGone):
            self._check_rank(msg.rank)
            if self.manager is not None:
                dropped = self.manager.drop_rank(msg.rank)
                if dropped:
                    logger.info("rank %d left; abandoned %d save jobs", msg.rank, dropped)
            return Ack()
        if isinstance(msg, Reset):
            return ResetReply(freed=self.manager.reset() if self.manager else 0)
        if isinstance(msg, GetStats):
            return self._stats()
        raise OffloadProtocolError(f"{type(msg).__name__} is not a request of this server")

    # ------------------------------------------------------------------ ranks
    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise OffloadProtocolError(f"rank {rank} is outside this instance's world of "
                                       f"{self.world_size}")

    def _require_manager(self) -> HostBlockManager:
        if self.manager is None:
            raise OffloadProtocolError("the host pool is not ready: not every rank registered")
        return self.manager

    def _register(self, msg: RegisterRank) -> Message:
        self._check_rank(msg.rank)
        if msg.world_size != self.world_size:
            raise OffloadProtocolError(f"rank {msg.rank} says the world has {msg.world_size} "
                                       f"ranks; this server serves {self.world_size}")
        if msg.tp_size * msg.pp_size != msg.world_size:
            raise OffloadProtocolError(f"rank {msg.rank}: tp_size {msg.tp_size} x pp_size "
                                       f"{msg.pp_size} != world_size {msg.world_size}")
        if msg.tp_rank >= msg.tp_size or msg.pp_rank >= msg.pp_size:
            raise OffloadProtocolError(f"rank {msg.rank}: tp_rank {msg.tp_rank}/{msg.tp_size} or "
                                       f"pp_rank {msg.pp_rank}/{msg.pp_size} out of range")
        if not msg.layer_block_bytes or len(msg.layer_block_bytes) != len(msg.layer_names):
            raise OffloadProtocolError(
                f"rank {msg.rank} registered {len(msg.layer_names)} layer names and "
                f"{len(msg.layer_block_bytes)} block sizes; need one size per layer, at least one")
        known = self._ranks.get(msg.rank)
        if known is not None:
            if known != msg:
                raise OffloadProtocolError(f"rank {msg.rank} registered again with a different "
                                           "layout")
            return self._pool_info(msg.rank)
        if self.manager is not None:
            raise OffloadProtocolError(f"rank {msg.rank} registered after the pool was built")
        others = list(self._ranks.values())
        if others and others[0].is_mla != msg.is_mla:
            raise OffloadProtocolError(f"rank {msg.rank} says is_mla={msg.is_mla}, rank "
                                       f"{others[0].rank} said {others[0].is_mla}")
        self._ranks[msg.rank] = msg
        if len(self._ranks) == self.world_size:
            self._build_pool()
        return self._pool_info(msg.rank)

    def _segment_key(self, reg: RegisterRank) -> SegmentKey:
        return ("pp", reg.pp_rank) if reg.is_mla else ("rank", reg.rank)

    def _build_pool(self) -> None:
        layouts: dict[SegmentKey, list[int]] = {}
        for reg in sorted(self._ranks.values(), key=lambda r: r.rank):
            key = self._segment_key(reg)
            if key in layouts and layouts[key] != list(reg.layer_block_bytes):
                self._pool_error = (f"MLA ranks of pipeline stage {reg.pp_rank} registered "
                                    "different layouts; they must be identical")
                logger.error("%s", self._pool_error)
                return
            layouts[key] = list(reg.layer_block_bytes)
        try:
            num_blocks = plan_num_blocks(self.budget_bytes, list(layouts.values()))
            manager = HostBlockManager(num_blocks, save_ttl=self.save_ttl, pin_ttl=self.pin_ttl,
                                       **self._clock_kw)
            for key, block_bytes in layouts.items():
                path = os.path.join(self.segment_dir, f"vakv-offload-{self._token}-{key[0]}{key[1]}")
                self._segments[key] = HostSegment.create(path, num_blocks, block_bytes,
                                                         preallocate=self.preallocate)
        except OffloadError as exc:
            for seg in self._segments.values():
                seg.unlink()
                seg.close()
            self._segments.clear()
            self._pool_error = str(exc)
            logger.error("host pool not created: %s", exc)
            return
        self.manager = manager
        per_block = sum(sum(b) for b in layouts.values())
        logger.info("CPU offload host pool: %d blocks of %s (all ranks), %s in %d segment(s)",
                    num_blocks, format_size(per_block),
                    format_size(sum(s.nbytes for s in self._segments.values())),
                    len(self._segments))

    def _pool_info(self, rank: int) -> Message:
        self._check_rank(rank)
        if self._pool_error is not None:
            return ErrorReply(code="pool_failed", message=self._pool_error)
        reg = self._ranks.get(rank)
        if reg is None:
            raise OffloadProtocolError(f"rank {rank} asked for its segment before registering")
        if self.manager is None:
            return PoolInfo(ready=False)
        seg = self._segments[self._segment_key(reg)]
        return PoolInfo(ready=True, num_blocks=seg.num_blocks, segment_path=seg.path,
                        layer_block_bytes=list(seg.layer_block_bytes), shared=reg.is_mla)

    def _on_attached(self, rank: int) -> Message:
        self._check_rank(rank)
        if rank not in self._ranks:
            raise OffloadProtocolError(f"rank {rank} attached before registering")
        self._attached.add(rank)
        if len(self._attached) == self.world_size:
            # every rank mapped its segment: the memory now lives as long as the mappings
            for seg in self._segments.values():
                seg.unlink()
        return Ack()

    # ------------------------------------------------------------------ scheduler
    def _plan(self, msg: PlanStep) -> Message:
        if self.manager is None:
            return PlanReply(saves=[])
        manager = self.manager
        ranks = range(self.world_size)
        planned: list[PlannedSave] = []
        for req in msg.saves:
            job = manager.start_save(req.hashes, ranks=ranks, owner=msg.owner)
            planned.append(PlannedSave(key=req.key, job_id=job.job_id, positions=job.positions,
                                       block_ids=job.block_ids))
        for key in msg.unpin:
            manager.unpin(key)
        evictions = manager.stats.evictions - self._reported_evictions
        self._reported_evictions = manager.stats.evictions
        expired = manager.stats.expired_jobs - self._reported_expired
        self._reported_expired = manager.stats.expired_jobs
        return PlanReply(saves=planned, evictions=evictions, used_blocks=manager.num_used,
                         total_blocks=manager.num_blocks, expired_saves=expired)

    def _stats(self) -> StatsReply:
        m = self.manager
        if m is None:
            return StatsReply(ready=False, registered_ranks=sorted(self._ranks))
        pinned = m.num_cached - m.num_evictable
        return StatsReply(ready=True, total_blocks=m.num_blocks, free_blocks=m.num_free,
                          cached_blocks=m.num_cached, pending_blocks=m.num_pending,
                          pinned_blocks=pinned, evictions=m.stats.evictions,
                          committed_blocks=m.stats.committed_blocks,
                          aborted_blocks=m.stats.aborted_blocks,
                          expired_jobs=m.stats.expired_jobs, expired_pins=m.stats.expired_pins,
                          registered_ranks=sorted(self._ranks))


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
