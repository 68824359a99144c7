# SPDX-License-Identifier: Apache-2.0
"""Worker side of the pool: the backend, the lookup server, loads and saves.

Per step the worker receives :class:`~.store_contract.AscendConnectorMetadata`:

* loads: synchronous ones run in ``start_load_kv`` (before the forward pass);
  ``load_async`` ones on the receive thread, reported through ``get_finished``;
  layerwise ones on the receive thread layer by layer, each awaited by
  ``wait_for_layer_load``. Blocks that fail to load are reported through
  ``get_block_ids_with_load_errors``; vLLM recomputes or fails the request per
  ``kv_load_failure_policy``.
* saves: after the forward pass (``wait_for_save``, or ``save_kv_layer`` per
  layer) the worker records a device event and queues the job on the send
  thread, which skips what the store already holds. A request whose saves
  are pending keeps its blocks (the scheduler delayed their free) until
  ``get_finished`` reports it; a preempted one is waited for in
  ``handle_preemptions`` before its blocks can be reused.

Addresses and block lengths come from core's :class:`KVCacheLayout`, so any
layout vLLM registers works. With vLLM's hybrid KV cache manager on, a layer of each KV cache
group shares one tensor: the layout keeps one of them, and a block id's bytes there are the
group's that owns the block, saved and loaded under that group's key. A failed load is
then reported by request (:meth:`KVPoolWorker.take_failed_loads`), and a step whose new
blocks a queued save of a sliding window still reads waits for it first
(``AscendConnectorMetadata.wait_saves``). A backend that needs host memory (``local``)
with a KV cache on a device goes through a host staging buffer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_ascend.distributed.kv_transfer.core.device import get_device
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.core.layout import KVCacheLayout, KVRegion
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import AscendStoreConfig

from .backend.base import Backend
from .backend.registry import backend_class
from .context import PoolContext
from .errors import BackendUnavailableError
from .events import PoolEvent, PoolEventLog, stored_blocks
from .keys import KeyMetadata, LayerPoolKey, PoolKey
from .lookup import LookupServer, lookup_endpoint
from .metrics import WORKER_METRICS
from .store_transfer import (
    LoadTask,
    PendingSaves,
    SaveTask,
    StoreGuard,
    TransferThread,
    merge_loads,
    merge_saves,
    run_load,
    run_save,
)

if TYPE_CHECKING:
    # the contract; at run time the worker needs no vLLM
    from .store_contract import AscendConnectorMetadata, TransferJob

logger = logging.getLogger(__name__)

#: Queued items of saves (one a step) merged into one store call at most.
MAX_MERGED_SAVES = 64


def create_backend(cfg: AscendStoreConfig, ctx: PoolContext, *, parallel_config: Any = None,
                   host_memory: bool = True) -> Backend:
    """The backend named by ``cfg.backend`` (:mod:`.backend.registry`), built by its own
    :meth:`~.backend.base.Backend.create`."""
    return backend_class(cfg.backend).create(cfg, ctx, parallel_config=parallel_config,
                                             host_memory=host_memory)


class KVPoolWorker:
    """Everything a worker does for the pool.

    Args:
        ctx: engine facts (ranks, model, block size).
        cfg: the pool configuration.
        backend: the store (default: created from ``cfg``).
        parallel_config: vLLM's parallel config, handed to the backend.
        start_lookup_server: serve the scheduler's lookups (default: on the lookup rank).
    """

    def __init__(self, ctx: PoolContext, cfg: AscendStoreConfig, *,
                 backend: Backend | None = None, parallel_config: Any = None,
                 start_lookup_server: bool | None = None) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.block_size = ctx.block_size
        self.key_meta = ctx.key_metadata()
        self.head_rank, self.put_step = ctx.head_rank_and_step()
        self.can_save = not ctx.is_consumer or cfg.consumer_is_to_put
        if ctx.is_consumer and cfg.consumer_is_to_put and cfg.prefill_pp_size != 1:
            # Upstream re-keys a consumer's saves per prefill pipeline stage; ours saves them
            # in its own layout, which a pipeline-parallel P would never hit: refuse it.
            raise ConfigError(
                f"kv_connector_extra_config: prefill_pp_size={cfg.prefill_pp_size} with "
                "consumer_is_to_put is not supported yet (saves are keyed for this "
                "instance's own layers; a pipeline-parallel prefill instance would not hit "
                "them): set prefill_pp_size to 1 or consumer_is_to_put to false",
                key="prefill_pp_size", value=cfg.prefill_pp_size,
                source="kv_connector_extra_config")
        self.use_layerwise = cfg.use_layerwise
        self.recorder = MetricsRecorder(WORKER_METRICS)
        self.guard = StoreGuard(cfg.store_retry_interval_s)
        self.backend = backend if backend is not None else create_backend(
            cfg, ctx, parallel_config=parallel_config)
        self.device = get_device("cpu")
        self.layout: KVCacheLayout | None = None
        self._staging = False
        self._layer_ids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._invalid_block_ids: set[int] = set()
        self._finished_recving: set[str] = set()
        # hybrid KV cache manager: requests whose load failed (vLLM takes no block ids there)
        self._failed_recving: set[str] = set()
        self._save_reqs: set[str] = set()
        self._finished_waiting: set[str] = set()
        self._pending = PendingSaves()
        # layerwise: per layer name, an event set when that layer's loads of this step are done
        self._layer_events: dict[str, threading.Event] = {}
        self._layer_loads: list[TransferJob] = []
        # the metadata of the step those layer loads belong to
        self._layer_meta: AscendConnectorMetadata | None = None
        # KV cache events (kv_events_config): what this rank stored, and what the store dropped
        self.events: PoolEventLog | None = None
        if ctx.kv_events:
            track = self.backend.supports_eviction_events()
            self.events = PoolEventLog(ctx.num_layers, track_removals=track)
            if track:
                self.backend.add_eviction_listener(self.events.evicted)
        self._send = TransferThread("ascend-store-send", self._run_save,
                                    maxsize=cfg.max_pending_saves,
                                    on_start=self.backend.set_device)
        self._recv = TransferThread("ascend-store-recv", self._run_load, maxsize=1 << 16,
                                    on_start=self.backend.set_device)
        self.lookup_server: LookupServer | None = None
        if start_lookup_server is None:
            start_lookup_server = ctx.is_lookup_rank
        if start_lookup_server:
            endpoint = lookup_endpoint(ctx.engine_id, ctx.dp_rank, cfg.lookup_rpc_port)
            self.lookup_server = LookupServer(endpoint, self.lookup_scheduler,
                                              self.lookup_groups)

    # ------------------------------------------------------------ registration
    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        """Describe vLLM's KV cache and register it with the backend."""
        layout = KVCacheLayout.from_kv_caches(kv_caches, block_size=self.block_size)
        self.layout = layout
        if self.events is not None:
            self.events.num_layers = layout.num_layers
        self._layer_ids = {layer.name: i for i, layer in enumerate(layout.layers)}
        first = layout.regions[0].tensor
        self.device = get_device(first.device.type, first.device.index or 0)
        self._staging = self.backend.host_memory_only and first.device.type != "cpu"
        if not self._staging:
            ranges = layout.memory_ranges()
            self.backend.register_buffer([a for a, _ in ranges], [n for _, n in ranges])
        logger.info("KV pool (%s) registered %d layers, %d blocks of %d bytes (layout %s%s)",
                    self.cfg.backend, layout.num_layers, layout.num_blocks, layout.block_bytes,
                    layout.kind, ", host staging" if self._staging else "")

    def _require_layout(self) -> KVCacheLayout:
        if self.layout is None:
            raise RuntimeError("KV pool worker used before register_kv_caches")
        return self.layout

    # ------------------------------------------------------------ keys
    def _key(self, chunk_hash: str, meta: KeyMetadata | None = None,
             group: int | None = None) -> str:
        return PoolKey(meta or self.key_meta, chunk_hash, group).to_string()

    def _layer_key(self, chunk_hash: str, layer_id: int, meta: KeyMetadata | None = None) -> str:
        return LayerPoolKey(meta or self.key_meta, chunk_hash, layer_id).to_string()

    def _regions(self, layer_id: int | None = None) -> Sequence[KVRegion]:
        layout = self._require_layout()
        if layer_id is None:
            return layout.regions
        return layout.layers[layer_id].regions

    def _block_value(self, block_id: int, layer_id: int | None = None
                     ) -> tuple[list[int], list[int]]:
        regions = self._regions(layer_id)
        return [r.block_addr(block_id) for r in regions], [r.block_len for r in regions]

    # ------------------------------------------------------------ lookup (rank 0)
    def lookup_scheduler(self, hashes: list[str], token_end: int) -> int:
        """Leading tokens of ``hashes`` held for every head group and PP stage."""
        if not hashes or not self.guard.available():
            return 0
        metas = [self.key_meta]
        if self.backend.shared_across_processes:
            metas = [self.key_meta.with_head(h).with_pp(p)
                     for h in range(self.ctx.num_head_groups()) for p in range(self.ctx.pp_size)]
        if self.use_layerwise:
            metas = list({m.with_pp(0) for m in metas})  # layer keys have no pp part
            layers = range(self.layout.num_layers if self.layout else self.ctx.num_layers)
            keys = [[self._layer_key(h, layer, m) for m in metas for layer in layers]
                    for h in hashes]
        else:
            keys = [[self._key(h, m) for m in metas] for h in hashes]
        flat = [k for per_block in keys for k in per_block]
        try:
            present = self.backend.exists(flat)
        except BackendUnavailableError as exc:
            self.guard.trip(exc)
            return 0
        except Exception:  # a lookup error is a miss
            logger.warning("KV pool lookup failed", exc_info=True)
            return 0
        width = len(keys[0])
        for i in range(len(hashes)):
            if any(p != 1 for p in present[i * width:(i + 1) * width]):
                return min(i * self.block_size, token_end)
        return token_end

    def lookup_groups(self, hashes: list[str], groups: list[int]) -> list[list[bool]]:
        """Per KV cache group, per hash: held for every head group and PP stage (hybrid KV
        cache manager; a store failure is a miss)."""
        known = {g.index for g in self.ctx.groups.groups}
        if not set(groups) <= known:
            raise ValueError(f"lookup of KV cache groups {sorted(set(groups) - known)}: this "
                             f"engine has {sorted(known)}")
        miss = [[False] * len(hashes) for _ in groups]
        if not hashes or not groups or not self.guard.available():
            return miss
        metas = [self.key_meta]
        if self.backend.shared_across_processes:
            metas = [self.key_meta.with_head(h).with_pp(p)
                     for h in range(self.ctx.num_head_groups()) for p in range(self.ctx.pp_size)]
        flat = [self._key(h, m, g) for g in groups for h in hashes for m in metas]
        try:
            present = self.backend.exists(flat)
        except BackendUnavailableError as exc:
            self.guard.trip(exc)
            return miss
        except Exception:  # a lookup error is a miss
            logger.warning("KV pool lookup failed", exc_info=True)
            return miss
        width = len(metas)
        rows: list[list[bool]] = []
        for gi in range(len(groups)):
            base = gi * len(hashes) * width
            rows.append([all(p == 1 for p in present[base + i * width:base + (i + 1) * width])
                         for i in range(len(hashes))])
        return rows

    # ------------------------------------------------------------ loads
    def start_load_kv(self, meta: AscendConnectorMetadata) -> None:
        """Start (or, for synchronous loads, run) this step's loads."""
        if meta.wait_saves:
            self._wait_saves(meta.wait_saves)
        self._layer_loads = []
        self._layer_events = {}
        self._layer_meta = meta
        loads = list(meta.loads)
        if not loads:
            return
        self._require_layout()
        if self.use_layerwise:
            self._start_layerwise_loads([j for j in loads if not j.is_async])
            loads = [j for j in loads if j.is_async]
        sync: list[LoadTask] = []
        by_request: dict[str, list[LoadTask]] = {}
        for job in loads:
            task = self._load_task(job)
            if job.is_async:  # one task a request (a job a KV cache group with HMA)
                by_request.setdefault(job.req_id, []).append(task)
            else:
                sync.append(task)
        for req_id, tasks in by_request.items():
            task = merge_loads(tasks)
            task.extra["is_async"] = True
            if not self._recv.submit(task):
                self._finish_load(req_id, {b for ids in task.block_ids for b in ids},
                                  is_async=True)
        if self._staging:
            for task in sync:
                self._run_load(task)
        elif sync:  # the step's loads in one get: one store round trip, not one a request
            self._run_load(merge_loads(sync))

    def _load_task(self, job: TransferJob, layer_id: int | None = None) -> LoadTask:
        keys, addrs, sizes, blocks = [], [], [], []
        for h, b in zip(job.hashes, job.block_ids, strict=True):
            keys.append(self._key(h, group=job.group) if layer_id is None
                        else self._layer_key(h, layer_id))
            a, s = self._block_value(b, layer_id)
            addrs.append(a)
            sizes.append(s)
            blocks.append([b])
        return LoadTask(job.req_id, keys, addrs, sizes, blocks, layer=layer_id,
                        extra={"is_async": job.is_async})

    def _run_load(self, task: LoadTask) -> None:
        if self._staging:
            failed = self._staged_load(task)
        else:
            failed = run_load(task, self.backend, self.guard, self.recorder)
        if task.layer is None:
            self._finish_load(task.req_id, failed, is_async=bool(task.extra.get("is_async")))
        else:
            with self._lock:
                self._invalid_block_ids.update(failed)

    def _finish_load(self, req_id: str, failed: set[int], *, is_async: bool) -> None:
        with self._lock:
            if failed and self.ctx.hybrid and is_async:
                self._failed_recving.add(req_id)
            else:
                self._invalid_block_ids.update(failed)
            if is_async:
                self._finished_recving.add(req_id)

    def _start_layerwise_loads(self, jobs: list[TransferJob]) -> None:
        layout = self._require_layout()
        if not jobs:
            return
        events = {layer.name: threading.Event() for layer in layout.layers}
        self._layer_events = events
        self._layer_loads = jobs

        def load_layers() -> None:
            for layer_id, layer in enumerate(layout.layers):
                tasks = [self._load_task(job, layer_id) for job in jobs]
                if self._staging:
                    for task in tasks:
                        self._run_load(task)
                else:  # the layer of every request of the step in one get
                    self._run_load(merge_loads(tasks))
                events[layer.name].set()

        threading.Thread(target=load_layers, name="ascend-store-layer-load", daemon=True).start()

    def wait_for_layer_load(self, layer_name: str,
                            meta: AscendConnectorMetadata | None = None) -> None:
        """Block until this step's loads of ``layer_name`` are done (layerwise).

        ``meta`` is the step's metadata: on a step without synchronous loads vLLM calls
        ``start_load_kv`` after the forward pass, so the layer loads known then are an
        earlier step's (done, or already reported as failed), never waited for again.
        """
        if meta is not None and meta is not self._layer_meta:
            return
        event = self._layer_events.get(layer_name)
        if event is None:
            return
        if not event.wait(self.cfg.load_timeout_s):
            logger.warning("KV pool: layer %s did not load within %.1fs; its blocks are "
                           "recomputed", layer_name, self.cfg.load_timeout_s)
            with self._lock:
                for job in self._layer_loads:
                    self._invalid_block_ids.update(job.block_ids)

    # ------------------------------------------------------------ saves
    def wait_for_save(self, meta: AscendConnectorMetadata) -> None:
        """Queue this step's saves (whole blocks; layerwise saves went out per layer)."""
        if not self.can_save or not meta.saves:
            return
        self._require_layout()
        with self._lock:
            # the scheduler holds these requests' blocks until get_finished reports them, even
            # if no layer of a layerwise step came to save_kv_layer
            self._save_reqs.update(job.req_id for job in meta.saves)
        if self.use_layerwise:
            return
        event = self.device.record_event()
        self._submit_saves([self._save_task(job, None, event) for job in meta.saves])

    def save_kv_layer(self, layer_name: str, meta: AscendConnectorMetadata) -> None:
        """Queue this step's saves of one layer (layerwise)."""
        if not self.can_save or not meta.saves:
            return
        layer_id = self._layer_ids.get(layer_name)
        if layer_id is None:
            return
        event = self.device.record_event()
        self._submit_saves([self._save_task(job, layer_id, event) for job in meta.saves])

    def _save_task(self, job: TransferJob, layer_id: int | None, event: Any) -> SaveTask | None:
        """The save of ``job``'s blocks this rank writes (``None`` when it writes none)."""
        # Ranks holding the same heads share keys: each saves every put_step-th block.
        offset = self.ctx.tp_rank % self.put_step
        indices = [i for i in range(len(job.hashes))
                   if (job.first_block + i) % self.put_step == offset]
        picked = [(job.hashes[i], job.block_ids[i]) for i in indices]
        with self._lock:
            self._save_reqs.add(job.req_id)
        if not picked:
            return None
        keys, addrs, sizes = [], [], []
        for h, b in picked:
            keys.append(self._key(h, group=job.group) if layer_id is None
                        else self._layer_key(h, layer_id))
            a, s = self._block_value(b, layer_id)
            addrs.append(a)
            sizes.append(s)
        task = SaveTask(job.req_id, keys, addrs, sizes, event,
                        block_ids=[b for _h, b in picked], layer=layer_id)
        if self.events is not None and job.events is not None:
            blocks = stored_blocks(job.events, job.first_block, indices, self.block_size,
                                   job.group)
            log = self.events
            task.on_done = lambda written, present: log.saved(task.keys, written, present,
                                                              blocks, layer_id)
        return task

    def _submit_saves(self, tasks: Sequence[SaveTask | None]) -> None:
        """Queue one step's saves as one item: the send thread saves them in one store call."""
        todo = [t for t in tasks if t is not None]
        if not todo:
            return
        for task in todo:
            self._pending.add(task.req_id)
        if not self._send.submit(todo if len(todo) > 1 else todo[0]):
            for task in todo:
                self._pending.done(task.req_id)
                self.recorder.inc("pool_dropped_save_blocks", len(task.keys), cause="queue_full")
        self.recorder.set("pool_pending_saves", self._pending.total())

    def _run_save(self, item: SaveTask | list[SaveTask]) -> None:
        """Run one queued item of saves, with the items queued behind it (not staged: one
        ``exists`` and one ``put`` for all of them)."""
        tasks = list(item) if isinstance(item, list) else [item]
        if not self._staging:
            for more in self._send.drain(MAX_MERGED_SAVES - 1):
                tasks.extend(more if isinstance(more, list) else [more])
        try:
            if self._staging:
                for task in tasks:
                    try:
                        self._staged_save(task)
                    except Exception:  # one failed copy must not cost the step's other saves
                        logger.exception("KV pool: staged save of %s failed", task.req_id)
            else:
                run_save(merge_saves(tasks), self.backend, self.guard, self.recorder)
        finally:
            for task in tasks:
                self._pending.done(task.req_id)
            self.recorder.set("pool_pending_saves", self._pending.total())

    # ------------------------------------------------------------ host staging
    def _staging_views(self, block_ids: list[int], layer_id: int | None
                       ) -> tuple[torch.Tensor, list[tuple[KVRegion, int, int]]]:
        regions = self._regions(layer_id)
        per_block = sum(r.block_len for r in regions)
        buf = torch.empty((len(block_ids), per_block), dtype=torch.uint8)
        spans, off = [], 0
        for r in regions:
            spans.append((r, off, r.block_len))
            off += r.block_len
        return buf, spans

    def _staged_save(self, task: SaveTask) -> None:
        from vllm_ascend.distributed.kernels import gather_blocks

        blocks = task.block_ids
        buf, spans = self._staging_views(blocks, task.layer)
        if task.event is not None:
            task.event.synchronize()
        for region, off, n in spans:
            # one gather on the device and one copy to the host per region
            rows = gather_blocks(region.tensor, blocks)
            buf[:, off:off + n].copy_(rows.reshape(len(blocks), -1).view(torch.uint8))
        base, row = buf.data_ptr(), buf.shape[1]
        task.addrs = [[base + i * row] for i in range(len(blocks))]
        task.sizes = [[row] for _ in blocks]
        run_save(task, self.backend, self.guard, self.recorder)

    def _staged_load(self, task: LoadTask) -> set[int]:
        from vllm_ascend.distributed.kernels import scatter_blocks

        blocks = [b[0] for b in task.block_ids]
        buf, spans = self._staging_views(blocks, task.layer)
        base, row = buf.data_ptr(), buf.shape[1]
        task.addrs = [[base + i * row] for i in range(len(blocks))]
        task.sizes = [[row] for _ in blocks]
        failed = run_load(task, self.backend, self.guard, self.recorder)
        good = [i for i, b in enumerate(blocks) if b not in failed]
        if not good:
            return failed
        ids = [blocks[i] for i in good]
        for region, off, n in spans:
            host = buf[good, off:off + n].contiguous()
            rows = host.to(region.tensor.device).view(region.tensor.dtype)
            scatter_blocks(rows.view(len(ids), *region.block_shape), region.tensor, ids)
        return failed

    # ------------------------------------------------------------ completion
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(saves finished, async loads finished)`` since the last call."""
        with self._lock:
            for req_id in finished_req_ids:
                if req_id in self._save_reqs:
                    self._finished_waiting.add(req_id)
            done_sending = {r for r in self._finished_waiting if not self._pending.has(r)}
            self._finished_waiting -= done_sending
            self._save_reqs -= done_sending
            done_recving, self._finished_recving = self._finished_recving, set()
        return done_sending, done_recving

    def take_events(self) -> list[PoolEvent] | None:
        """KV cache events since the last call; ``None`` when KV events are off."""
        return self.events.take() if self.events is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks that failed to load since the last call."""
        with self._lock:
            out, self._invalid_block_ids = self._invalid_block_ids, set()
        return out

    def take_failed_loads(self) -> set[str]:
        """Requests whose asynchronous load failed since the last call (hybrid KV cache
        manager: vLLM takes failed loads by request there, each also in ``get_finished``)."""
        with self._lock:
            out, self._failed_recving = self._failed_recving, set()
        return out

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        """Wait for the pending saves of preempted requests before their blocks are reused."""
        self._wait_saves(preempted_req_ids, "preempted requests")

    def _wait_saves(self, req_ids: set[str], who: str = "requests") -> None:
        """Wait for the pending saves of ``req_ids`` (blocks they read are given out again)."""
        waiting = {r for r in req_ids if self._pending.has(r)}
        if waiting and not self._pending.wait(waiting, self.cfg.load_timeout_s):
            logger.warning("KV pool: saves of %s %s still pending after %.1fs", who,
                           sorted(waiting), self.cfg.load_timeout_s)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until no save is pending (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._pending.total() and time.monotonic() < deadline:
            time.sleep(0.005)
        return self._pending.total() == 0

    def shutdown(self) -> None:
        """Stop the threads and the lookup server, close the backend."""
        if self.lookup_server is not None:
            self.lookup_server.close()
            self.lookup_server = None
        self._send.stop(timeout=5.0)
        self._recv.stop(timeout=5.0)
        self.backend.close()
