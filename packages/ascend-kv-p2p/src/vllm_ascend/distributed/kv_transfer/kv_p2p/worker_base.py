# SPDX-License-Identifier: Apache-2.0
"""What the pull and the layerwise workers share.

Identity (roles, TP/PP ranks, the side-channel port of this rank), the KV cache
description and its registration with the transfer engine, the ``AgentMeta``
this worker shows its peers, the side-channel clients, and the handshake: a
peer's metadata is fetched once and checked with
:func:`~.protocol.compatibility_problem`; a mismatch is remembered, so every
later request to that peer fails at once with the same message.

Also the head plan both connectors pair ranks by (:func:`head_slices`,
:func:`head_partners`): ascend-kernels' head ownership
(:mod:`vllm_ascend.distributed.kernels.heads`), its shape errors raised as the
connectors' :class:`~.errors.HandshakeMismatchError`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from vllm_ascend.distributed.kernels import KernelShapeError
from vllm_ascend.distributed.kernels.heads import (
    HeadSlice,
    partners_per_remote_rank,
    plan_head_slices,
)
from vllm_ascend.distributed.kv_transfer.core import local_protocol, local_reads
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.core.kv_groups import TOKEN_KINDS, KVGroups
from vllm_ascend.distributed.kv_transfer.core.layout import (
    KVCacheLayout,
    KVRegion,
    refuse_kv_cache_groups,
)
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import get_host_ip
from vllm_ascend.distributed.kv_transfer.core.ranks import rank_info_from_vllm
from vllm_ascend.distributed.kv_transfer.core.transfer_engine import (
    MooncakeTransferEngine,
    get_transfer_engine,
)
from vllm_ascend.distributed.kv_transfer.core.wire import Codec, Message
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import (
    MooncakeLayerwiseConfig,
    MooncakeP2PConfig,
)

from .errors import HandshakeMismatchError, RemoteKVUnavailable
from .params import engine_instance
from .protocol import PROTOCOL_VERSION, AgentMeta, GetMeta, side_channel_port, worker_port

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


class P2PWorkerBase:
    """Shared state and handshake of a P/D worker.

    Args:
        vllm_config: the engine's config.
        cfg: the connector's extra config.
        engine_id: this instance's ``engine_id``.
        recorder: where metrics go.
        codec: the side-channel protocol of the connector.
        tp_rank: this worker's TP rank (default: from vLLM's parallel state, through
            :func:`~vllm_ascend.distributed.kv_transfer.core.ranks.rank_info_from_vllm`).
        pp_rank: this worker's PP rank (default: likewise).
    """

    #: whether a pure kv_producer of this worker may be one stage of a pipeline-parallel P
    serves_pipeline_stages: ClassVar[bool] = False

    def __init__(self, vllm_config: VllmConfig, cfg: MooncakeP2PConfig, engine_id: str,
                 recorder: MetricsRecorder, *, codec: Codec[Message], tp_rank: int | None = None,
                 pp_rank: int | None = None, kv_groups: KVGroups | None = None) -> None:
        kvc = vllm_config.kv_transfer_config
        assert kvc is not None
        par = vllm_config.parallel_config
        self.cfg = cfg
        self.engine_id = engine_id
        self.recorder = recorder
        #: the KV cache groups (one unless vLLM's hybrid KV cache manager is on)
        self.kv_groups = kv_groups or KVGroups.from_config(None)
        self.codec = codec
        self.is_producer = bool(kvc.is_kv_producer)
        self.is_consumer = bool(kvc.is_kv_consumer)
        self.block_size = vllm_config.cache_config.block_size
        self.model = str(vllm_config.model_config.model).rstrip("/").split("/")[-1]
        #: MLA (DeepSeek): one latent a token, the same on every TP rank, no head axis
        self.is_mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        self.total_kv_heads = 1 if self.is_mla else int(
            vllm_config.model_config.get_total_num_kv_heads())
        self.tp_size = par.tensor_parallel_size
        pp_size = int(getattr(par, "pipeline_parallel_size", 1))
        if pp_size != 1 and not (self.serves_pipeline_stages and self.is_producer
                                 and not self.is_consumer):
            where = ("on a kv_consumer or kv_both instance: D runs one pipeline stage"
                     if self.serves_pipeline_stages else "by this connector")
            raise ConfigError(
                f"{type(self).__name__}: pipeline_parallel_size={pp_size} is not supported "
                f"{where}; run it with pipeline_parallel_size 1 (a pipeline-parallel P is "
                "served by MooncakeConnectorV1)",
                key="pipeline_parallel_size", value=pp_size, source="parallel_config")
        refuse_unsupported_shapes(vllm_config, None, type(self).__name__)
        if tp_rank is None or pp_rank is None:
            ranks = rank_info_from_vllm(par)
            tp_rank = ranks.tp_rank if tp_rank is None else tp_rank
            pp_rank = ranks.pp_rank if pp_rank is None else pp_rank
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        self.host = get_host_ip()
        base = side_channel_port(kvc.kv_port, dp_rank=par.data_parallel_rank,
                                 tp_size=par.tensor_parallel_size,
                                 pp_size=par.pipeline_parallel_size)
        self.port = worker_port(base, tp_rank=self.tp_rank, tp_size=self.tp_size,
                                pp_rank=self.pp_rank)
        #: how this worker names itself to peers (reader on D, sender on P)
        self.agent_id = f"{engine_id}/tp{self.tp_rank}"
        #: this engine start (``AgentMeta.instance``)
        self.instance = engine_instance(vllm_config, engine_id)
        own = cfg.prefill if self.is_producer and not self.is_consumer else cfg.decode
        if own.tp_size is not None and own.tp_size != self.tp_size:
            raise HandshakeMismatchError(
                f"kv_connector_extra_config says this instance has tp_size={own.tp_size} but "
                f"it runs with tensor_parallel_size={self.tp_size}")
        self.layout: KVCacheLayout | None = None
        self.te: MooncakeTransferEngine | None = None
        self.meta: AgentMeta | None = None
        #: whether this rank's KV cache is in host memory (same-host peers may copy it)
        self._kv_on_host = False
        #: (endpoint, the peer's engine id) -> its client
        self._clients: dict[tuple[str, str], RpcClient[Message]] = {}
        self._remote_meta: dict[str, AgentMeta] = {}
        self._mismatch: dict[str, str] = {}
        self._meta_lock = threading.Lock()

    # ------------------------------------------------------------ KV cache
    def _register_kv_memory(self, kv_caches: dict[str, Any]) -> KVCacheLayout:
        """Describe the cache, register it with the transfer engine, build the AgentMeta."""
        if self.is_mla:
            kv_caches = {name: _latent_view(t) for name, t in kv_caches.items()}
        self.layout = KVCacheLayout.from_kv_caches(kv_caches, block_size=self.block_size)
        self._kv_on_host = all(getattr(getattr(t, "device", None), "type", "") == "cpu"
                               for t in kv_caches.values())
        self.te = get_transfer_engine(self.host, self.cfg.protocol,
                                      device_name=self.cfg.device_name)
        if self.te.protocol == local_protocol.LOCAL_PROTOCOL:  # no Mooncake engine, no port
            if isinstance(self.cfg, MooncakeLayerwiseConfig):
                local_protocol.refuse_writes(type(self).__name__)
            if not self._kv_on_host:
                local_protocol.refuse_device_kv(type(self).__name__)
        for addr, length in self.layout.memory_ranges():
            self.te.register_memory(addr, length)
        local_host = local_reads.host_identity() if self._kv_on_host else ""
        self.meta = AgentMeta(
            protocol_version=PROTOCOL_VERSION, engine_id=self.engine_id, model=self.model,
            session=self.te.session_id, tp_rank=self.tp_rank, tp_size=self.tp_size,
            pp_rank=self.pp_rank, total_num_kv_heads=self.total_kv_heads,
            layout=self.layout.descriptor(),
            region_addrs=[r.base_addr for r in self.layout.regions],
            region_strides=[r.block_stride for r in self.layout.regions],
            vllm_version=_vllm_version(), instance=self.instance,
            local_host=local_host, pid=os.getpid() if local_host else 0,
            kv_groups=self.kv_groups.signature())
        return self.layout

    def _release_resources(self) -> None:
        """Close the side-channel clients and unregister the KV memory."""
        with self._meta_lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
        if self.te is not None and self.layout is not None:
            for addr, length in self.layout.memory_ranges():
                self.te.unregister_memory(addr, length)
            self.te = None

    # ------------------------------------------------------------ peers
    def client(self, host: str, port: int, engine_id: str = "") -> RpcClient[Message]:
        """The side-channel client of the peer rank at ``host:port`` (one a peer, kept).

        Args:
            engine_id: the peer instance's engine id (from the request's params): with a key
                the frames are bound to it as well as to the port (:func:`~vllm_ascend.distributed.kv_transfer.core.auth.audience_of`),
                so another instance on another host with the same port refuses them.
        """
        endpoint = tcp_endpoint(host, port)
        with self._meta_lock:
            client = self._clients.get((endpoint, engine_id))
            if client is None:
                client = RpcClient(endpoint, self.codec, timeout_s=self.cfg.handshake_timeout_s,
                                   engine_id=engine_id)
                self._clients[(endpoint, engine_id)] = client
            return client

    def cached_peer_meta(self, host: str, port: int) -> AgentMeta | None:
        """The peer rank's metadata if it was fetched already (no call), else ``None``."""
        with self._meta_lock:
            return self._remote_meta.get(tcp_endpoint(host, port))

    def forget_peer_meta(self, host: str, port: int) -> None:
        """Drop the peer rank's metadata: the next :meth:`peer_meta` fetches it again."""
        with self._meta_lock:
            self._remote_meta.pop(tcp_endpoint(host, port), None)

    def peer_meta(self, host: str, port: int, *, peer: str,
                  problem_of: Callable[[AgentMeta], str], engine_id: str = "") -> AgentMeta:
        """A peer rank's metadata, fetched once and checked with ``problem_of`` (``engine_id``:
        the peer instance's, as :meth:`client` takes it)."""
        endpoint = tcp_endpoint(host, port)
        with self._meta_lock:
            if endpoint in self._mismatch:
                raise HandshakeMismatchError(self._mismatch[endpoint])
            cached = self._remote_meta.get(endpoint)
        if cached is not None:
            return cached
        meta = self.client(host, port, engine_id).call(GetMeta(requester=self.agent_id))
        if not isinstance(meta, AgentMeta):
            raise RemoteKVUnavailable(f"{endpoint} answered GetMeta with {type(meta).__name__}")
        problem = problem_of(meta)
        with self._meta_lock:
            if problem:
                self._mismatch[endpoint] = problem
                raise HandshakeMismatchError(problem)
            self._remote_meta[endpoint] = meta
        if self.te is not None:  # read from P's memory if P is on this host (else not)
            self.te.add_local_peer(meta.session, meta.local_host if self._kv_on_host else "",
                                   meta.pid)
        logger.info("handshake with %s %s (engine %s, tp %d/%d) ok", peer, endpoint,
                    meta.engine_id, meta.tp_rank, meta.tp_size)
        return meta


