# SPDX-License-Identifier: Apache-2.0
"""What both P/D schedulers read from vLLM's config when they start.

Both schedulers (:mod:`.pull.scheduler`, :mod:`.layerwise.scheduler`) read the instance's
role, block size, TP and PP sizes, host and the side channel's base port (the port of its TP
rank 0, which P's params name); and whether a step runs no token (:func:`runs_no_token`, the
metadata's ``idle``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.net import get_host_ip

from .protocol import side_channel_port

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class SchedulerBase:
    """The instance's facts every P/D scheduler keeps."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str) -> None:
        kvc = vllm_config.kv_transfer_config
        assert kvc is not None
        par = vllm_config.parallel_config
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.is_producer = bool(kvc.is_kv_producer)
        self.is_consumer = bool(kvc.is_kv_consumer)
        self.tp_size = par.tensor_parallel_size
        self.pp_size = int(par.pipeline_parallel_size)
        self.host = get_host_ip()
        self.side_port = side_channel_port(kvc.kv_port, dp_rank=par.data_parallel_rank,
                                           tp_size=self.tp_size, pp_size=self.pp_size)


def runs_no_token(scheduler_output: Any) -> bool:
    """The step of ``scheduler_output`` runs no token (the metadata's ``idle``); a
    scheduler output that does not say is taken as a busy step."""
    return getattr(scheduler_output, "total_num_scheduled_tokens", None) == 0
