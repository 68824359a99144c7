# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the ascend-kernels tests (``fake_torch_npu`` comes from the ascend-kv-testing plugin)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Test modules load with --import-mode=importlib; make the shared strategies
# module (uniquely named) importable beside them.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(autouse=True)
def _no_impl_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests choose implementations explicitly; an exported override must not leak in."""
    monkeypatch.delenv("VLLM_ASCEND_KERNELS_IMPL", raising=False)
