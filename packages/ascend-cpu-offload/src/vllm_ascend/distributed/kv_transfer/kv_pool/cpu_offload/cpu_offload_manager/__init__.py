# SPDX-License-Identifier: Apache-2.0
"""The host-memory KV manager of ``CPUOffloadingConnector``, beside the connector that uses it.

* :mod:`.block_manager` - allocation, LRU eviction, prefix matching, pins and save jobs;
* :mod:`.host_pool` - the shared-memory segments holding the blocks;
* :mod:`.protocol` - msgspec messages of the metadata server (never pickle);
* :mod:`.server` / :mod:`.client` - the metadata server (in worker rank 0) and its clients.
"""

from __future__ import annotations

from .block_manager import BlockState, HostBlockManager, SaveJob
from .client import MetadataClient, ServerUnavailable, default_endpoint
from .host_pool import HostSegment, plan_num_blocks
from .server import MetadataServer

__all__ = ["BlockState", "HostBlockManager", "HostSegment", "MetadataClient", "MetadataServer",
           "SaveJob", "ServerUnavailable", "default_endpoint", "plan_num_blocks"]
