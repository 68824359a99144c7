# SPDX-License-Identifier: Apache-2.0
"""``LMCacheAscendConnector``: vLLM's ``LMCacheConnectorV1`` with LMCache-Ascend loaded first.

``import lmcache_ascend`` patches LMCache for Ascend NPUs; the connector class
is vLLM's own ``LMCacheConnectorV1``, re-exported here so that
ascend-kv-pool's ``register()`` can register it as ``LMCacheAscendConnector``
(upstream's name). Without LMCache-Ascend, importing this module raises a
``DependencyError`` (an ``ImportError``) that says what to install.
"""

from __future__ import annotations

import importlib
import logging

from vllm_ascend.distributed.kv_transfer.core.errors import DependencyError
from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

logger = logging.getLogger(__name__)

require_vllm("LMCacheAscendConnector")

try:
    importlib.import_module("lmcache_ascend")
except ImportError as exc:
    raise DependencyError(
        f"LMCacheAscendConnector needs LMCache-Ascend (the Python package lmcache_ascend: "
        f"{exc}); \"pip install lmcache\", then build and install LMCache-Ascend from "
        "https://github.com/LMCache/LMCache-Ascend (it is not on PyPI)") from exc

from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (  # noqa: E402
    LMCacheConnectorV1,
)

__all__ = ["LMCacheConnectorV1"]
