# SPDX-License-Identifier: Apache-2.0
"""Worker side of ``CPUOffloadingConnector``: the copies.

* ``register_kv_caches``: describe the cache (:class:`core.layout.KVCacheLayout`),
  start the metadata server on rank 0, register this rank's layout, map the
  host segment the server created.
* Loads, layer by layer: ``start_load_kv`` queues every layer's copies on the
  *load stream* (after the compute stream, whose previous step may still use
  the target blocks) and records one event per layer; ``wait_for_layer_load``
  makes the compute stream wait for that layer's event only, so layer ``L+1``
  loads while layer ``L`` computes. A block whose last token the step
  recomputes (a full prompt hit) is copied on the compute stream before the
  forward instead, so the recomputed token is written after the copy.
* Saves, in the background: ``wait_for_save`` records an event at the end of
  the forward and hands the step's save jobs to a thread, which queues the
  copies on the *save stream* behind that event, waits for them, and confirms
  the jobs to the metadata server. The step does not wait. MLA caches (equal
  on every TP rank) are saved in stripes: each TP rank copies the blocks whose
  host id is its rank modulo the TP size.
* ``get_finished`` reports a finished request once its saves are done (the
  scheduler held its blocks until then); ``handle_preemptions`` waits for
  in-flight saves before a preempted request's blocks can be reused.

Under vLLM's hybrid KV cache manager (several KV cache groups) a host block holds one
group's block (a layer of each group shares one device tensor, which the layout moves
once), loads are asynchronous: copied on the load stream, reported through
``get_finished`` once done, a failed one by request (vLLM takes no block ids there). A
step whose new blocks a queued save of a sliding window still reads finishes those saves
first (``wait_saves``).

On CPU, streams and events are synchronous stand-ins (:mod:`core.device`):
loads complete inside ``start_load_kv``; saves still run on the background
thread.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_ascend.distributed.kv_transfer.core.device import Device, device_of
from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError
from vllm_ascend.distributed.kv_transfer.core.layout import KVCacheLayout
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.ranks import RankInfo, rank_info_from_vllm
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.config import CPUOffloadConfig

from .blockcopy import block_rows, check_ids, copy_blocks, copy_blocks_all
from .contract import (
    CPUOffloadingConnectorMetadata,
    HostLoad,
    HostSave,
    block_size_of,
    endpoint_for,
)
from .cpu_offload_manager.client import MetadataClient, ServerUnavailable
from .cpu_offload_manager.host_pool import HostSegment
from .cpu_offload_manager.protocol import RegisterRank
from .cpu_offload_manager.server import MetadataServer

logger = logging.getLogger(__name__)


@dataclass
class _LayerCopy:
    """One layer: the device block rows of each region and where they sit in a host row."""

    name: str
    host: torch.Tensor
    parts: list[tuple[torch.Tensor, int, int]]  # (device rows, host offset, bytes)


@dataclass
class _SaveBatch:
    event: Any
    jobs: list[HostSave]


_STOP = object()


class CPUOffloadWorker:
    """Worker-side logic (one per rank).

    Args:
        vllm_config: the engine's config.
        cfg: the connector's parsed extra config.
        kv_cache_config: vLLM's KV cache config.
        recorder: where metrics go.
        rank_info: TP/PP position (default: from vLLM's parallel state at registration).
        endpoint: metadata server endpoint (default: derived from the engine id).
    """

    def __init__(self, vllm_config: Any, cfg: CPUOffloadConfig, kv_cache_config: Any,
                 recorder: MetricsRecorder, *, rank_info: RankInfo | None = None,
                 endpoint: str | None = None) -> None:
        self.cfg = cfg
        self.block_size = block_size_of(vllm_config, kv_cache_config)
        self.recorder = recorder
        self._rank_info = rank_info
        self.endpoint = endpoint or endpoint_for(vllm_config, cfg)
        self.server: MetadataServer | None = None
        self.client: MetadataClient | None = None
        self.segment: HostSegment | None = None
        self.layout: KVCacheLayout | None = None
        self.device: Device | None = None
        self._layers: list[_LayerCopy] = []
        self._layer_index: dict[str, int] = {}
        #: per region kind (K, V, ...): every layer's device rows and host rows
        self._kinds: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._load_stream: Any = None
        self._save_stream: Any = None
        self._layer_events: dict[str, Any] = {}
        self._load_errors: set[int] = set()
        #: asynchronous loads copied or being copied: (event, request ids, failed ones)
        self._async_loads: list[tuple[Any, list[str], set[str]]] = []
        self._failed_recving: set[str] = set()
        self._lock = threading.Lock()
        self._save_reqs: set[str] = set()
        self._outstanding: dict[str, int] = defaultdict(int)
        self._finishing: set[str] = set()
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._shared = False
        #: :func:`.blockcopy.copy_blocks` path; ``auto`` picks memmove on CPU, staged elsewhere
        self.copy_path = "auto"

    @property
    def rank_info(self) -> RankInfo:
        """TP/PP position of this worker."""
        if self._rank_info is None:
            self._rank_info = rank_info_from_vllm()
        return self._rank_info

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Describe the cache, join the instance's host pool and map this rank's segment."""
        layout = KVCacheLayout.from_kv_caches(kv_caches, block_size=self.block_size)
        self.layout = layout
        first = layout.layers[0].regions[0].tensor
        self.device = device_of(first)
        ri = self.rank_info
        if ri.rank == 0:
            self.server = MetadataServer(
                self.endpoint, world_size=ri.world_size, budget_bytes=self.cfg.swap_space_bytes,
                save_ttl=self.cfg.save_timeout_s, preallocate=self.cfg.preallocate).start()
        self.client = MetadataClient(self.endpoint, timeout_s=self.cfg.rpc_timeout_s,
                                     retry_after_s=self.cfg.retry_after_s)
        layer_bytes = [sum(r.block_len for r in layer.regions) for layer in layout.layers]
        reg = RegisterRank(rank=ri.rank, world_size=ri.world_size, tp_rank=ri.tp_rank,
                           tp_size=ri.tp_size, pp_rank=ri.pp_rank, pp_size=ri.pp_size,
                           is_mla=layout.is_mla, layer_names=[lay.name for lay in layout.layers],
                           layer_block_bytes=layer_bytes)
        try:
            info = self.client.register(reg, timeout_s=self.cfg.init_timeout_s)
            self.segment = HostSegment.attach(info.segment_path, info.num_blocks,
                                              info.layer_block_bytes)
            self.client.attached(ri.rank)
        except BaseException:
            self.shutdown()
            raise
        self._shared = info.shared
        self._layers = []
        for index, (layer, host) in enumerate(zip(layout.layers, self.segment.layers, strict=True)):
            parts = []
            offset = 0
            for region in layer.regions:
                parts.append((block_rows(region.tensor), offset, region.block_len))
                offset += region.block_len
            self._layers.append(_LayerCopy(layer.name, host, parts))
            self._layer_index[layer.name] = index
        # region kind by kind (K of every layer, then V, ...): the regions of one kind sit
        # at equal distances in the host pool, so on CPU one call moves a run of host
        # blocks of every layer
        self._kinds = []
        for r in range(max(len(lay.parts) for lay in self._layers)):
            dev_rows, host_rows = [], []
            for lay in self._layers:
                if r < len(lay.parts):
                    rows, off, length = lay.parts[r]
                    dev_rows.append(rows)
                    host_rows.append(lay.host[:, off:off + length])
            self._kinds.append((dev_rows, host_rows))
        _maybe_pin_host(self.device, self.segment)
        self._load_stream = self.device.new_stream()
        self._save_stream = self.device.new_stream()
        self._thread = threading.Thread(target=self._save_loop, name="offload-save", daemon=True)
        self._thread.start()
        logger.info("CPU offload rank %d/%d: %d layers, %d host blocks of %d bytes, %s layout",
                    ri.rank, ri.world_size, len(self._layers), info.num_blocks,
                    sum(layer_bytes), layout.kind)

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host pool (0 before registration)."""
        return self.segment.num_blocks if self.segment is not None else 0

    # ------------------------------------------------------------------ loads
    def start_load_kv(self, meta: CPUOffloadingConnectorMetadata) -> None:
        """Queue this step's loads; tails of full prompt hits are copied right away."""
        self._layer_events.clear()
        if meta.wait_saves:
            self._finish_saves(meta.wait_saves)
        if any(load.is_async for load in meta.loads):
            self._load_async([load for load in meta.loads if load.is_async])
            meta = CPUOffloadingConnectorMetadata(
                loads=[load for load in meta.loads if not load.is_async])
        for load in meta.loads:
            if load.failed_ids:
                self.recorder.inc("offload_failures", op="load")
                self._load_errors.update(load.failed_ids)
        if not meta.loads or self.device is None:
            return
        assert self.layout is not None and self.segment is not None
        device = self.device
        num_host = self.segment.num_blocks
        host_ids: list[int] = []
        dev_ids: list[int] = []
        tail_host: list[int] = []
        tail_dev: list[int] = []
        for load in meta.loads:
            if not load.host_ids and not load.device_ids:
                continue
            if not self._valid_load(load, num_host):
                continue
            if load.sync_tail:
                host_ids += load.host_ids[:-1]
                dev_ids += load.device_ids[:-1]
                tail_host.append(load.host_ids[-1])
                tail_dev.append(load.device_ids[-1])
            else:
                host_ids += load.host_ids
                dev_ids += load.device_ids
        if not host_ids and not tail_host:
            return
        start = time.perf_counter()
        nb = device.kind != "cpu"
        nbytes = 0
        try:
            # CPU memory on both sides: each step below moves every layer in one call
            # (the per-layer events then stand for copies already done)
            batched = self._batched()
            if tail_host:
                # on the compute stream: ordered before the forward that rewrites one token
                if batched:
                    nbytes += self._copy_in_all(tail_host, tail_dev, nb)
                else:
                    for layer in self._layers:
                        nbytes += self._copy_in(layer, tail_host, tail_dev, nb)
            if host_ids:
                current = device.current_stream()
                with device.stream(self._load_stream):
                    self._load_stream.wait_stream(current)
                    if batched:
                        nbytes += self._copy_in_all(host_ids, dev_ids, nb)
                    for layer in self._layers:
                        if not batched:
                            nbytes += self._copy_in(layer, host_ids, dev_ids, nb)
                        self._layer_events[layer.name] = device.record_event(self._load_stream)
        except (RuntimeError, ValueError, IndexError) as exc:
            logger.error("offload load failed (%s); %d blocks will be recomputed", exc,
                         len(dev_ids) + len(tail_dev))
            self.recorder.inc("offload_failures", op="load")
            self._load_errors.update(dev_ids)
            self._load_errors.update(tail_dev)
            self._layer_events.clear()
            device.synchronize()
            return
        self.recorder.inc("offload_load_bytes", nbytes)
        self.recorder.observe("offload_load_batch_bytes", nbytes)
        self.recorder.inc("offload_loaded_blocks", len(host_ids) + len(tail_host))
        if device.kind == "cpu":
            self.recorder.observe("offload_load_seconds", time.perf_counter() - start)
        elif self._layer_events:
            last = list(self._layer_events.values())[-1]
            self._queue.put(("load_timer", last, start))

    def _load_async(self, loads: list[HostLoad]) -> None:
        """Copy the loads vLLM waits for between steps on the load stream; ``get_finished``
        reports them once done, those that failed (any block) by request."""
        req_ids = [load.req_id for load in loads]
        failed = {load.req_id for load in loads if load.failed_ids}
        device = self.device
        if device is None or self.segment is None:
            self._async_loads.append((None, req_ids, set(req_ids)))
            return
        todo = [load for load in loads if load.host_ids and load.req_id not in failed]
        valid = [load for load in todo if self._valid_load(load, self.segment.num_blocks,
                                                           errors=False)]
        failed |= {load.req_id for load in todo if load not in valid}
        host_ids = [h for load in valid for h in load.host_ids]
        dev_ids = [d for load in valid for d in load.device_ids]
        event = None
        nbytes = 0
        try:
            if host_ids:
                nb = device.kind != "cpu"
                current = device.current_stream()
                with device.stream(self._load_stream):
                    self._load_stream.wait_stream(current)
                    if self._batched():
                        nbytes = self._copy_in_all(host_ids, dev_ids, nb)
                    else:
                        nbytes = sum(self._copy_in(layer, host_ids, dev_ids, nb)
                                     for layer in self._layers)
                    event = device.record_event(self._load_stream)
        except (RuntimeError, ValueError, IndexError) as exc:
            logger.error("offload load of %s failed (%s); recomputed", req_ids, exc)
            failed |= {load.req_id for load in valid}
            device.synchronize()
            event = None
        if failed:
            self.recorder.inc("offload_failures", op="load")
        self.recorder.inc("offload_load_bytes", nbytes)
        self.recorder.inc("offload_loaded_blocks", 0 if event is None else len(host_ids))
        self._async_loads.append((event, req_ids, failed))

    def _valid_load(self, load: HostLoad, num_host: int, *, errors: bool = True) -> bool:
        assert self.layout is not None
        try:
            if len(load.host_ids) != len(load.device_ids) or not load.host_ids:
                raise ValueError(f"{len(load.host_ids)} host ids for {len(load.device_ids)} "
                                 "device blocks")
            check_ids(load.host_ids, num_host, f"load of {load.req_id} (host)")
            check_ids(load.device_ids, self.layout.num_blocks, f"load of {load.req_id} (device)")
        except (ValueError, IndexError) as exc:
            logger.error("invalid offload load for request %s: %s; recomputing it",
                         load.req_id, exc)
            self.recorder.inc("offload_failures", op="load")
            if errors:
                self._load_errors.update(b for b in load.device_ids if isinstance(b, int))
            return False
        return True

    def _copy_in(self, layer: _LayerCopy, host_ids: Sequence[int], dev_ids: Sequence[int],
                 nb: bool) -> int:
        n = 0
        for rows, off, length in layer.parts:
            n += copy_blocks(layer.host[:, off:off + length], host_ids, rows, dev_ids,
                             non_blocking=nb, path=self.copy_path)
        return n

    def _batched(self) -> bool:
        """Whether loads move every layer in one call (the kernels path: CPU memory)."""
        return self.copy_path == "kernels" or (
            self.copy_path == "auto" and self.device is not None and self.device.kind == "cpu")

    def _copy_in_all(self, host_ids: Sequence[int], dev_ids: Sequence[int], nb: bool) -> int:
        """Host blocks into device blocks, every layer (on CPU one call per region kind and run)."""
        return sum(copy_blocks_all(host_rows, host_ids, dev_rows, dev_ids, non_blocking=nb,
                                   path=self.copy_path) for dev_rows, host_rows in self._kinds)

    def _copy_out_all(self, dev_ids: Sequence[int], host_ids: Sequence[int], nb: bool) -> int:
        """Device blocks into host blocks, every layer (on CPU one call per region kind and run)."""
        return sum(copy_blocks_all(dev_rows, dev_ids, host_rows, host_ids, non_blocking=nb,
                                   path=self.copy_path) for dev_rows, host_rows in self._kinds)

    def _copy_out(self, layer: _LayerCopy, dev_ids: Sequence[int], host_ids: Sequence[int],
                  nb: bool) -> int:
        n = 0
        for rows, off, length in layer.parts:
            n += copy_blocks(rows, dev_ids, layer.host[:, off:off + length], host_ids,
                             non_blocking=nb, path=self.copy_path)
        return n

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Make the compute stream wait for this layer's load (not for the other layers)."""
        event = self._layer_events.pop(layer_name, None)
        if event is not None and self.device is not None:
            self.device.current_stream().wait_event(event)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Device blocks whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ saves
    def wait_for_save(self, meta: CPUOffloadingConnectorMetadata) -> None:
        """Hand this step's saves to the background thread; do not wait for them."""
        if self.device is not None:
            # layers the forward never asked for (e.g. a step without attention) still
            # have to be complete before the blocks are used
            current = self.device.current_stream()
            for event in self._layer_events.values():
                current.wait_event(event)
            self._layer_events.clear()
        if not meta.saves:
            return
        with self._lock:
            for job in meta.saves:
                self._save_reqs.add(job.req_id)
                self._outstanding[job.req_id] += 1
        if self.device is None or self.segment is None:
            # not registered (cannot happen in vLLM); confirm nothing, leases free the blocks
            self._done([j.req_id for j in meta.saves])
            return
        event = self.device.record_event(self.device.current_stream())
        self._queue.put(_SaveBatch(event=event, jobs=list(meta.saves)))

    def _my_part(self, job: HostSave) -> tuple[list[int], list[int]]:
        ri = self.rank_info
        if not self._shared or ri.tp_size == 1:
            return job.device_ids, job.host_ids
        dev, host = [], []
        for d, h in zip(job.device_ids, job.host_ids, strict=True):
            if h % ri.tp_size == ri.tp_rank:
                dev.append(d)
                host.append(h)
        return dev, host

    def _save_loop(self) -> None:
        device = self.device
        assert device is not None
        try:
            device.set_device()
        except Exception:  # a thread may not need (or be able) to select the device
            logger.debug("save thread could not select the device", exc_info=True)
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, tuple) and item[0] == "load_timer":
                    _, event, start = item
                    event.synchronize()
                    self.recorder.observe("offload_load_seconds", time.perf_counter() - start)
                    continue
                self._run_saves(item)
            except Exception:  # the thread must survive anything one batch does
                logger.exception("offload save thread failed on a batch")
            finally:
                self._queue.task_done()

    def _run_saves(self, batch: _SaveBatch) -> None:
        device = self.device
        assert device is not None and self.segment is not None and self.layout is not None
        nb = device.kind != "cpu"
        start = time.perf_counter()
        ok: list[HostSave] = []
        failed: list[HostSave] = []
        nbytes = 0
        with device.stream(self._save_stream):
            self._save_stream.wait_event(batch.event)
            for job in batch.jobs:
                dev_ids, host_ids = self._my_part(job)
                try:
                    check_ids(host_ids, self.segment.num_blocks, f"save job {job.job_id} (host)")
                    check_ids(dev_ids, self.layout.num_blocks, f"save job {job.job_id} (device)")
                    nbytes += self._copy_out_all(dev_ids, host_ids, nb)
                    ok.append(job)
                except (RuntimeError, ValueError, IndexError) as exc:
                    logger.error("offload save job %d of %s failed: %s", job.job_id, job.req_id,
                                 exc)
                    self.recorder.inc("offload_failures", op="save")
                    failed.append(job)
            done_event = device.record_event(self._save_stream)
        done_event.synchronize()
        elapsed = time.perf_counter() - start
        self.recorder.inc("offload_save_bytes", nbytes)
        self.recorder.inc("offload_saved_blocks", sum(len(self._my_part(j)[0]) for j in ok))
        self.recorder.observe("offload_save_seconds", elapsed)
        self.recorder.observe("offload_save_batch_bytes", nbytes)
        if self.client is not None:
            try:
                self.client.save_done(self.rank_info.rank, [j.job_id for j in ok],
                                      [j.job_id for j in failed])
            except (ServerUnavailable, RemoteError) as exc:
                # the jobs' leases lapse on the server and free their host blocks
                logger.warning("could not confirm %d offload saves: %s", len(batch.jobs), exc)
                self.recorder.inc("offload_failures", op="save")
        self._done([j.req_id for j in batch.jobs])

    def _done(self, req_ids: list[str]) -> None:
        with self._lock:
            for req_id in req_ids:
                self._outstanding[req_id] -= 1
                if self._outstanding[req_id] <= 0:
                    del self._outstanding[req_id]

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every queued save is done; True when drained."""
        if self._thread is None or not self._thread.is_alive():
            return True
        if timeout is None:
            self._queue.join()
            return True
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.001)
        return not self._queue.unfinished_tasks

    def handle_preemptions(self, meta: CPUOffloadingConnectorMetadata) -> None:
        """Preempted requests' blocks may be reused this step: finish saves reading them."""
        self._finish_saves(meta.preempted_req_ids)

    def _finish_saves(self, req_ids: set[str]) -> None:
        """Finish the queued saves if any of ``req_ids`` has one (blocks they read are given
        out again this step)."""
        if not req_ids:
            return
        with self._lock:
            busy = any(self._outstanding.get(r) for r in req_ids)
        if busy:
            self.drain()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose saves are all done (their blocks may now be freed), and
        requests whose asynchronous load is done (or failed: :meth:`take_failed_loads`)."""
        with self._lock:
            self._finishing.update(r for r in finished_req_ids if r in self._save_reqs)
            done = {r for r in self._finishing if not self._outstanding.get(r)}
            self._finishing -= done
            self._save_reqs -= done
        recving: set[str] = set()
        for event, req_ids, failed in self._async_loads:
            if event is not None:
                event.synchronize()
            recving.update(req_ids)
            self._failed_recving |= failed
        self._async_loads = []
        return (done or None), (recving or None)

    def take_failed_loads(self) -> set[str]:
        """Requests whose asynchronous load failed since the last call (each also reported
        as received by ``get_finished``)."""
        out, self._failed_recving = self._failed_recving, set()
        return out

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Finish queued saves, leave the pool, stop the server if this rank runs it."""
        if self._thread is not None and self._thread.is_alive():
            self.drain(timeout=30.0)
            self._queue.put(_STOP)
            self._thread.join(5.0)
        self._thread = None
        if self.client is not None:
            self.client.rank_gone(self.rank_info.rank)
            self.client.close()
            self.client = None
        self._layers = []  # drop the views into the mapping before unmapping it
        self._kinds = []
        self._layer_events.clear()
        if self.segment is not None:
            self.segment.close()
            self.segment = None
        if self.server is not None:
            self.server.stop()
            self.server = None


def _maybe_pin_host(device: Device, segment: HostSegment) -> None:
    """Page-lock the host segment for asynchronous DMA where the runtime allows it (CUDA)."""
    if device.kind != "cuda":
        return
    try:
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(segment.flat.data_ptr(), segment.nbytes, 0)
        if int(rc) != 0:
            logger.warning("cudaHostRegister of the host pool returned %s; copies stay "
                           "synchronous", rc)
    except Exception as exc:  # best effort: pageable memory still works, only slower
        logger.warning("could not page-lock the host pool: %s", exc)
