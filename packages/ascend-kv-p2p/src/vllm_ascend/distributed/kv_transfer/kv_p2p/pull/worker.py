# SPDX-License-Identifier: Apache-2.0
"""Worker side of ``MooncakeConnectorV1`` (decode pulls): the roles, composed.

The worker keeps what both roles share (:class:`~.worker_base.P2PWorkerBase`:
identity, the KV cache registered with the transfer engine, peers and
handshake) and hands each role's work to its own object:

* P (``kv_producer``): :class:`~.pull.holder.LeaseHolder`, the blocks P holds for
  D as leases, and the side channel D claims them through;
* D (``kv_consumer``): :class:`~.pull.reader.PullReader`, the pulls (claims, reads,
  retries, ``Done``) over :class:`~.pull.peers.PeerRanks` (what D knows of P's ranks,
  its calls to them), with :class:`~.pull.loads.LoadTracker`, the loads in flight
  and how each ends, and :mod:`.pull.transfer`, the bytes of one request.

What the scheduler tells the worker is :mod:`.pull.contract`.

A pipeline-parallel P (``prefill.pp_size`` > 1, :mod:`.contract`): each stage's workers
register only their stage's layers (vLLM gives them no others) and say which in their
``AgentMeta`` (``pp_size``, ``first_layer``, ``total_num_layers``); D (one stage) claims
and reads every stage's ranks, each for its stage's layers, and sends each its ``Done``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec

from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.core.kv_groups import KVGroups
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig

from ..protocol import CODEC
from ..worker_base import P2PWorkerBase
from .contract import MooncakeConnectorMetadata, stage_layers
from .holder import LeaseHolder
from .loads import LoadTracker
from .reader import PullReader

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


class PullWorker(P2PWorkerBase):
    """Worker-side logic of the pull connector: a P holder and a D reader over shared state.

    Attributes:
        holder: P's leases and side channel (``None`` on a pure consumer).
        reader: D's pulls (``None`` on a pure producer).
        loads: D's loads in flight (``None`` on a pure producer).
        p_stages: on D, the layers of each of P's pipeline stages (``None``: P is one stage;
            known once the KV caches are registered).
    """

    serves_pipeline_stages = True

    def __init__(self, vllm_config: VllmConfig, cfg: MooncakeP2PConfig, engine_id: str,
                 recorder: MetricsRecorder, *, tp_rank: int | None = None,
                 pp_rank: int | None = None, kv_groups: KVGroups | None = None) -> None:
        super().__init__(vllm_config, cfg, engine_id, recorder, codec=CODEC, tp_rank=tp_rank,
                         pp_rank=pp_rank, kv_groups=kv_groups)
        self.holder = LeaseHolder(self) if self.is_producer else None
        self.loads = LoadTracker(recorder, cfg.load_timeout_s) if self.is_consumer else None
        self.reader = PullReader(self, self.loads) if self.loads is not None else None
        self.p_stages: list[range] | None = None
        pp_size = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
        if pp_size != 1 and cfg.prefill.pp_size != pp_size:
            raise ConfigError(
                f"PullWorker: this P runs pipeline_parallel_size={pp_size} but "
                f"kv_connector_extra_config says prefill.pp_size={cfg.prefill.pp_size}; set "
                "prefill.pp_size (and prefill.pp_layer_partition, if any) on P and D as P runs",
                key="prefill.pp_size", value=cfg.prefill.pp_size, source="kv_connector_extra_config")
        #: the model's layer count, where vLLM's config tells it (a P stage checks its layers)
        self._model_layers = _model_layers(vllm_config)

    # ================================================================ set-up
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Describe the cache, register it with the transfer engine, start the side channel."""
        self._register_kv_memory(kv_caches)
        assert self.layout is not None and self.meta is not None
        spec = self.cfg.prefill
        if spec.pp_size > 1 and self.kv_groups.hybrid:
            raise ConfigError(
                "PullWorker: a pipeline-parallel P with the hybrid KV cache manager on "
                f"({self.kv_groups.describe()}) is not supported; run P with "
                "pipeline_parallel_size 1 or --disable-hybrid-kv-cache-manager",
                key="prefill.pp_size", value=spec.pp_size, source="kv_connector_extra_config")
        if self.is_consumer and spec.pp_size > 1:
            self.p_stages = stage_layers(self.layout.num_layers, spec.pp_size,
                                         spec.pp_layer_partition)
        if self.is_producer and spec.pp_size > 1:
            self._publish_stage()
        if self.holder is not None:
            self.holder.serve()
            assert self.holder.server is not None
            logger.info("P side channel on %s (engine %s, %d layers, %d blocks)",
                        self.holder.server.endpoint, self.engine_id, self.layout.num_layers,
                        self.layout.num_blocks)

    def _publish_stage(self) -> None:
        """A P stage: check that its layers are its stage's, and say which in its meta."""
        assert self.layout is not None and self.meta is not None
        spec = self.cfg.prefill
        total = self._model_layers or sum(spec.pp_layer_partition or ())
        if not total:
            raise ConfigError(
                "PullWorker: the model's layer count is unknown; set "
                "prefill.pp_layer_partition", key="prefill.pp_layer_partition", value=None,
                source="kv_connector_extra_config")
        stage = stage_layers(total, spec.pp_size, spec.pp_layer_partition)[self.pp_rank]
        held = [layer.index for layer in self.layout.layers]
        if held != list(stage):
            raise ConfigError(
                f"PullWorker: pipeline stage {self.pp_rank} holds layers {held} but "
                f"prefill.pp_layer_partition={spec.pp_layer_partition} gives it "
                f"[{stage.start}, {stage.stop}); set it as vLLM splits the model "
                "(VLLM_PP_LAYER_PARTITION)", key="prefill.pp_layer_partition",
                value=spec.pp_layer_partition, source="kv_connector_extra_config")
        self.meta = msgspec.structs.replace(self.meta, pp_size=spec.pp_size,
                                            first_layer=stage.start, total_num_layers=total)

    def shutdown(self) -> None:
        """Stop serving, stop pulling, release the registered KV memory."""
        if self.holder is not None:
            self.holder.stop()
        if self.reader is not None:
            self.reader.shutdown()
        self._release_resources()

    # ================================================================ vLLM hooks
    def start_load_kv(self, metadata: MooncakeConnectorMetadata) -> None:
        """Hold P's newly finished requests and start D's pulls."""
        if metadata.requests_to_send:
            if self.holder is None:
                logger.warning("%d requests to hold on a worker that is no kv_producer: "
                               "ignored", len(metadata.requests_to_send))
            else:
                self.holder.hold(metadata.requests_to_send.values())
        if metadata.requests:
            if self.reader is None:
                logger.warning("%d requests to pull on a worker that is no kv_consumer: "
                               "ignored", len(metadata.requests))
            else:
                self.reader.start(metadata.requests.values())
        if metadata.claim_answers and self.reader is not None:
            # answers of claims D's scheduler sent ahead, for pulls started in earlier steps
            self.reader.inbox.deliver(metadata.claim_answers)

    def get_finished(self, *, idle: bool = False) -> tuple[set[str] | None, set[str] | None]:
        """Requests P may free now, and requests D finished loading (each reported once).

        ``idle``: the step ran no token; with loads in flight, wait up to ``idle_wait_s``
        for one to end first (vLLM steps again at once: without the wait D's engine loop
        spins on a core while the transfer runs)."""
        sending, recving, _ = self.transfer_results(idle=idle)
        return sending or None, recving or None

    def transfer_results(self, *, idle: bool = False) -> tuple[set[str], set[str], set[str]]:
        """As :meth:`get_finished`, and the requests of ``recving`` whose load failed (with
        several KV cache groups vLLM takes failures by request, not by block: their blocks
        are not in :meth:`get_block_ids_with_load_errors`)."""
        reader = self.reader
        if reader is not None:
            reader.poll_inline()  # the reads started on vLLM's thread (inline_reads)
        if idle and self.loads is not None and self.cfg.idle_wait_s > 0 and len(self.loads):
            if reader is not None and reader.inline is not None and len(reader.inline):
                loads = self.loads
                reader.wait_inline(self.cfg.idle_wait_s, lambda: loads.wait_any(0))
            else:
                self.loads.wait_any(self.cfg.idle_wait_s)
        sending = self.holder.collect_finished() if self.holder is not None else set()
        recving, failed = (self.loads.collect_results() if self.loads is not None
                           else (set(), set()))
        if self.reader is not None:
            self.reader.send_owed()  # P frees what D loaded, now that vLLM knows
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of D's failed loads since the last call (none with several KV cache
        groups: vLLM takes those failures by request, :meth:`transfer_results`)."""
        blocks = self.loads.take_load_errors() if self.loads is not None else set()
        return set() if self.kv_groups.hybrid else blocks

    def wait_loads(self, request_ids: Iterable[str], timeout: float | None = None) -> bool:
        """Block until none of ``request_ids`` (already passed to :meth:`start_load_kv`) is
        still loading: each ended, loaded or failed, and the next :meth:`get_finished` reports
        it. False on timeout. For benchmarks and tests; vLLM polls ``get_finished``."""
        if self.loads is None:
            return True
        reader = self.reader
        inline = reader.inline if reader is not None else None
        if reader is None or inline is None or not len(inline):
            return self.loads.wait(request_ids, timeout)
        ids = list(request_ids)
        end = None if timeout is None else time.monotonic() + timeout
        # reads started here end only when polled: poll without pausing (as Mooncake's own
        # wait does; yielding the CPU to the transfer's threads on every poll measured a
        # one-block read's end seen about 100 us late on 2 CPUs)
        while len(inline):
            reader.poll_inline()
            if not self.loads.loading(ids):
                return True
            if end is not None and time.monotonic() >= end:
                return False
        return self.loads.wait(ids, None if end is None else max(0.0, end - time.monotonic()))

    # ================================================================ views
    @property
    def server(self) -> Any:
        """P's side-channel server (``None`` until :meth:`register_kv_caches`, or on D)."""
        return self.holder.server if self.holder is not None else None

    @property
    def overlap_claims(self) -> bool:
        """D sends its claims while it reads (else claims first); see :class:`PullReader`."""
        return self.reader is not None and self.reader.overlap_claims

    @overlap_claims.setter
    def overlap_claims(self, value: bool) -> None:
        assert self.reader is not None, "only a kv_consumer pulls"
        self.reader.overlap_claims = value


def _model_layers(vllm_config: Any) -> int:
    """The model's hidden layer count from vLLM's config; 0 where it does not say."""
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_text_config", None)
    value = getattr(hf, "num_hidden_layers", None)
    return value if isinstance(value, int) else 0
