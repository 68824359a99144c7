# SPDX-License-Identifier: Apache-2.0
"""Choosing an implementation: argument, environment, device."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vllm_ascend.distributed import kernels
from vllm_ascend.distributed.kernels import (
    ENV_IMPL,
    Impl,
    UnknownImplError,
    gather_blocks,
    impl_reference,
    impl_torch,
    resolve_impl,
)


def test_device_decides_by_default() -> None:
    assert resolve_impl(torch.device("cpu")) is Impl.TORCH
    assert resolve_impl(torch.device("meta")) is Impl.TORCH
    assert resolve_impl(torch.device("cpu"), "auto") is Impl.TORCH


def test_argument_beats_environment_beats_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_IMPL, "reference")
    assert resolve_impl(torch.device("cpu")) is Impl.REFERENCE
    assert resolve_impl(torch.device("cpu"), Impl.TORCH) is Impl.TORCH
    assert resolve_impl(torch.device("cpu"), " NPU ") is Impl.NPU
    monkeypatch.setenv(ENV_IMPL, "auto")
    assert resolve_impl(torch.device("cpu")) is Impl.TORCH


def test_environment_forces_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    used: list[str] = []
    for mod in (impl_reference, impl_torch):
        real = mod.gather
        monkeypatch.setattr(mod, "gather",
                            lambda *a, _m=mod.__name__, _r=real: (used.append(_m), _r(*a))[1])
    cache = torch.arange(12.0).reshape(4, 3)
    gather_blocks(cache, [1])
    monkeypatch.setenv(ENV_IMPL, "reference")
    gather_blocks(cache, [1])
    assert [u.rsplit(".", 1)[1] for u in used] == ["impl_torch", "impl_reference"]


def test_unknown_names_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UnknownImplError, match="'fast'.*reference"):
        gather_blocks(torch.zeros(2, 2), [0], impl="fast")
    monkeypatch.setenv(ENV_IMPL, "cuda")
    with pytest.raises(UnknownImplError, match=rf"\${ENV_IMPL}"):
        gather_blocks(torch.zeros(2, 2), [0])
    assert isinstance(UnknownImplError("x"), ValueError)


def test_version_and_public_names() -> None:
    assert kernels.__version__
    for name in kernels.__all__:
        assert hasattr(kernels, name), name


def test_namespace_stays_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Installing ascend-kernels must not hide other portions of ``vllm_ascend.distributed``."""
    import vllm_ascend.distributed as dist_ns

    assert getattr(dist_ns, "__file__", None) is None  # a namespace package, no __init__.py
    foreign = tmp_path / "vllm_ascend" / "distributed" / "foreign_kernels_probe.py"
    foreign.parent.mkdir(parents=True)
    foreign.write_text(textwrap.dedent("""
        # SPDX-License-Identifier: Apache-2.0
        VALUE = 42
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    mod = importlib.import_module("vllm_ascend.distributed.foreign_kernels_probe")
    assert mod.VALUE == 42
    sys.modules.pop("vllm_ascend.distributed.foreign_kernels_probe", None)
