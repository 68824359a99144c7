# SPDX-License-Identifier: Apache-2.0
"""``AscendStoreConnector``: prefix KV blocks saved to and loaded from a pool.

A thin connector: scheduler-side calls go to :class:`~.store_scheduler.KVPoolScheduler`,
worker-side calls to :class:`~.store_worker.KVPoolWorker`. The pool is the
embedded ``local`` backend unless ``kv_connector_extra_config`` names another
(``backend: mooncake`` or ``memcache``); every key is described by
``vllm-ascend-kv config AscendStoreConnector``.

``MooncakeConnectorStoreV1`` is the deprecated name of the same connector; it
logs a deprecation warning when created.

With ``kv_events_config.enable_kv_cache_events`` on, the pool's KV cache events
(``BlockStored`` for blocks saved to the pool, ``BlockRemoved`` for blocks the
``local`` backend evicted, both with ``medium="cpu"``) travel from the workers
(``get_kv_connector_kv_cache_events``) through vLLM's output aggregation to the
scheduler side (``update_connector_output``), which hands vLLM's publisher
those every writing rank reported (``take_events``).

It serves vLLM's hybrid KV cache manager (``SupportsHMA``) for models with full-attention
and sliding-window KV cache groups of one block size: a block of each group is an object of
its own, a hit is the longest prefix every group serves, a window's group saves and loads
only the blocks vLLM keeps (:mod:`.hybrid`), and a failed load is reported by request. Other
group kinds (a state-space model's state, ...) and ``use_layerwise`` with several groups are
refused at start-up, naming them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.core.kv_groups import KVGroups
from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("AscendStoreConnector")

from vllm.distributed.kv_events import (  # noqa: E402
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

from vllm_ascend.distributed.kv_transfer.core.vllm_metrics import (  # noqa: E402
    ConnectorStatsMixin,
)
from vllm_ascend.distributed.kv_transfer.core.vllm_roles import SchedulerHooksMixin  # noqa: E402
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import AscendStoreConfig  # noqa: E402

from .context import context_from_vllm  # noqa: E402
from .events import PoolEvent, RemovedBlock  # noqa: E402
from .metrics import POOL_METRICS  # noqa: E402
from .store_contract import AscendConnectorMetadata  # noqa: E402
from .store_scheduler import KVPoolScheduler  # noqa: E402
from .store_worker import KVPoolWorker  # noqa: E402

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder

logger = logging.getLogger(__name__)

#: ``medium`` of the pool's events (vLLM-Ascend's value).
EVENT_MEDIUM = "cpu"
#: Events the scheduler side keeps while not every writing rank reported them yet.
MAX_PENDING_EVENTS = 65536


class AscendStoreKVEvents(KVConnectorKVEvents):
    """The pool's KV cache events, counted across the workers that reported them.

    vLLM merges the workers' containers (``add_events`` + ``increment_workers``);
    an event is published once every rank that writes its block reported it.
    Ranks holding the same KV heads split a request's blocks (``put_step`` of
    them share keys), so ``num_workers / put_step`` ranks write each block.
    Events not complete yet stay for later steps (a slow rank reports a step
    later), bounded by :data:`MAX_PENDING_EVENTS`.

    Args:
        num_workers: workers whose events this container holds.
        put_step: ranks sharing one block's keys (``1`` unless KV heads < TP size).
    """

    def __init__(self, num_workers: int = 1, put_step: int = 1) -> None:
        if num_workers <= 0 or put_step <= 0:
            raise ValueError(f"num_workers ({num_workers}) and put_step ({put_step}) must be "
                             "positive")
        self._counter: Counter[KVCacheEvent] = Counter()
        self._num_workers = num_workers
        self.put_step = put_step

    def add_events(self, events: list[KVCacheEvent]) -> None:
        if not isinstance(events, list):
            raise TypeError(f"events must be a list of KVCacheEvent, got {type(events).__name__}")
        self._counter.update(events)

    def _complete(self, count: int) -> bool:
        return count * self.put_step >= self._num_workers

    def pop_common_events(self) -> list[KVCacheEvent]:
        """The events every writing rank reported (removed from the container), in order."""
        common = [e for e, n in self._counter.items() if self._complete(n)]
        for event in common:
            del self._counter[event]
        while len(self._counter) > MAX_PENDING_EVENTS:
            del self._counter[next(iter(self._counter))]
        return common

    def aggregate(self) -> AscendStoreKVEvents:
        common = self.pop_common_events()
        self._counter.clear()
        self._counter.update(common)
        self._num_workers = 1
        self.put_step = 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        self._num_workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._counter.elements())

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def has_events(self) -> bool:
        """True while some event is held."""
        return bool(self._counter)

    def clear_events(self) -> None:
        self._counter.clear()
        self._num_workers = 1

    def __repr__(self) -> str:
        return (f"<AscendStoreKVEvents workers={self._num_workers} put_step={self.put_step} "
                f"events={len(self._counter)}>")


def to_vllm_events(events: Sequence[PoolEvent]) -> list[KVCacheEvent]:
    """vLLM's ``BlockStored`` / ``BlockRemoved`` for the pool's events."""
    out: list[KVCacheEvent] = []
    for event in events:
        if isinstance(event, RemovedBlock):
            out.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(event.block_hash)],
                                    medium=EVENT_MEDIUM, group_idx=event.group))
            continue
        parent = (maybe_convert_block_hash(event.parent_hash)
                  if event.parent_hash is not None else None)
        out.append(BlockStored(
            block_hashes=[maybe_convert_block_hash(event.block_hash)],
            parent_block_hash=parent, token_ids=list(event.token_ids),
            block_size=event.block_size, lora_id=event.lora_id, medium=EVENT_MEDIUM,
            lora_name=event.lora_name, group_idx=event.group))
    return out


class AscendStoreConnector(ConnectorStatsMixin, SchedulerHooksMixin, KVConnectorBase_V1,
                           SupportsHMA):
    """KV pool connector (vLLM-Ascend's ``AscendStoreConnector``)."""

    metric_specs = POOL_METRICS

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        who = type(self).__name__
        #: the engine's KV cache groups (one unless vLLM's hybrid KV cache manager is on)
        self.kv_groups = KVGroups.from_config(kv_cache_config)
        # (a state-space group's state is not addressed by the tokens' hashes: refused)
        self.kv_groups.refuse_unsupported(who, kinds=("full", "sliding"))
        kv_config = vllm_config.kv_transfer_config
        self.pool_config = AscendStoreConfig.from_dict(
            kv_config.kv_connector_extra_config,
            source=f"{who} kv_connector_extra_config")
        if self.kv_groups.hybrid and self.pool_config.use_layerwise:
            # a layer of each group shares one tensor: a layer's save would go out before
            # the other group's layer of that tensor is computed
            raise ConfigError(
                f"{who}: use_layerwise moves one layer's KV at a time, but with the hybrid KV "
                "cache manager a layer of each KV cache group shares one tensor "
                f"({self.kv_groups.describe()}): set use_layerwise to false, or serve the "
                "model with --disable-hybrid-kv-cache-manager",
                key="use_layerwise", value=True, source="kv_connector_extra_config")
        self.ctx = context_from_vllm(vllm_config, kv_cache_config)
        self.use_layerwise = self.pool_config.use_layerwise
        self.connector_scheduler: KVPoolScheduler | None = None
        self.connector_worker: KVPoolWorker | None = None
        self._kv_cache_events: AscendStoreKVEvents | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVPoolScheduler(self.ctx, self.pool_config)
        else:
            self.connector_worker = KVPoolWorker(self.ctx, self.pool_config,
                                                 parallel_config=vllm_config.parallel_config)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is a later miss, never a lost hand-off."""
        return False

    # ============================================================== scheduler side
    # (get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta and
    # request_finished hand over to the scheduler half: SchedulerHooksMixin)
    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook with the hybrid KV cache manager on: the request's blocks of every
        group are kept while its saves may be pending, as with one group."""
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Collect the workers' KV cache events of this step."""
        events = getattr(connector_output, "kv_cache_events", None)
        if not isinstance(events, AscendStoreKVEvents):
            return
        if self._kv_cache_events is None:
            self._kv_cache_events = events
        else:  # the same workers as before: their events add up, their number does not
            self._kv_cache_events.add_events(events.get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The pool's events every writing rank reported, for vLLM's publisher."""
        if self._kv_cache_events is None:
            return []
        common = self._kv_cache_events.pop_common_events()
        if not self._kv_cache_events.has_events():
            self._kv_cache_events = None
        return common

    # ============================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any = None) -> None:
        # vLLM 0.32+ passes the step's metadata; older versions a set of request ids.
        if self.connector_worker is None:
            return
        if isinstance(kv_connector_metadata, AscendConnectorMetadata):
            ids = kv_connector_metadata.preempted_req_ids
        elif isinstance(kv_connector_metadata, (set, frozenset, list)):
            ids = set(kv_connector_metadata)
        else:
            return
        self.connector_worker.handle_preemptions(set(ids))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, AscendConnectorMetadata)
        self.connector_worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.use_layerwise and self.connector_worker is not None:
            self.connector_worker.wait_for_layer_load(layer_name, self._get_connector_metadata())

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if not self.use_layerwise or self.connector_worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, AscendConnectorMetadata)
        self.connector_worker.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        assert self.connector_worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, AscendConnectorMetadata)
        self.connector_worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.connector_worker is not None
        sending, recving = self.connector_worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and with several KV cache groups the requests whose load
        failed (vLLM takes no block ids there; the pool loads asynchronously then)."""
        assert self.connector_worker is not None
        sending, recving = self.connector_worker.get_finished(finished_req_ids)
        failed = self.connector_worker.take_failed_loads()
        return KVConnectorTransferResults(finished_sending=set(sending),
                                          finished_recving=set(recving) | failed,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> AscendStoreKVEvents | None:
        """This worker's KV cache events since the last step (``None`` when KV events are off).

        An empty container is returned too, so that this worker counts among those
        an event must come from.
        """
        if self.connector_worker is None:
            return None
        events = self.connector_worker.take_events()
        if events is None:
            return None
        container = AscendStoreKVEvents(num_workers=1, put_step=self.connector_worker.put_step)
        container.add_events(to_vllm_events(events))
        return container

    # ============================================================== both sides
    def stats_recorder(self) -> MetricsRecorder | None:
        side = self.connector_worker or self.connector_scheduler
        return side.recorder if side is not None else None

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
            self.connector_worker = None
        if self.connector_scheduler is not None:
            self.connector_scheduler.close()
            self.connector_scheduler = None


class MooncakeConnectorStoreV1(AscendStoreConnector):
    """Deprecated name of :class:`AscendStoreConnector`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        logger.warning("kv_connector 'MooncakeConnectorStoreV1' is deprecated and will be "
                       "removed; use 'AscendStoreConnector' (same configuration)")
        super().__init__(vllm_config, role, kv_cache_config)
