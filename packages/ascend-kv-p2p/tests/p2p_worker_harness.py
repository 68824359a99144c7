# SPDX-License-Identifier: Apache-2.0
"""What the worker-level P/D tests build their P and D workers from: a stand-in of the vLLM
config the workers read, per-layer KV caches in each supported layout, and what a D rank's
block must hold once P's block reached it.

Imported by file name (this folder is on ``sys.path``, see ``conftest.py``).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch

from vllm_ascend.distributed.kernels.heads import kv_heads_of_rank


def pd_vllm_config(role: str, kv_port: int, *, block_size: int, heads: int,
                   model: str = "/models/tiny", tp_size: int = 1) -> Any:
    """The parts of a ``VllmConfig`` a P (``kv_producer``), D (``kv_consumer``) or
    ``kv_both`` worker reads."""
    kvc = SimpleNamespace(kv_port=kv_port, is_kv_producer=role in ("kv_producer", "kv_both"),
                          is_kv_consumer=role in ("kv_consumer", "kv_both"),
                          kv_connector_extra_config={})
    return SimpleNamespace(
        kv_transfer_config=kvc,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp_size, data_parallel_rank=0,
                                        pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=block_size),
        model_config=SimpleNamespace(model=model, get_total_num_kv_heads=lambda: heads))


def set_retry(worker: Any, key: str, **changes: Any) -> None:
    """Change the retry policy ``key`` (``claim_retry``, ``read_retry``, ...) of a worker's
    config while it runs (its parts read the policy from ``worker.cfg`` on each retry)."""
    cfg = worker.cfg
    worker.cfg = dataclasses.replace(
        cfg, **{key: dataclasses.replace(getattr(cfg, key), **changes)})


def numbered_caches(fill: bool, *, layers: int, blocks: int, heads: int, block_size: int,
                    head_size: int) -> dict[str, Any]:
    """Per-layer caches ``(blocks, heads, block_size, 2*head_size)``: zeros, or with ``fill``
    every element numbered (and each layer offset by 1e6), so misplaced bytes show."""
    out = {}
    for layer in range(layers):
        t = torch.zeros(blocks, heads, block_size, 2 * head_size)
        if fill:
            t += torch.arange(t.numel(), dtype=torch.float32).view(t.shape) + layer * 1e6
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def layer_name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def layout_caches(layout: str, tp_size: int, tp_rank: int, *, fill: bool, layers: int,
                  blocks: int, heads: int, block_size: int, head_size: int,
                  dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Per-layer caches of one TP rank in a layout: ``cpu`` (vLLM's CPU cache, K and V in one
    tensor), ``npu`` (a K and a V tensor) or ``mla`` (nope and rope, replicated on every
    rank). With ``fill`` every element encodes (layer, block, global head, position, kind),
    never 0, so misplaced or missing bytes show."""
    mine = list(kv_heads_of_rank(heads, tp_size, tp_rank))
    caches: dict[str, Any] = {}
    for layer in range(layers):
        if layout == "cpu":
            t = torch.zeros(blocks, len(mine), block_size, 2 * head_size, dtype=dtype)
            if fill:
                for hi, h in enumerate(mine):
                    t[:, hi] = _pattern(layer, h, (blocks, block_size, 2 * head_size))
            caches[layer_name(layer)] = t
        elif layout == "npu":
            k = torch.zeros(blocks, block_size, len(mine), head_size, dtype=dtype)
            v = torch.zeros_like(k)
            if fill:
                for hi, h in enumerate(mine):
                    k[:, :, hi] = _pattern(layer, h, (blocks, block_size, head_size))
                    v[:, :, hi] = -_pattern(layer, h, (blocks, block_size, head_size))
            caches[layer_name(layer)] = (k, v)
        else:  # mla: (nope, rope), replicated on every rank
            nope = torch.zeros(blocks, block_size, 1, 16, dtype=dtype)
            rope = torch.zeros(blocks, block_size, 1, 4, dtype=dtype)
            if fill:
                nope[:] = _pattern(layer, 0, (blocks, block_size, 1, 16))
                rope[:] = _pattern(layer, 1, (blocks, block_size, 1, 4))
            caches[layer_name(layer)] = (nope, rope)
    return caches


def _pattern(layer: int, head: int, shape: tuple[int, ...]) -> torch.Tensor:
    blocks = torch.arange(shape[0], dtype=torch.float32).view(-1, *[1] * (len(shape) - 1))
    rest = torch.arange(int(torch.tensor(shape[1:]).prod())).view(shape[1:]).float()
    return layer * 1e6 + head * 1e4 + blocks * 1e2 + rest / 1e3 + 1


def expected_block(caches_p: list[dict[str, Any]], layout: str, p_tp: int, d_tp: int,
                   d_rank: int, layer: str, p_block: int, *, heads: int) -> Any:
    """What D rank ``d_rank``'s block must hold once P's block ``p_block`` reached it (P's
    ranks' caches in ``caches_p``): the heads D's rank owns, from the P ranks that own them."""
    if layout == "mla":
        return caches_p[0][layer][0][p_block], caches_p[0][layer][1][p_block]
    parts = []
    for h in kv_heads_of_rank(heads, d_tp, d_rank):
        r = next(r for r in range(p_tp) if h in kv_heads_of_rank(heads, p_tp, r))
        hi = list(kv_heads_of_rank(heads, p_tp, r)).index(h)
        src = caches_p[r][layer]
        parts.append(src[p_block, hi] if layout == "cpu"
                     else (src[0][p_block, :, hi], src[1][p_block, :, hi]))
    if layout == "cpu":
        return torch.stack(parts)
    return torch.stack([p[0] for p in parts], 1), torch.stack([p[1] for p in parts], 1)
