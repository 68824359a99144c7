# SPDX-License-Identifier: Apache-2.0
"""Claims on host memory that processes starting side by side are about to touch
(``core.host_memory``): the race of their checks against the memory available, closed."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.core import host_memory
from vllm_ascend.distributed.kv_transfer.core.host_memory import (
    HostMemoryError,
    claim_host_memory,
)

MIB = 1 << 20


def _available() -> int:
    return 1000 * MIB  # the memory the host has available (unchanged: nothing is touched)


def _claimer(path: str, conn: Any) -> None:
    """A worker starting beside the test: claims 600 MiB, touches 512 of them on command,
    then waits until it is killed (never releasing its claim)."""
    claim = claim_host_memory(600 * MIB, what="worker", path=path, available=_available)
    conn.send("claimed")
    assert conn.recv() == "touch"
    claim.advance(512 * MIB)
    conn.send("touched")
    conn.recv()


def test_a_claim_of_another_process_counts_until_touched_or_gone(tmp_path: Path) -> None:
    path = str(tmp_path / "claims.json")
    here, there = mp.get_context("fork").Pipe()
    child = mp.get_context("fork").Process(target=_claimer, args=(path, there), daemon=True)
    child.start()
    try:
        assert here.poll(30) and here.recv() == "claimed"
        # both would pass a check of the memory available alone: 600 + 600 > 1000
        with pytest.raises(HostMemoryError, match="less the 600 MiB other processes") as err:
            claim_host_memory(600 * MIB, what="worker", path=path, available=_available)
        assert (err.value.need, err.value.claimed) == (600 * MIB, 600 * MIB)
        claim_host_memory(400 * MIB, what="worker", path=path, available=_available).release()
        here.send("touch")
        assert here.poll(30) and here.recv() == "touched"
        # 512 MiB of it are resident now (the host's available memory would show them)
        assert sum(json.loads(Path(path).read_text()).values()) == 88 * MIB
        with claim_host_memory(900 * MIB, what="worker", path=path, available=_available):
            assert sum(json.loads(Path(path).read_text()).values()) == 988 * MIB
        assert sum(json.loads(Path(path).read_text()).values()) == 88 * MIB  # released
    finally:
        child.kill()
        child.join(10)
    # a process that is gone claims nothing, released or not
    claim_host_memory(1000 * MIB, what="worker", path=path, available=_available).release()
    assert json.loads(Path(path).read_text()) == {}


def test_progress_is_written_in_steps_and_the_claim_drops_to_zero(tmp_path: Path) -> None:
    path = str(tmp_path / "claims.json")
    claim = claim_host_memory(1000 * MIB, what="x", path=path, available=_available)
    claim.advance(100 * MIB)  # below REPORT_BYTES: not written yet
    assert json.loads(Path(path).read_text()) == {claim.key: 1000 * MIB}
    claim.advance(host_memory.REPORT_BYTES)
    assert json.loads(Path(path).read_text()) == {claim.key: 1000 * MIB - 100 * MIB
                                                  - host_memory.REPORT_BYTES}
    claim.advance(2000 * MIB)  # all of it touched (and more): nothing pending, written
    assert claim.pending == 0 and json.loads(Path(path).read_text()) == {}


def test_a_broken_or_unusable_claims_file_falls_back_to_the_memory_available(
        tmp_path: Path) -> None:
    path = tmp_path / "claims.json"
    for junk in ("not json", "[1, 2]", '{"1:2": "lots", "x": -5}'):
        path.write_text(junk)
        claim_host_memory(1000 * MIB, what="x", path=str(path), available=_available).release()
        assert json.loads(path.read_text()) == {}
    unusable = str(tmp_path / "missing-dir" / "claims.json")
    with pytest.raises(HostMemoryError, match="x: 1001 MiB is more than the 1000 MiB"):
        claim_host_memory(1001 * MIB, what="x", path=unusable, available=_available)
    claim = claim_host_memory(1000 * MIB, what="x", path=unusable, available=_available)
    claim.advance(1000 * MIB)
    claim.release()  # nothing recorded, nothing raised
    # memory available unknown (not Linux): nothing is refused
    claim_host_memory(1 << 50, what="x", path=str(path), available=lambda: None).release()


def test_the_default_file_is_per_user_and_the_environment_names_another(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import os

    monkeypatch.delenv(host_memory.LEDGER_ENV, raising=False)
    assert host_memory.ledger_path().endswith(f"vllm-ascend-kv-host-memory-{os.getuid()}.json")
    monkeypatch.setenv(host_memory.LEDGER_ENV, str(tmp_path / "mine.json"))
    assert host_memory.ledger_path() == str(tmp_path / "mine.json")
