# SPDX-License-Identifier: Apache-2.0
"""``bench engine`` (raw Mooncake transfer engine, two processes) and the benchutil helpers."""

from __future__ import annotations

import argparse
import io
import json
import socket
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_kv_testing.requires import require, require_binary
from vllm_ascend.distributed.kv_transfer.bench import benchutil, mooncake_store
from vllm_ascend.distributed.kv_transfer.bench import engine as bench_engine
from vllm_ascend.distributed.kv_transfer.core.tooling.cli import main

KIB = 1024


# ---------------------------------------------------------------------- benchutil
def test_median_and_ratio_ignore_missing_values() -> None:
    assert benchutil.median([3.0, None, 1.0, float("nan"), 2.0]) == 2.0
    assert benchutil.median([None]) is None
    assert benchutil.ratio(1.0, 4.0) == 0.25
    assert benchutil.ratio(1.0, 0.0) is None
    assert benchutil.ratio(None, 2.0) is None


def test_goal_check() -> None:
    assert benchutil.goal_check(0.95, at_least=0.9) is True
    assert benchutil.goal_check(0.85, at_least=0.9) is False
    assert benchutil.goal_check(0.05, at_most=0.1) is True
    assert benchutil.goal_check(None, at_most=0.1) is None
    with pytest.raises(ValueError, match="exactly one bound"):
        benchutil.goal_check(1.0)
    with pytest.raises(ValueError, match="exactly one bound"):
        benchutil.goal_check(1.0, at_least=0.1, at_most=2.0)


def test_glibc_copy_facts_read_the_loaders_tunables(monkeypatch: pytest.MonkeyPatch) -> None:
    listing = ("glibc.malloc.arena_max: 0x0 (min: 0x1, max: 0xffffffffffffffff)\n"
               "glibc.cpu.x86_non_temporal_threshold: 0xb580000 (min: 0x4040, max: 0xfff)\n"
               "glibc.cpu.x86_rep_movsb_threshold: 0x840 (min: 0x200, max: 0xfff)\n"
               "glibc.cpu.x86_shared_cache_size: garbage\n")
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **_kw: Any) -> Any:
        calls.append(cmd)
        return argparse.Namespace(stdout=listing)

    monkeypatch.setattr(benchutil, "_dynamic_loader", lambda: "/lib64/ld-linux-x86-64.so.2")
    monkeypatch.setattr(benchutil.subprocess, "run", fake_run)
    facts = benchutil.glibc_copy_facts()
    assert calls == [["/lib64/ld-linux-x86-64.so.2", "--list-tunables"]]
    assert facts["non_temporal_threshold"] == 0xb580000
    assert facts["rep_movsb_threshold"] == 0x840
    assert "shared_cache_size" not in facts  # unreadable: left out, not guessed

    monkeypatch.setattr(benchutil, "_dynamic_loader", lambda: None)
    assert set(benchutil.glibc_copy_facts()) <= {"glibc"}


def test_machine_info_of_this_linux_records_how_glibc_copies() -> None:
    loader = benchutil._dynamic_loader()
    assert loader is not None and "ld-linux" in loader  # the test machines run glibc
    memcpy = benchutil.machine_info()["memcpy"]
    assert memcpy["glibc"].count(".") == 1
    assert memcpy["non_temporal_threshold"] > 0


def test_steps_report_progress_on_stderr() -> None:
    err = io.StringIO()
    with redirect_stderr(err):
        steps = benchutil.Steps(2, "demo")
        steps.step("first")
        steps.note("inside")
        steps.step("second")
    lines = err.getvalue().splitlines()
    assert "[1/2] first" in lines[0] and "inside" in lines[1] and "[2/2] second" in lines[2]
    assert all(line.startswith("demo ") for line in lines)


@pytest.mark.mooncake
def test_loopback_store_starts_answers_and_stops(tmp_path: Path) -> None:
    require("mooncake.store")
    require_binary("mooncake_master", dist="mooncake-transfer-engine-non-cuda")
    store = mooncake_store.LoopbackMooncakeStore("64MB", tmp_path).start()
    try:
        cfg = store.config(local_buffer_size="16MB")
        assert cfg["master_server_address"] == store.master_address
        assert cfg["global_segment_size"] == 0 and cfg["local_buffer_size"] == "16MB"
        with socket.create_connection(("127.0.0.1", store.rpc_port), timeout=2):
            pass
        assert store.master.proc is not None and store.holder is not None
        master, holder = store.master.proc, store.holder.proc
        assert holder is not None
    finally:
        store.stop()
    assert master.poll() is not None and holder.poll() is not None