def refuse_unsupported_shapes(vllm_config: Any, kv_cache_config: Any, who: str, *,
                              groups_ok: bool = False,
                              kinds: Sequence[str] = TOKEN_KINDS) -> None:
    """Refuse at start-up what the P/D connectors would serve wrong.

    * Decode or prefill context parallelism: P's params always say ``remote_dcp_size`` and
      ``remote_pcp_size`` 1 and D reads whole blocks from one rank, so a DCP/PCP instance
      would move a part of each request's KV as if it were all of it.
    * More than one KV cache group (a hybrid model, e.g. sliding window and full attention,
      under vLLM's hybrid KV cache manager): refused unless ``groups_ok`` (a connector that
      moves every group, ``SupportsHMA``), and then kinds it cannot move
      (:meth:`~vllm_ascend.distributed.kv_transfer.core.kv_groups.KVGroups.refuse_unsupported`).

    Args:
        vllm_config: the engine's config.
        kv_cache_config: the engine's ``KVCacheConfig`` (``None`` where not known yet).
        who: the connector or worker, named in the error.
        groups_ok: the connector moves the blocks of several KV cache groups.
        kinds: the group kinds it moves then.

    Raises:
        ConfigError: naming the key and its value, or the model's KV cache groups.
    """
    par = vllm_config.parallel_config
    for key in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        value = int(getattr(par, key, 1) or 1)
        if value != 1:
            raise ConfigError(
                f"{who}: {key}={value} is not supported (P/D moves whole blocks of one rank "
                f"and tells D a context-parallel size of 1); run P/D instances with {key} 1",
                key=key, value=value, source="parallel_config")
    if groups_ok:
        KVGroups.from_config(kv_cache_config).refuse_unsupported(who, kinds=kinds)
    else:
        refuse_kv_cache_groups(kv_cache_config, who)


