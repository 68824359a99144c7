# SPDX-License-Identifier: Apache-2.0
"""In-engine probes (``EngineProcess.call``) that read the KV bytes an engine holds for a
prompt's cached prefix, so a test can compare two engines' KV block by block.

Which blocks to read: the blocks D's pull connector loaded into, recorded from what its
scheduler hands the worker (:func:`record_loads`, :func:`recorded_loads`), or the blocks the
engine's own prefix cache holds for a prompt (:func:`cached_blocks`, found the way vLLM finds
them: the engine's block hasher, then ``get_computed_blocks``). The bytes are read on every
worker through ``collective_rpc`` (:func:`block_digests`).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

logger = logging.getLogger(__name__)


#: D's loads seen by :func:`record_loads`: request id, local and remote block ids
_LOADS: list[dict[str, Any]] = []


def record_loads(llm: Any) -> int:
    """Record every load the worker-side pull or layerwise connector starts from now on (the
    local block ids D fills, and P's block ids where the request names them). Idempotent;
    returns how many connectors are recorded. In-process engines (TP 1) only."""
    from .probes import _worker_connectors, _worker_of

    n = 0
    for conn in _worker_connectors(llm):
        worker = _worker_of(conn)
        if worker is None or getattr(worker, "_kv_bytes_recorded", False):
            n += worker is not None
            continue
        original = worker.start_load_kv

        def spy(metadata: Any, *args: Any, _orig: Any = original, **kwargs: Any) -> Any:
            for rid, req in (getattr(metadata, "requests", None) or {}).items():
                local = getattr(req, "local_block_ids", None)
                if local or getattr(req, "do_virtual", False):
                    _LOADS.append({"request_id": rid, "local": list(local or []),
                                   "remote": list(getattr(req, "remote_block_ids", []) or []),
                                   "virtual": bool(getattr(req, "do_virtual", False))})
            return _orig(metadata, *args, **kwargs)

        worker.start_load_kv = spy
        worker._kv_bytes_recorded = True
        n += 1
    return n


def recorded_loads(llm: Any) -> list[dict[str, Any]]:
    """The loads recorded since the last call (oldest first), then forgets them."""
    out = list(_LOADS)
    _LOADS.clear()
    return out


def cached_blocks(llm: Any, prompt: list[int]) -> list[int]:
    """Block ids of the leading full blocks this engine's prefix cache holds for ``prompt``
    (vLLM stops one token short of the prompt, as for a real request)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    core = llm.llm_engine.engine_core.engine_core
    req = Request("kv-bytes-probe", list(prompt), SamplingParams(max_tokens=1), None,
                  block_hasher=core.request_block_hasher)
    blocks = core.scheduler.kv_cache_manager.get_computed_blocks(req)[0]
    return [int(b) for b in blocks.get_block_ids()[0]]


def _kv_caches(worker: Any) -> dict[str, Any]:
    """Layer name -> KV cache tensor of one worker (vLLM's static forward context)."""
    ctx = worker.model_runner.vllm_config.compilation_config.static_forward_context
    out: dict[str, Any] = {}
    for name, layer in ctx.items():
        cache = getattr(layer, "kv_cache", None)
        if cache is None:
            continue
        cache = cache[0] if isinstance(cache, list) else cache
        if isinstance(cache, tuple):
            continue  # a state-space layer's (conv, ssm) state: in an attention layer's pages
        out[name] = cache
    return out


def _block(cache: Any, block_id: int) -> Any:
    """One block of a layer's cache: the block axis is first in vLLM CPU's layouts (MLA
    ``[blocks, block_size, latent]``; ``CPU_ATTN`` ``[blocks, 2, heads, block_size, head]``)."""
    return cache[block_id]


def _worker_digests(worker: Any, block_ids: list[int]) -> dict[str, Any]:
    import torch

    layers: dict[str, list[str]] = {}
    shapes: dict[str, list[int]] = {}
    for name, cache in sorted(_kv_caches(worker).items()):
        shapes[name] = list(cache.shape)
        per_block = []
        for b in block_ids:
            raw = _block(cache, b).contiguous().view(torch.uint8).numpy().tobytes()
            per_block.append(hashlib.sha256(raw).hexdigest())
        layers[name] = per_block
    return {"layers": layers, "shapes": shapes,
            "dtype": str(next(iter(_kv_caches(worker).values())).dtype)}


def block_digests(llm: Any, block_ids: list[int]) -> list[dict[str, Any]]:
    """For each worker (TP rank): ``layers`` (layer name -> SHA-256 of each block's bytes, in
    ``block_ids`` order), ``shapes`` (layer name -> cache shape) and ``dtype``."""
    return list(llm.collective_rpc(_worker_digests, args=(list(block_ids),)))


def prefix_digests(llm: Any, prompt: list[int]) -> dict[str, Any]:
    """:func:`cached_blocks` of ``prompt`` and their :func:`block_digests`."""
    ids = cached_blocks(llm, prompt)
    return {"block_ids": ids, "ranks": block_digests(llm, ids)}


def _worker_raw(worker: Any, layer: str, block_id: int) -> bytes:
    import torch

    return _block(_kv_caches(worker)[layer], block_id).contiguous().view(torch.uint8).numpy().tobytes()


def block_raw(llm: Any, layer: str, block_id: int) -> list[bytes]:
    """The raw bytes of one block of one layer, on each worker."""
    return list(llm.collective_rpc(_worker_raw, args=(layer, int(block_id))))


def connector_layout(llm: Any) -> list[dict[str, Any]]:
    """What each worker-side P/D connector registered: per region its layer, address,
    block length and block stride (in-process engines only)."""
    from .probes import _worker_connectors, _worker_of

    out = []
    for conn in _worker_connectors(llm):
        layout = getattr(_worker_of(conn), "layout", None)
        if layout is None:
            continue
        out.append({"is_mla": bool(layout.is_mla), "regions": [
            {"addr": r.base_addr, "block_len": r.block_len,
             "block_stride": r.block_stride, "shape": list(r.tensor.shape)}
            for r in layout.regions]})
    return out


def _worker_cache_addrs(worker: Any) -> dict[str, Any]:
    return {n: [c.data_ptr(), list(c.shape), list(c.stride())]
            for n, c in sorted(_kv_caches(worker).items())}


def cache_addrs(llm: Any) -> list[dict[str, Any]]:
    """Layer name -> (address, shape, strides) of each worker's KV cache tensors."""
    return list(llm.collective_rpc(_worker_cache_addrs))


def _worker_zero(worker: Any, block_ids: list[int]) -> int:
    for cache in _kv_caches(worker).values():
        for b in block_ids:
            _block(cache, b).zero_()
    return len(block_ids)


def zero_blocks(llm: Any, block_ids: list[int]) -> list[int]:
    """Zero ``block_ids`` in every layer on every worker (so that bytes found there later
    were written there later). Only for blocks no request holds."""
    return list(llm.collective_rpc(_worker_zero, args=(list(block_ids),)))


def _head(block: Any, h: int) -> Any:
    """Head ``h`` of one block: ``CPU_ATTN``'s head-major ``[heads, block_size, 2*head]``
    (K and V side by side), or a split ``[2, heads, block_size, head]``."""
    return block[h] if block.dim() == 3 else block[:, h]


def _worker_head_digests(worker: Any, block_ids: list[int]) -> dict[str, Any]:
    import torch

    layers: dict[str, list[list[str]]] = {}
    heads = 0
    head_bytes = 0
    for name, cache in sorted(_kv_caches(worker).items()):
        sample = _block(cache, 0)
        heads = sample.shape[0] if sample.dim() == 3 else sample.shape[1]
        head_bytes = _head(sample, 0).numel() * sample.element_size()
        layers[name] = [[hashlib.sha256(_head(_block(cache, b), h).contiguous()
                                        .view(torch.uint8).numpy().tobytes()).hexdigest()
                         for h in range(heads)] for b in block_ids]
    cache = next(iter(_kv_caches(worker).values()))
    return {"layers": layers, "shape": list(cache.shape), "heads": heads,
            "head_bytes": head_bytes}


def head_digests(llm: Any, block_ids: list[int]) -> list[dict[str, Any]]:
    """For each worker (TP rank): ``layers`` (layer name -> per block, the SHA-256 of each
    of the rank's KV heads, K and V together), the cache ``shape``, the rank's ``heads``
    and the bytes of one head of one block (``head_bytes``). Attention caches in vLLM
    CPU's ``CPU_ATTN`` layout (not MLA)."""
    return list(llm.collective_rpc(_worker_head_digests, args=(list(block_ids),)))


def _worker_connector_totals(worker: Any) -> dict[str, float]:
    from .probes import _worker_connectors

    out: dict[str, float] = {}
    for conn in _worker_connectors(None):
        recorder = getattr(conn, "recorder", None)
        for k, v in (recorder.totals() if recorder is not None else {}).items():
            out[k] = out.get(k, 0.0) + v
    return out


def worker_connector_totals(llm: Any) -> list[dict[str, float]]:
    """Each worker's (TP rank's) connector counters, wherever the worker runs (unlike
    ``probes.connector_totals``, which sees only an in-process worker)."""
    return list(llm.collective_rpc(_worker_connector_totals))
