# SPDX-License-Identifier: Apache-2.0
"""Drive the pool's scheduler and worker sides the way vLLM's scheduler and model runner do.

:class:`PoolHarness` uses fake requests and a KV cache of the vLLM CPU layout
whose blocks the "forward pass" fills with values derived from their tokens,
so a loaded block can be checked byte for byte. (Imported by the tests through
``conftest.py``, which puts this folder on ``sys.path``.)
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import AscendStoreConfig
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.context import PoolContext

BLOCK = 4
HEADS = 2
HEAD_SIZE = 8
NUM_BLOCKS = 64
NUM_LAYERS = 2


def make_kv_caches(num_layers: int = NUM_LAYERS, num_blocks: int = NUM_BLOCKS,
                   heads: int = HEADS, block: int = BLOCK, head_size: int = HEAD_SIZE,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """KV caches in vLLM's CPU layout ``(num_blocks, heads, block_size, 2 * head_size)``."""
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(num_blocks, heads, block,
                                                             2 * head_size, dtype=dtype)
            for i in range(num_layers)}


def block_value(tokens: list[int], layer: int, shape: tuple[int, ...]) -> torch.Tensor:
    """What the fake forward writes into a block holding ``tokens`` in ``layer``."""
    gen = torch.Generator().manual_seed(hash((tuple(tokens), layer)) & 0x7FFFFFFF)
    return torch.randn(shape, generator=gen)


