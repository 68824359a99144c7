# SPDX-License-Identifier: Apache-2.0
"""vLLM's scheduler-side connector hooks, handed to a connector's scheduler half unchanged.

A connector is a thin shell over a scheduler half (``connector_scheduler``, built in the
scheduler process) and a worker half (``connector_worker``). Four of vLLM's scheduler-side
hooks only hand over; :class:`SchedulerHooksMixin` is their one home. It imports nothing of
vLLM at run time; a connector lists it before ``KVConnectorBase_V1``, whose abstract hooks it
implements::

    class MyConnector(ConnectorStatsMixin, SchedulerHooksMixin, KVConnectorBase_V1):
        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            self.connector_scheduler = MyScheduler(...) if role == SCHEDULER else None

A hook called on the worker side (no scheduler half) fails with :class:`AssertionError`,
as vLLM never does that.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


class RoleScheduler(Protocol):
    """What :class:`SchedulerHooksMixin` calls on a connector's scheduler half."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]: ...

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> KVConnectorMetadata: ...

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]: ...


class SchedulerHooksMixin:
    """``get_num_new_matched_tokens``, ``update_state_after_alloc``, ``build_connector_meta``
    and ``request_finished``, handed to ``self.connector_scheduler``."""

    connector_scheduler: RoleScheduler | None

    def _scheduler_half(self) -> RoleScheduler:
        sched = self.connector_scheduler
        assert sched is not None, (f"{type(self).__name__}: scheduler-side method called on a "
                                  "worker connector")
        return sched

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._scheduler_half().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler_half().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_half().build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_half().request_finished(request, block_ids)
