# SPDX-License-Identifier: Apache-2.0
"""A fake ``torch_npu`` for CPU machines.

The real package needs the CANN toolkit and cannot even be imported here.
This stand-in keeps the names and signatures the project calls
(``torch.npu`` streams and events, ``torch_npu.atb.npu_paged_cache_load``,
``torch_npu._npu_reshape_and_cache``, ``torch_npu.npu_scatter_pa_kv_cache``)
and runs them on CPU tensors with plain torch, so NPU code paths can be
exercised for their logic. Activate it with :func:`install` (or the
``fake_torch_npu`` fixture) and remove it with :func:`uninstall`.

Where the real operators are strict, so is the fake: the ATB index tensors
(``block_table``, ``context_lens``, ``seq_starts``, ``slot_indices``) must be
int32.

Import vLLM (and so transformers) *before* installing the fake: transformers
probes ``importlib.util.find_spec("torch_npu")`` on import, which raises
``ValueError`` for this spec-less module (and giving it a spec would make
transformers import NPU attention kernels the fake does not have).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

#: Every call made through the fake, as ``(name, kwargs keys)``, for assertions.
CALLS: list[tuple[str, tuple[str, ...]]] = []


class _Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass


class _Stream:
    def __init__(self, device: Any = None, priority: int = 0) -> None:
        self.device = device

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def record_event(self, event: Any = None) -> _Event:
        event = event or _Event()
        event.record(self)
        return event


_current = _Stream()


def _npu_namespace() -> types.SimpleNamespace:
    state = {"device": 0}

    @contextlib.contextmanager
    def stream(s: Any) -> Iterator[Any]:
        yield s

    def set_device(dev: Any) -> None:
        state["device"] = int(str(dev).split(":")[-1]) if ":" in str(dev) else int(dev)

    return types.SimpleNamespace(
        Stream=_Stream, Event=_Event, current_stream=lambda device=None: _current,
        stream=stream, synchronize=lambda device=None: None, set_device=set_device,
        current_device=lambda: state["device"], is_available=lambda: True,
        device_count=lambda: 1,
    )


def _require_int32(op: str, **tensors: torch.Tensor | None) -> None:
    """The ATB operators take their index tensors as int32 only; so does the fake."""
    for name, t in tensors.items():
        if t is not None and t.dtype != torch.int32:
            raise RuntimeError(f"{op}: {name} must be int32 (as the real operator requires), "
                               f"got {t.dtype}")


def _paged_cache_load(key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, context_lens: torch.Tensor, *,
                      seq_starts: torch.Tensor | None = None, key: torch.Tensor | None = None,
                      value: torch.Tensor | None = None, **_: Any) -> None:
    """``torch_npu.atb.npu_paged_cache_load``: gather tokens of each sequence from the paged cache.

    Caches are ``(num_blocks, block_size, heads, head_size)``; ``block_table`` is
    ``(batch, max_blocks)``; ``context_lens`` the tokens of each sequence; output
    rows are written to ``key``/``value`` ``(total_tokens, heads, head_size)``.
    """
    CALLS.append(("npu_paged_cache_load", tuple(sorted(_))))
    _require_int32("npu_paged_cache_load", block_table=block_table, context_lens=context_lens,
                   seq_starts=seq_starts)
    block_size = key_cache.shape[1]
    row = 0
    starts = seq_starts.tolist() if seq_starts is not None else [0] * len(context_lens)
    for b, n in enumerate(context_lens.tolist()):
        for t in range(int(n)):
            pos = int(starts[b]) + t
            blk = int(block_table[b, pos // block_size])
            assert key is not None and value is not None
            key[row] = key_cache[blk, pos % block_size]
            value[row] = value_cache[blk, pos % block_size]
            row += 1


def _reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_indices: torch.Tensor) -> None:
    """``torch_npu._npu_reshape_and_cache``: write token rows into their slots."""
    CALLS.append(("_npu_reshape_and_cache", ()))
    _require_int32("_npu_reshape_and_cache", slot_indices=slot_indices)
    block_size = key_cache.shape[1]
    for i, slot in enumerate(slot_indices.tolist()):
        if slot < 0:
            continue
        key_cache[slot // block_size, slot % block_size] = key[i]
        value_cache[slot // block_size, slot % block_size] = value[i]


def _scatter_pa_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         **_: Any) -> None:
    """``torch_npu.npu_scatter_pa_kv_cache``: same contract as reshape-and-cache (ND layout).

    K and V may differ in their last dims (MLA's latent and rope parts);
    ``slot_mapping`` may be int32 or int64.
    """
    CALLS.append(("npu_scatter_pa_kv_cache", tuple(sorted(_))))
    _reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.to(torch.int32))
    CALLS.pop()


def install() -> types.ModuleType:
    """Put the fake into ``sys.modules['torch_npu']`` and ``torch.npu``; returns the module."""
    mod = types.ModuleType("torch_npu")
    mod.__dict__["__fake__"] = True
    mod.npu = _npu_namespace()  # type: ignore[attr-defined]
    mod.atb = types.SimpleNamespace(npu_paged_cache_load=_paged_cache_load)  # type: ignore[attr-defined]
    mod._npu_reshape_and_cache = _reshape_and_cache  # type: ignore[attr-defined]
    mod.npu_scatter_pa_kv_cache = _scatter_pa_kv_cache  # type: ignore[attr-defined]
    sys.modules["torch_npu"] = mod
    torch.npu = mod.npu  # type: ignore[attr-defined]
    CALLS.clear()
    return mod


def uninstall() -> None:
    """Remove the fake again."""
    sys.modules.pop("torch_npu", None)
    if hasattr(torch, "npu") and isinstance(torch.npu, types.SimpleNamespace):
        del torch.npu  # type: ignore[attr-defined]
