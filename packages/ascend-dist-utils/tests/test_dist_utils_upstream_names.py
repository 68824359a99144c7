# SPDX-License-Identifier: Apache-2.0
"""``get_decode_context_model_parallel_world_size`` / ``_rank`` and ``split_tensor_along_first_dim``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_ascend.distributed import utils
from vllm_ascend.distributed.device_communicators.errors import SplitSizeError


def test_split_tensor_along_first_dim() -> None:
    x = torch.arange(24).reshape(6, 4)
    parts = utils.split_tensor_along_first_dim(x, 3)
    assert isinstance(parts, tuple) and len(parts) == 3
    assert [p.tolist() for p in parts] == [x[0:2].tolist(), x[2:4].tolist(), x[4:6].tolist()]
    assert parts[1].data_ptr() == x[2].data_ptr()  # views, as torch.split
    t = torch.arange(24).reshape(4, 6).t()  # non-contiguous rows
    views = utils.split_tensor_along_first_dim(t, 2)
    assert not views[0].is_contiguous()
    copies = utils.split_tensor_along_first_dim(t, 2, contiguous_split_chunks=True)
    assert all(c.is_contiguous() for c in copies)
    assert all(torch.equal(a, b) for a, b in zip(views, copies, strict=True))
    for bad in (4, 0, -1):
        with pytest.raises(SplitSizeError, match=f"size 6 does not split into {bad}"):
            utils.split_tensor_along_first_dim(x, bad)


def test_decode_context_parallel_size_and_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.distributed.parallel_state as ps

    monkeypatch.setattr(ps, "_DCP", None)
    with pytest.raises(AssertionError, match="decode context model parallel group"):
        utils.get_decode_context_model_parallel_world_size()
    monkeypatch.setattr(ps, "_DCP", SimpleNamespace(world_size=4, rank_in_group=3))
    assert utils.get_decode_context_model_parallel_world_size() == 4
    assert utils.get_decode_context_model_parallel_rank() == 3
