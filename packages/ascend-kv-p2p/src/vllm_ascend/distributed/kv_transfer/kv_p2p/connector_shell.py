# SPDX-License-Identifier: Apache-2.0
"""What the two P/D connectors' thin shells share: config, role split, hand-over hooks.

The hooks are those vLLM calls that only hand over to the scheduler or the worker.

:class:`P2PConnectorShell` builds the scheduler (scheduler role) or the worker (worker role)
a connector names through :meth:`~P2PConnectorShell._make_scheduler` and
:meth:`~P2PConnectorShell._make_worker`; the hooks that differ between the pull
(:mod:`.pull.connector`) and the layerwise push (:mod:`.layerwise.connector`) stay in those
modules. This module is a path only ascend-kv-p2p ships.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("the P/D connectors")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorRole,
    SupportsHMA,
)

from vllm_ascend.distributed.kv_transfer.core.kv_groups import (  # noqa: E402
    TOKEN_KINDS,
    KVGroups,
)
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder  # noqa: E402
from vllm_ascend.distributed.kv_transfer.core.vllm_metrics import ConnectorStatsMixin  # noqa: E402
from vllm_ascend.distributed.kv_transfer.core.vllm_roles import (  # noqa: E402
    RoleScheduler,
    SchedulerHooksMixin,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig  # noqa: E402

from .p2p_metrics import P2P_METRICS  # noqa: E402
from .rank_hosts import RankAddress, hosts_of  # noqa: E402
from .worker_base import refuse_unsupported_shapes  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


class P2PScheduler(RoleScheduler, Protocol):
    """The scheduler side of a P/D connector, as the shell calls it."""

    def set_rank_hosts(self, hosts: dict[int, str]) -> None: ...

    def shutdown(self) -> None: ...


class P2PWorker(Protocol):
    """The worker side of a P/D connector, as the shell calls it."""

    host: str
    port: int
    tp_rank: int

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None: ...

    def get_block_ids_with_load_errors(self) -> set[int]: ...

    def shutdown(self) -> None: ...


CfgT = TypeVar("CfgT", bound=MooncakeP2PConfig)
SchedT = TypeVar("SchedT", bound=P2PScheduler)
WorkerT = TypeVar("WorkerT", bound=P2PWorker)


class P2PConnectorShell(ConnectorStatsMixin, SchedulerHooksMixin, KVConnectorBase_V1,
                        Generic[CfgT, SchedT, WorkerT]):
    """A P/D connector's shell: its config (``config_class``, from
    ``kv_connector_extra_config``), its scheduler or worker, and the hooks that hand over."""

    metric_specs = P2P_METRICS

    config_class: type[CfgT]
    #: the KV cache group kinds the connector moves under vLLM's hybrid KV cache manager
    group_kinds: tuple[str, ...] = TOKEN_KINDS

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        kvc = vllm_config.kv_transfer_config
        assert kvc is not None
        self.cfg: CfgT = self.config_class.from_dict(
            kvc.kv_connector_extra_config,
            source=f"kv_connector_extra_config of {type(self).__name__}")
        refuse_unsupported_shapes(vllm_config, kv_cache_config, type(self).__name__,
                                  groups_ok=isinstance(self, SupportsHMA),
                                  kinds=self.group_kinds)
        self.engine_id = str(kvc.engine_id)
        #: the engine's KV cache groups (one unless vLLM's hybrid KV cache manager is on)
        self.kv_groups = KVGroups.from_config(kv_cache_config)
        self.recorder = MetricsRecorder(P2P_METRICS)
        self.connector_scheduler: SchedT | None = None
        self.connector_worker: WorkerT | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = self._make_scheduler(vllm_config)
        else:
            self.connector_worker = self._make_worker(vllm_config)

    def _make_scheduler(self, vllm_config: VllmConfig) -> SchedT:
        raise NotImplementedError

    def _make_worker(self, vllm_config: VllmConfig) -> WorkerT:
        raise NotImplementedError

    # ============================== Scheduler side (the hand-overs: SchedulerHooksMixin)
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Where each of this instance's TP ranks listens (vLLM collects them from the
        workers' :meth:`get_handshake_metadata`); P names them in what it tells D."""
        if self.connector_scheduler is not None:
            self.connector_scheduler.set_rank_hosts(hosts_of(metadata))

    # ============================== Worker-side methods
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Any:
        """This rank's side-channel address, for the scheduler (:mod:`.rank_hosts`)."""
        w = self.connector_worker
        if w is None:
            return None
        return RankAddress(host=w.host, port=w.port, tp_rank=w.tp_rank)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
