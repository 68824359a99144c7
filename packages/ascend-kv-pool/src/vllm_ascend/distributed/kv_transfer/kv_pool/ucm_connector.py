# SPDX-License-Identifier: Apache-2.0
"""``UCMConnectorV1``: vLLM connector delegating to UCM (Unified Cache Management).

A thin shell, as upstream's: it creates
``ucm.integration.vllm.ucm_connector.UCMConnector`` (from the ``uc-manager``
distributions) and forwards every connector call to it. Registered as
``UCMConnector`` by ascend-kv-pool's ``register()``.

``uc-manager`` itself is only a selector; the engine comes with a backend
extra for the machine (``uc-manager[cann910-a3]`` on Ascend A3 with CANN 9.1,
``uc-manager[cu129]`` on CUDA 12.9, ...). Without it, creating the connector
raises a ``DependencyError`` (an ``ImportError``) that says so.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.errors import DependencyError
from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("UCMConnector")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

__all__ = ["UCM_MODULE", "UCMConnectorV1", "ucm_connector_class"]

UCM_MODULE = "ucm.integration.vllm.ucm_connector"


def ucm_connector_class() -> Any:
    """UCM's ``UCMConnector`` class.

    Raises:
        DependencyError: UCM is not installed (names the pip package).
    """
    try:
        return importlib.import_module(UCM_MODULE).UCMConnector
    except (ImportError, AttributeError) as exc:
        raise DependencyError(
            f"UCMConnector needs UCM's engine ({UCM_MODULE}.UCMConnector: {exc}); install the "
            "pip package uc-manager with the backend of this machine, e.g. "
            "\"pip install 'uc-manager[cann910-a3]'\" on Ascend or "
            "\"pip install 'uc-manager[cu129]'\" on CUDA") from exc


class UCMConnectorV1(KVConnectorBase_V1):
    """Every connector call goes to ``self._ucm_engine``, UCM's ``UCMConnector``.

    Args:
        vllm_config: vLLM's config (``kv_transfer_config`` set).
        role: Scheduler or worker.
        kv_cache_config: Passed on to UCM when given (vLLM >= 0.33 always gives it).
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        impl = ucm_connector_class()
        self._ucm_engine = (impl(vllm_config, role) if kv_cache_config is None
                            else impl(vllm_config, role, kv_cache_config))

    # ------------------------------------------------------------------ worker side
    def has_connector_metadata(self) -> bool:
        return bool(self._ucm_engine.has_connector_metadata())

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._ucm_engine.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._ucm_engine.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._ucm_engine.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._ucm_engine.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._ucm_engine.wait_for_save()

    def clear_connector_metadata(self) -> None:
        self._ucm_engine.clear_connector_metadata()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self._ucm_engine.bind_connector_metadata(connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._ucm_engine.get_block_ids_with_load_errors())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        return self._ucm_engine.get_finished(finished_req_ids)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._ucm_engine.get_num_new_matched_tokens(  # type: ignore[no-any-return]
            request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._ucm_engine.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._ucm_engine.build_connector_meta(  # type: ignore[no-any-return]
            scheduler_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._ucm_engine.request_finished(  # type: ignore[no-any-return]
            request, block_ids)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._ucm_engine.update_connector_output(connector_output)

    # ------------------------------------------------------------------ metrics
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return ucm_connector_class().build_kv_connector_stats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return ucm_connector_class().build_prom_metrics(vllm_config, metric_types, labelnames,
                                                        per_engine_labelvalues)
