# SPDX-License-Identifier: Apache-2.0
"""``kv_connector_extra_config`` of the KV pool (``ascend-kv-pool``).

:class:`AscendStoreConfig` holds the keys vLLM-Ascend's ``AscendStoreConnector``
reads (``backend``, ``use_layerwise``, ``load_async``, ``consumer_is_to_put``,
``consumer_is_to_load``, ``discard_partial_chunks``, ``lookup_rpc_port`` and its
deprecated spelling ``mooncake_rpc_port``) plus ours: the size of the embedded
``local`` pool, the lookup deadline, the store back-off and the save queue
bound. :class:`MooncakeStoreConfig` is the Mooncake Store client configuration,
read from the JSON file named by ``MOONCAKE_CONFIG_PATH`` or given inline under
the ``mooncake`` key.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from vllm_ascend.distributed.kv_transfer.core.config.base import ConfigSection, option
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError

from .backend.eviction import DEFAULT_POLICY, POLICY_NAMES
from .backend.registry import backend_entries, backend_names

logger = logging.getLogger(__name__)

#: Environment variable naming the Mooncake Store JSON configuration.
MOONCAKE_CONFIG_ENV = "MOONCAKE_CONFIG_PATH"

#: Backends of the pool, by the name used in the ``backend`` key: a live view of
#: :mod:`.backend.registry` (a backend registered later is accepted and listed too).
POOL_BACKENDS = backend_names()

#: Threads the ``local`` backend copies a big put or get with, by default (at most the CPUs
#: the process may run on).
DEFAULT_COPY_THREADS = 2


@dataclass(frozen=True)
class MooncakeStoreConfig(ConfigSection):
    """Client configuration of a Mooncake Store (``mooncake_master`` + segments)."""

    # Keys of vLLM's own MooncakeStoreConnector JSON that this client does not use.
    passthrough_keys: ClassVar[frozenset[str]] = frozenset(
        {"mode", "enable_offload", "tenant_id", "local_hostname"})

    master_server_address: str = option(
        doc="host:port of mooncake_master's RPC service.", required=True,
        aliases=("master_server_addr",))
    metadata_server: str = option(
        "P2PHANDSHAKE",
        doc="'P2PHANDSHAKE' (no metadata service; the process's transfer engine is shared) or "
            "the HTTP metadata URL, e.g. 'http://host:8080/metadata'.")
    global_segment_size: int = option(
        "1GB", size=True,
        doc="Memory this process contributes to the pool (0: contribute none, use other "
            "segments only).")
    local_buffer_size: int = option(
        "1GB", size=True,
        doc="Client buffer for puts and gets; one object larger than this cannot be put.")
    protocol: str | None = option(
        None, choices=("tcp", "rdma", "ascend"),
        doc="Transport; default: the device's ('ascend' on NPU, 'rdma' on CUDA, 'tcp' on CPU).")
    device_name: str = option("", doc="RDMA device name(s); empty: automatic.")

    def validate(self, source: str) -> None:
        host, sep, port = self.master_server_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(
                f"{source}: master_server_address must be 'host:port', got "
                f"{self.master_server_address!r}", key=f"{source}.master_server_address",
                value=self.master_server_address, source=source)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> MooncakeStoreConfig:
        """Read the JSON file at ``path``.

        Raises:
            ConfigError: the file is missing, is not JSON, or holds a bad value.
        """
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read the Mooncake Store config {str(p)!r}: {exc}",
                              key=MOONCAKE_CONFIG_ENV, value=str(p), source=str(p)) from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"the Mooncake Store config {str(p)!r} is not valid JSON: {exc}",
                              key=MOONCAKE_CONFIG_ENV, value=str(p), source=str(p)) from exc
        return cls.from_dict(data, source=str(p))

    @classmethod
    def load_from_env(cls) -> MooncakeStoreConfig:
        """Read the file named by ``MOONCAKE_CONFIG_PATH``.

        Raises:
            ConfigError: the variable is unset, or the file is bad.
        """
        path = os.environ.get(MOONCAKE_CONFIG_ENV, "").strip()
        if not path:
            raise ConfigError(
                f"the 'mooncake' pool backend needs a Mooncake Store config: set "
                f"{MOONCAKE_CONFIG_ENV} to a JSON file, or give it inline under the 'mooncake' "
                "key of kv_connector_extra_config", key=MOONCAKE_CONFIG_ENV, source="environment")
        return cls.from_file(path)


@dataclass(frozen=True)
class AscendStoreConfig(ConfigSection):
    """Extra config of ``AscendStoreConnector`` (alias ``MooncakeConnectorStoreV1``)."""

    backend: str = option(
        "local", choices=POOL_BACKENDS,
        doc="Where the pool lives: " + ", ".join(
            f"'{e.name}'" + (f" ({e.summary})" if e.summary else "") for e in backend_entries())
            + "; another backend registers with backend.registry.register_backend.")
    use_layerwise: bool = option(
        False, doc="Save and load layer by layer, overlapping the transfers with the forward.")
    load_async: bool = option(
        False, doc="Load between scheduler steps instead of before the forward pass "
                   "(ignored with use_layerwise).")
    consumer_is_to_put: bool = option(
        False, doc="A kv_consumer instance also saves its prefill KV to the pool.")
    consumer_is_to_load: bool = option(
        False, doc="A kv_consumer instance also looks up and loads prefixes from the pool.")
    discard_partial_chunks: bool = option(
        True, doc="Save and look up full blocks only; false also saves the prompt's trailing "
                  "partial block.")
    lookup_rpc_port: int = option(
        0, minimum=0, deprecated_aliases=("mooncake_rpc_port",),
        doc="Suffix of the scheduler->worker lookup socket; instances are told apart by their "
            "engine id already, so only set it to pin a path.")
    prefill_pp_size: int = option(
        1, minimum=1,
        doc="Pipeline-parallel size of the prefill instances (P/D deployments), read by a "
            "consumer that puts; only 1 is supported there (a larger value with "
            "consumer_is_to_put is refused at start-up).")
    prefill_pp_layer_partition: list[int] | None = option(
        None, doc="Layers per prefill pipeline stage, e.g. '20,20'; default: even split.")
    local_pool_size: int = option(
        "8GB", size=True, minimum=1,
        doc="Capacity of the 'local' backend; blocks are evicted beyond it (eviction_policy).")
    local_pool_prefault: bool = option(
        False, doc="Touch all of the 'local' backend's memory at start-up (local_pool_size "
                   "resident from then on, in each worker process; seconds per GB on hosts "
                   "that back guest memory lazily) instead of page by page as it fills, "
                   "which the engine pays for while it serves. More than the host has "
                   "available (less what its other workers are touching at the same time) is "
                   "refused at start-up, and so is more than the host has in all for every "
                   "worker on it (TP, PP and local DP ranks each keep one).")
    eviction_policy: str = option(
        DEFAULT_POLICY, choices=POLICY_NAMES,
        doc="What the 'local' backend evicts first: 'prefix' (LRU over chain leaves: a "
            "prefix block outlives the blocks after it), 'lru', 's3fifo' (scan resistant) or "
            "'prefix-s3fifo' (both).")
    local_copy_threads: int = option(
        DEFAULT_COPY_THREADS, minimum=1,
        doc="Threads the 'local' backend copies one put or get of 4 MiB or more with "
            "(memmove releases the GIL; one core's copy leaves memory bandwidth unused); 1 "
            "copies on the calling thread only.")
    mooncake: MooncakeStoreConfig | None = option(
        None, aliases=("mooncake_config",),
        doc="Mooncake Store config inline; default: the JSON file named by MOONCAKE_CONFIG_PATH.")
    memcache_device_type: str = option(
        "auto", choices=("auto", "a2", "a3", "other"),
        doc="Ascend generation for memcache: A2 registers buffers and all-gathers before init.")
    lookup_timeout_s: float = option(
        5.0, minimum=0.01, doc="Deadline of one scheduler lookup; a late answer is a miss.")
    store_retry_interval_s: float = option(
        10.0, minimum=0.0,
        doc="After the store fails, lookups are misses and saves are dropped for this long "
            "before it is tried again.")
    max_pending_saves: int = option(
        1024, minimum=1, doc="Save jobs queued at most; beyond it saves are dropped and counted.")
    max_batch_keys: int = option(
        256, minimum=1, doc="Keys per backend call; larger batches are split.")
    load_timeout_s: float = option(
        60.0, minimum=0.1,
        doc="Longest wait for one layer (layerwise) or one load; afterwards the blocks count as "
            "failed and vLLM recomputes them (or fails, per kv_load_failure_policy).")

    def validate(self, source: str) -> None:
        part = self.prefill_pp_layer_partition
        if part is not None and len(part) != self.prefill_pp_size:
            raise ConfigError(
                f"{source}: prefill_pp_layer_partition {part} has {len(part)} entries but "
                f"prefill_pp_size is {self.prefill_pp_size}",
                key=f"{source}.prefill_pp_layer_partition", value=part, source=source)
        if part is not None and any(n <= 0 for n in part):
            raise ConfigError(f"{source}: prefill_pp_layer_partition {part} must be positive",
                              key=f"{source}.prefill_pp_layer_partition", value=part,
                              source=source)

    def mooncake_store_config(self) -> MooncakeStoreConfig:
        """The inline ``mooncake`` section, else the ``MOONCAKE_CONFIG_PATH`` file."""
        if self.mooncake is not None:
            return self.mooncake
        return MooncakeStoreConfig.load_from_env()