@dataclass
class FakeRequest:
    """The attributes of ``vllm.v1.request.Request`` the pool reads."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    lora_request: Any = None
    cache_salt: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        """vLLM-style chained hashes of the full blocks (vLLM's own hash function differs)."""
        out: list[bytes] = []
        parent = b"root"
        tokens = self.all_token_ids
        for i in range(len(tokens) // BLOCK):
            parent = hashlib.sha256(parent + repr(tokens[i * BLOCK:(i + 1) * BLOCK]).encode()
                                    ).digest()
            out.append(parent)
        return out


class Blocks:
    """``KVCacheBlocks`` stand-in."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


def scheduler_output(*, new: list[Any] = (), cached: list[Any] = (), finished: set[str] = (),
                     preempted: set[str] = (), resumed: set[str] = ()) -> Any:
    """A ``SchedulerOutput`` with the fields the pool reads.

    ``new``: ``(req_id, block_ids, num_computed, num_scheduled)``;
    ``cached``: ``(req_id, new_block_ids or None, num_computed, num_scheduled)``.
    """
    return SimpleNamespace(
        finished_req_ids=set(finished), preempted_req_ids=set(preempted),
        num_scheduled_tokens={r[0]: r[3] for r in [*new, *cached]},
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=c)
                            for r, b, c, _n in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r[0] for r in cached], resumed_req_ids=set(resumed),
            new_block_ids=[(list(r[1]),) if r[1] is not None else None for r in cached],
            num_computed_tokens=[r[2] for r in cached]))


class DirectLookup:
    """A lookup client calling the worker in-process (the ZeroMQ path has its own tests)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.calls = 0
        self.failures = 0

    def lookup(self, hashes: list[str], token_end: int) -> int:
        self.calls += 1
        return self.worker.lookup_scheduler(hashes, token_end)


class PoolHarness:
    """One engine's pool sides (scheduler + one worker) over a given backend."""

    def __init__(self, backend: Any, *, cfg: AscendStoreConfig | None = None,
                 ctx: PoolContext | None = None, kv_caches: dict[str, torch.Tensor] | None = None,
                 **cfg_overrides: Any) -> None:
        from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_scheduler import (
            KVPoolScheduler,
        )
        from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_worker import (
            KVPoolWorker,
        )

        self.cfg = cfg or AscendStoreConfig.from_dict(
            {"store_retry_interval_s": 0.2, **cfg_overrides})
        self.ctx = ctx or PoolContext(model_name="tiny", block_size=BLOCK, num_kv_heads=HEADS,
                                      num_layers=NUM_LAYERS, salt="test")
        self.backend = backend
        self.worker = KVPoolWorker(self.ctx, self.cfg, backend=backend,
                                   start_lookup_server=False)
        self.kv = kv_caches if kv_caches is not None else make_kv_caches()
        self.worker.register_kv_caches(self.kv)
        self.lookup = DirectLookup(self.worker)
        self.scheduler = KVPoolScheduler(self.ctx, self.cfg, lookup_client=self.lookup)
        self.layers = list(self.kv)
        self._next_block = 0
        self.finished: set[str] = set()

    def alloc(self, n: int) -> list[int]:
        ids = list(range(self._next_block, self._next_block + n))
        self._next_block += n
        assert self._next_block <= NUM_BLOCKS
        return ids

    def forward(self, request: FakeRequest, block_ids: list[int], start: int, end: int) -> None:
        """Write the KV of tokens ``[start, end)``: whole blocks, derived from their tokens."""
        tokens = request.all_token_ids
        for i in range(start // BLOCK, -(-end // BLOCK)):
            chunk = tokens[i * BLOCK:(i + 1) * BLOCK]
            for li, name in enumerate(self.layers):
                t = self.kv[name]
                t[block_ids[i]] = block_value(chunk, li, tuple(t.shape[1:]))

    def expected(self, request: FakeRequest, i: int, layer: int = 0) -> torch.Tensor:
        t = self.kv[self.layers[layer]]
        chunk = request.all_token_ids[i * BLOCK:(i + 1) * BLOCK]
        return block_value(chunk, layer, tuple(t.shape[1:]))

    def step(self, out: Any, *, forward: list[tuple[FakeRequest, list[int], int, int]] = ()
             ) -> tuple[Any, set[str], set[str], set[int]]:
        """One engine step: build metadata, load, forward, save, collect results."""
        meta = self.scheduler.build_connector_meta(out)
        self.worker.handle_preemptions(meta.preempted_req_ids)
        self.worker.start_load_kv(meta)
        for req, blocks, s, e in forward:
            self.forward(req, blocks, s, e)
        self.worker.wait_for_save(meta)
        sending, recving = self.worker.get_finished(set(out.finished_req_ids))
        errors = self.worker.get_block_ids_with_load_errors()
        return meta, sending, recving, errors

    def prefill(self, request: FakeRequest, *, finish: bool = True) -> dict[str, Any]:
        """Schedule ``request``'s whole prompt in one step, as vLLM would."""
        ext, is_async = self.scheduler.get_num_new_matched_tokens(request, 0)
        blocks = self.alloc(-(-request.num_tokens // BLOCK))
        self.scheduler.update_state_after_alloc(request, Blocks(blocks), ext)
        result: dict[str, Any] = {"external": ext, "async": is_async, "blocks": blocks}
        if is_async:
            meta, _s, recving, errors = self.step(scheduler_output())
            assert self.worker.wait_idle()
            deadline = time.monotonic() + 10
            while request.request_id not in recving and time.monotonic() < deadline:
                time.sleep(0.005)
                _m, _s, recving2, errors2 = self.step(scheduler_output())
                recving |= recving2
                errors |= errors2
            result.update(load_meta=meta, recving=recving, errors=errors)
            computed = ext
        else:
            computed = 0
        n = request.num_tokens - (ext if not is_async else computed)
        out = scheduler_output(new=[(request.request_id, blocks, ext, n)])
        meta, _s, _r, errors = self.step(out, forward=[(request, blocks, ext, request.num_tokens)])
        result.setdefault("load_meta", meta)
        result["meta"] = meta
        result["errors"] = result.get("errors", set()) | errors
        if finish:
            result["delay_free"], _ = self.scheduler.request_finished(request, blocks)
            assert self.worker.wait_idle()
            _m, sending, _r, _e = self.step(scheduler_output(finished={request.request_id}))
            result["sending"] = sending
        return result
