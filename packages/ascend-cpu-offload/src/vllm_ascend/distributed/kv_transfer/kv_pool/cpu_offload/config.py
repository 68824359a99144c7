# SPDX-License-Identifier: Apache-2.0
"""``kv_connector_extra_config`` of ``CPUOffloadingConnector`` (``ascend-cpu-offload``).

Upstream's keys keep their meaning: ``cpu_swap_space_gb`` is the host memory
of the whole instance in GiB and ``swap_in_threshold`` the fewest tokens
worth loading back. ``cpu_swap_space`` is the same capacity written as a size
(``"512MB"``, ``"1.5GB"``, or bytes); the remaining keys are ours.

:func:`get_cpu_offload_connector` finds the connector's ``KVTransferConfig`` in vLLM's
config, also as a ``MultiConnector`` child.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.config.base import ConfigSection, option
from vllm_ascend.distributed.kv_transfer.core.config.sizes import format_size
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError

from . import CONNECTOR_NAME

#: Host capacity used when neither ``cpu_swap_space_gb`` nor ``cpu_swap_space`` is given.
#: Upstream defaulted to 800 GiB, which no development machine has; the pool is
#: reserved up front (see ``preallocate``), so the default stays small.
DEFAULT_SWAP_SPACE_BYTES = 4 << 30


@dataclass(frozen=True)
class CPUOffloadConfig(ConfigSection):
    """Extra config of ``CPUOffloadingConnector`` (host-memory prefix cache)."""

    cpu_swap_space_gb: float | None = option(
        None, minimum=0.0,
        doc="Host memory of the whole instance for offloaded KV blocks, in GiB (upstream key). "
            "Default: 4 GiB when cpu_swap_space is not given either.")
    cpu_swap_space: int | None = option(
        None, size=True,
        doc="The same capacity as a size: int bytes or a string like '512MB' or '1.5GB'. "
            "Give this or cpu_swap_space_gb, not both.")
    swap_in_threshold: int = option(
        0, minimum=0,
        doc="Load from host memory only when at least this many tokens beyond the device's own "
            "prefix-cache hit are there; shorter hits are recomputed.")
    save_decode_blocks: bool = option(
        True, doc="Also offload the blocks filled during decode (multi-turn reuse); false keeps "
                  "only prompt blocks.")
    preallocate: bool = option(
        True, doc="Reserve the host memory at startup (posix_fallocate), so a too small /dev/shm is "
                  "a clear startup error instead of a crash on first use.")
    metadata_endpoint: str | None = option(
        None, doc="ZeroMQ endpoint of the metadata server (ipc://... or tcp://host:port). Default: "
                  "an ipc socket in the temp directory named after the engine id.")
    rpc_timeout_s: float = option(
        5.0, minimum=0.01, doc="Timeout of one request to the metadata server.")
    retry_after_s: float = option(
        10.0, minimum=0.0,
        doc="After the metadata server failed to answer, how long the scheduler serves without "
            "the host cache before trying again (no step waits on a dead server twice).")
    init_timeout_s: float = option(
        120.0, minimum=0.1,
        doc="How long a rank waits at startup for every rank of the instance to register.")
    save_timeout_s: float = option(
        120.0, minimum=0.1,
        doc="Lease of one save job: host blocks whose save no rank confirmed within this time "
            "(a dead or hung rank) are freed, never offered as a hit.")

    def validate(self, source: str) -> None:
        if self.cpu_swap_space_gb is not None and self.cpu_swap_space is not None:
            raise ConfigError(
                f"{source}: give cpu_swap_space_gb ({self.cpu_swap_space_gb!r}) or cpu_swap_space "
                f"({format_size(self.cpu_swap_space)}), not both",
                key=f"{source}.cpu_swap_space", value=self.cpu_swap_space, source=source)
        if self.cpu_swap_space_gb is not None and not math.isfinite(self.cpu_swap_space_gb):
            raise ConfigError(f"{source}: cpu_swap_space_gb must be finite, got "
                              f"{self.cpu_swap_space_gb!r}", key=f"{source}.cpu_swap_space_gb",
                              value=self.cpu_swap_space_gb, source=source)
        if self.swap_space_bytes <= 0:
            given = (self.cpu_swap_space_gb if self.cpu_swap_space_gb is not None
                     else self.cpu_swap_space)
            raise ConfigError(f"{source}: the host swap space must be positive, got {given!r}",
                              key=f"{source}.cpu_swap_space_gb", value=given, source=source)

    @property
    def swap_space_bytes(self) -> int:
        """Host capacity of the instance in bytes."""
        if self.cpu_swap_space is not None:
            return int(self.cpu_swap_space)
        if self.cpu_swap_space_gb is not None:
            return int(self.cpu_swap_space_gb * (1 << 30))
        return DEFAULT_SWAP_SPACE_BYTES


def _field(config: Any, name: str) -> Any:
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)


def get_cpu_offload_connector(vllm_config: Any) -> Any:
    """The ``kv_transfer_config`` of ``CPUOffloadingConnector``, or None.

    The engine's own config when it names the connector; otherwise the first child
    of a ``MultiConnector`` that does (a child given as a dict comes back with its fields
    as attributes).
    """
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None:
        return None
    if _field(kv, "kv_connector") == CONNECTOR_NAME:
        return kv
    if _field(kv, "kv_connector") == "MultiConnector":
        extra = _field(kv, "kv_connector_extra_config") or {}
        for child in extra.get("connectors") or ():
            if _field(child, "kv_connector") == CONNECTOR_NAME:
                if isinstance(child, dict):
                    return _ChildConfig(child)
                return child
    return None


class _ChildConfig:
    """Attribute access to a ``MultiConnector`` child given as a dict."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.__dict__.update(fields)
        self.kv_connector_extra_config = fields.get("kv_connector_extra_config") or {}