@pytest.mark.mooncake
def test_touch_segment_writes_the_holders_memory_and_leaves_the_store_empty(
        tmp_path: Path) -> None:
    require("mooncake.store")
    require_binary("mooncake_master", dist="mooncake-transfer-engine-non-cuda")

    def resident(proc: Any) -> int:
        with open(f"/proc/{proc.pid}/status") as f:
            return int(f.read().split("VmRSS:")[1].split()[0]) * 1024

    store = mooncake_store.LoopbackMooncakeStore("64MB", tmp_path).start()
    try:
        assert store.holder is not None
        before = resident(store.holder.proc)
        done = store.touch_segment()
        assert done["bytes"] == 64 << 20 and done["left"] == 0  # written, then removed
        assert resident(store.holder.proc) - before >= 48 << 20  # its pages written
        again = store.touch_segment()  # the emptied segment takes the same objects again
        assert again["bytes"] == 64 << 20 and again["left"] == 0
    finally:
        store.stop()
    bare = mooncake_store.LoopbackMooncakeStore("", tmp_path / "bare")
    with pytest.raises(RuntimeError, match="no segment holder"):
        bare.touch_segment()


# ---------------------------------------------------------------------- sweep plan
@given(block_kib=st.sampled_from([16, 64, 1024, 4096]), batch=st.integers(1, 128),
       conc=st.integers(1, 8), buffer_mib=st.integers(1, 256))
def test_feasible_points_fit_without_touching(block_kib: int, batch: int, conc: int,
                                              buffer_mib: int) -> None:
    point = bench_engine.Point("read", block_kib * KIB, batch, conc)
    buf = buffer_mib << 20
    ok = bench_engine.feasible(point, buf)
    # every thread has a slice; a slot is two blocks wide, so blocks never touch
    assert ok == (buf // conc // (2 * block_kib * KIB) >= batch)
    if ok:
        import random

        rng = random.Random(0)
        offs = [o for t in range(conc) for o in bench_engine._offsets(point, t, buf, rng)]
        assert len(set(offs)) == len(offs)
        ends = sorted((o, o + point.block_bytes) for o in offs)
        assert ends[-1][1] <= buf
        assert all(b[0] - a[1] >= point.block_bytes for a, b in zip(ends, ends[1:], strict=False))


def test_sweep_points_split_feasible_and_skipped() -> None:
    ok, skipped = bench_engine.sweep_points((64 * KIB, 4096 * KIB), (1, 64), (1,),
                                            ("read", "write"), 64 << 20)
    assert len(ok) + len(skipped) == 8
    assert {(p.block_bytes, p.batch) for p in skipped} == {(4096 * KIB, 64)}


@pytest.mark.parametrize("text", ["", "a,b", "0", "4,-1"])
def test_bad_lists_are_rejected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
        bench_engine._int_list(text)


def test_unknown_op_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown op"):
        main(["bench", "engine", "--ops", "read,copy", "--out", str(tmp_path)])


# ---------------------------------------------------------------------- real engine
@pytest.fixture(scope="module")
def target() -> Any:
    require("mooncake.engine")
    t = bench_engine.Target("127.0.0.1", "tcp", 8 << 20)
    yield t
    t.close()


@pytest.mark.mooncake
def test_verify_passes_on_the_real_engine_and_catches_wrong_bytes(target: Any) -> None:
    import random

    import numpy as np

    from vllm_ascend.distributed.kv_transfer.core.transfer_engine import MooncakeTransferEngine

    local = np.zeros(8 << 20, dtype=np.uint8)
    te = MooncakeTransferEngine("127.0.0.1", "tcp")
    te.register_memory(int(local.ctypes.data), local.nbytes)
    try:
        rng = random.Random(1)
        for bb in (16 * KIB, 256 * KIB):
            bench_engine.verify(te.raw, target, local, bb, rng)

        class Shifted:  # the remote addresses are off by one byte: data must not match
            session, base = target.session, target.base + 1
            crc = target.crc

        with pytest.raises(RuntimeError, match="wrong data"):
            bench_engine.verify(te.raw, Shifted(), local, 16 * KIB, rng)
    finally:
        te.unregister_memory(int(local.ctypes.data))


@pytest.mark.mooncake
def test_bench_engine_command_writes_the_sweep(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    require("mooncake.engine")
    rc = main(["bench", "engine", "--block-kib", "16,256", "--batch", "1,4",
               "--concurrency", "1,2", "--buffer-mib", "2", "--min-time", "0.02",
               "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "engine.json").read_text())
    assert doc["benchmark"] == "engine" and doc["machine"]["cpus"]
    assert doc["verified"] == [16, 256]
    rows = doc["rows"]
    # 2 ops x 2 sizes x 2 batches x 2 threads; 256 KiB x 4 blocks x 2 threads does not fit 2 MiB
    assert len(rows) + len(doc["skipped"]) == 16
    assert {(s["block_kib"], s["batch"], s["concurrency"]) for s in doc["skipped"]} == {
        (256, 4, 2)}
    assert all(r["GBps"] > 0 and r["calls"] >= 1 and r["p99_ms"] >= r["p50_ms"] for r in rows)
    assert {(b["op"], b["block_kib"]) for b in doc["best"]} == {
        (op, kib) for op in ("read", "write") for kib in (16, 256)}
    out = capsys.readouterr().out
    assert "ceiling per block size" in out and "results:" in out
