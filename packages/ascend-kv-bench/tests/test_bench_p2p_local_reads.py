# SPDX-License-Identifier: Apache-2.0
"""A D worker loading from a P worker in another process of the same host copies P's blocks
from P's memory (``core.local_reads``), with and without a deployment key, and with the
path turned off reads over the transfer engine. Real workers, real side channels, a real
Mooncake engine: the P process is ``bench p2p``'s."""

from __future__ import annotations

import ctypes
import os
import secrets

import pytest
import torch

from vllm_ascend.distributed.kv_transfer.bench import p2p as bench
from vllm_ascend.distributed.kv_transfer.core import local_reads
from vllm_ascend.distributed.kv_transfer.core.local_reads import LOCAL_READS_ENV

pytestmark = pytest.mark.skipif(not local_reads.available(),
                                reason="process_vm_readv needs Linux 3.2 or later")


def _loaded(p: bench._Pair, d_blocks: list[int]) -> None:
    """D's blocks hold what P's do: P fills layer ``i`` with ``i + 1``."""
    assert p.d.layout is not None
    for i, region in enumerate(p.d.layout.regions):
        for b in d_blocks:
            buf = torch.empty(region.block_len, dtype=torch.uint8)
            ctypes.memmove(buf.data_ptr(), region.base_addr + b * region.block_stride,
                           region.block_len)
            assert bool((buf.view(torch.float16) == i + 1).all()), f"layer {i} block {b}"


def _run(p: bench._Pair) -> None:
    for n, (d_blocks, p_blocks) in enumerate([([0], [5]), (list(range(1, 17)),
                                                           list(range(40, 56)))]):
        for mode in ("window", "ahead"):
            p.load(f"req-{mode}-{n}", d_blocks, p_blocks, mode)
            _loaded(p, d_blocks)


def test_reads_copy_from_p_memory_with_and_without_a_key(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    for key in (None, secrets.token_hex(32)):
        monkeypatch.setenv(LOCAL_READS_ENV, "1")
        p = bench._Pair(key)
        try:
            p.connect()
            assert p.d.te is not None
            before = p.d.te.stats.local_reads
            _run(p)
            assert p.d.te.is_local_peer(p.session)
            assert p.d.te.stats.local_reads - before >= 4
        finally:
            p.stop()


def test_reads_go_over_the_engine_with_the_path_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOCAL_READS_ENV, "0")
    p = bench._Pair(None)
    try:
        p.connect()
        assert p.d.te is not None
        before = (p.d.te.stats.reads, p.d.te.stats.local_reads)
        _run(p)
        assert not p.d.te.is_local_peer(p.session)
        assert p.d.te.stats.reads - before[0] >= 4
        assert p.d.te.stats.local_reads == before[1]
        assert os.environ[LOCAL_READS_ENV] == "0"
    finally:
        p.stop()
