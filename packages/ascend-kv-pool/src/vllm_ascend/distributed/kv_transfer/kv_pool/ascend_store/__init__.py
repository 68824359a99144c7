# SPDX-License-Identifier: Apache-2.0
"""ascend-kv-pool: the KV pool connector (``AscendStoreConnector``) and its backends.

Importing this package is light (no vLLM, no store client); :func:`register`
(in :mod:`.plugin`) is the ``vllm.general_plugins`` entry point that tells vLLM
where the connector classes live. vLLM-Ascend's wheel ships an empty file at this
path; nothing of ours needs this one at run time.
"""

from __future__ import annotations

from .__about__ import __version__
from .plugin import CONNECTOR_MODULE, CONNECTORS, THIRD_PARTY_CONNECTORS, register

__all__ = ["CONNECTORS", "CONNECTOR_MODULE", "THIRD_PARTY_CONNECTORS", "__version__", "register"]
