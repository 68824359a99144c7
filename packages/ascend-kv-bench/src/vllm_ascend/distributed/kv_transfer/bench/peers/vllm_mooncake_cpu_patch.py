# SPDX-License-Identifier: Apache-2.0
"""Make vLLM's own ``MooncakeConnector`` start on a CPU engine (benchmarks only).

``MooncakeConnectorWorker.__init__`` calls ``torch.accelerator.current_device_index()``,
which raises ``RuntimeError: Cannot access accelerator device when none is
available.`` on CPU (../shared/reference/peer_connectors_on_cpu.md). ``bench serve``
imports this module first in both engine processes of the peer's P/D pair:

- with no accelerator, ``torch.accelerator.current_device_index`` returns 0;
- when ``VLLM_ASCEND_KV_BENCH_MC_BOOTSTRAP`` is ``host:port``, the P process
  starts vLLM's ``MooncakeBootstrapServer`` there itself (left to the
  connector, it binds 0.0.0.0 on a fixed port); the P config then names it in
  ``bootstrap_server_address``.

Our ``MooncakeConnectorV1`` needs neither.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

BOOTSTRAP_ENV = "VLLM_ASCEND_KV_BENCH_MC_BOOTSTRAP"

if not torch.accelerator.is_available():
    torch.accelerator.current_device_index = lambda: 0  # type: ignore[assignment]
    logger.warning("benchmark patch: torch.accelerator.current_device_index() -> 0 (CPU)")

_bootstrap = None
_addr = os.environ.get(BOOTSTRAP_ENV, "").strip()
if _addr:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_utils import (
        MooncakeBootstrapServer,
    )

    _host, _, _port = _addr.rpartition(":")
    _bootstrap = MooncakeBootstrapServer(_host, int(_port))
    _bootstrap.start()
    logger.warning("benchmark patch: Mooncake bootstrap server on %s", _addr)