def head_slices(total_heads: int, remote_tp: int, local_tp: int, local_rank: int, *,
                is_mla: bool = False) -> list[HeadSlice]:
    """The head slices local rank ``local_rank`` exchanges with the remote instance's ranks
    (:func:`~vllm_ascend.distributed.kernels.heads.plan_head_slices`).

    Raises:
        HandshakeMismatchError: the heads do not split over one of the TP sizes.
    """
    try:
        return plan_head_slices(total_heads, remote_tp, local_tp, local_rank, is_mla=is_mla)
    except KernelShapeError as exc:
        raise HandshakeMismatchError(str(exc)) from exc


def head_partners(total_heads: int, remote_tp: int, local_tp: int, *,
                  is_mla: bool = False) -> dict[int, int]:
    """How many local ranks pair with each remote rank
    (:func:`~vllm_ascend.distributed.kernels.heads.partners_per_remote_rank`).

    Raises:
        HandshakeMismatchError: the heads do not split over one of the TP sizes.
    """
    try:
        return partners_per_remote_rank(total_heads, remote_tp, local_tp, is_mla=is_mla)
    except KernelShapeError as exc:
        raise HandshakeMismatchError(str(exc)) from exc


def _latent_view(cache: Any) -> Any:
    """An MLA layer's cache as ``(num_blocks, block_size, latent)``: vLLM CPU hands it to
    connectors as ``(num_blocks, 1, block_size, latent)``, which reads like a one-head cache
    in the CPU layout of K and V and would be split by KV heads."""
    if getattr(cache, "dim", None) is not None and cache.dim() == 4 and cache.shape[1] == 1:
        return cache[:, 0]
    return cache


def heads_in_block(region: KVRegion) -> int:
    """KV heads in one block of ``region`` (1 for MLA: no head axis)."""
    axis = region.head_axis
    return int(region.block_shape[axis]) if axis is not None else 1


def _vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", ""))
    except ImportError:
        return ""
