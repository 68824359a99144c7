# SPDX-License-Identifier: Apache-2.0
"""``pyhccl_wrapper`` and ``PyHcclCommunicator`` against a stand-in ``libhccl.so``.

The stand-in is compiled here (``cc -shared -fPIC``) from C with HCCL's
symbols and signatures. It records the arguments it receives and writes
results the tests can predict (all-reduce doubles float32 input, broadcast
fills int32 buffers), so these tests check that every argument really crosses
the ctypes boundary with the declared types.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

from vllm_ascend.distributed.device_communicators import pyhccl_wrapper as pw
from vllm_ascend.distributed.device_communicators.errors import HcclError, HcclLibraryError
from vllm_ascend.distributed.device_communicators.pyhccl import PyHcclCommunicator

STANDIN_C = r"""
#include <stdint.h>
#include <string.h>

typedef struct { char internal[4108]; } HcclRootInfo;

static int64_t ints[8];        /* nranks, rank, dtype, op, root, count, destroyed, calls */
static void *ptrs[5];          /* send, recv, comm, stream, destroyed comm */
static unsigned char root_seen[16];
static int fail_code = 0;

const char *HcclGetErrorString(int code) { return code == 7 ? "stand-in error seven" : "?"; }

int HcclGetRootInfo(HcclRootInfo *info) {
    for (int i = 0; i < 4108; i++) info->internal[i] = (char)(i % 251);
    return 0;
}

int HcclCommInitRootInfo(uint32_t n, const HcclRootInfo *info, uint32_t rank, void **comm) {
    ints[0] = n; ints[1] = rank;
    memcpy(root_seen, info->internal + 4092, 16);
    *comm = (void *)0xC0FFEE;
    return 0;
}

static void record(void *s, void *r, uint64_t count, int dtype, int op, int root, void *comm,
                   void *stream) {
    ptrs[0] = s; ptrs[1] = r; ints[5] = (int64_t)count; ints[2] = dtype; ints[3] = op;
    ints[4] = root; ptrs[2] = comm; ptrs[3] = stream; ints[7]++;
}

int HcclAllReduce(void *s, void *r, uint64_t count, int dtype, int op, void *comm,
                  void *stream) {
    record(s, r, count, dtype, op, -1, comm, stream);
    if (fail_code) return fail_code;
    if (dtype == 4)
        for (uint64_t i = 0; i < count; i++) ((float *)r)[i] = 2.0f * ((float *)s)[i];
    return 0;
}

int HcclAllGather(void *s, void *r, uint64_t count, int dtype, void *comm, void *stream) {
    record(s, r, count, dtype, -1, -1, comm, stream);
    return fail_code;
}

int HcclSend(void *b, uint64_t count, int dtype, uint32_t peer, void *comm, void *stream) {
    record(b, 0, count, dtype, -1, (int)peer, comm, stream);
    return fail_code;
}

int HcclRecv(void *b, uint64_t count, int dtype, uint32_t peer, void *comm, void *stream) {
    record(0, b, count, dtype, -1, (int)peer, comm, stream);
    return fail_code;
}

int HcclBroadcast(void *b, uint64_t count, int dtype, uint32_t root, void *comm,
                  void *stream) {
    record(b, 0, count, dtype, -1, (int)root, comm, stream);
    if (fail_code) return fail_code;
    if (dtype == 2)
        for (uint64_t i = 0; i < count; i++) ((int32_t *)b)[i] = 100 + (int32_t)i + (int32_t)root;
    return 0;
}

int HcclCommDestroy(void *comm) { ptrs[4] = comm; ints[6]++; return 0; }

/* test hooks */
int64_t standin_int(int i) { return ints[i]; }
void *standin_ptr(int i) { return ptrs[i]; }
void standin_root_seen(unsigned char *out) { memcpy(out, root_seen, 16); }
void standin_fail(int code) { fail_code = code; }
"""

NRANKS, RANK, DTYPE, OP, ROOT, COUNT, DESTROYED, CALLS = range(8)
SEND, RECV, COMM, STREAM, DESTROYED_COMM = range(5)


def _compile(source: str, out: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("these tests compile a stand-in libhccl.so and need a C compiler (cc or "
                    "gcc) on PATH: install one (Debian: apt-get install gcc)")
    src = out.with_suffix(".c")
    src.write_text(source)
    subprocess.run([cc, "-shared", "-fPIC", "-O0", "-o", str(out), str(src)], check=True)
    return out


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """(path, ctypes handle with the test hooks) of the stand-in library."""
    path = _compile(STANDIN_C, tmp_path_factory.mktemp("hccl") / "libhccl_standin.so")
    hooks = ctypes.CDLL(str(path))  # same handle as the wrapper's: dlopen shares state
    hooks.standin_int.restype = ctypes.c_int64
    hooks.standin_int.argtypes = [ctypes.c_int]
    hooks.standin_ptr.restype = ctypes.c_void_p
    hooks.standin_ptr.argtypes = [ctypes.c_int]
    hooks.standin_fail.argtypes = [ctypes.c_int]
    hooks.standin_root_seen.argtypes = [ctypes.c_char_p]
    return str(path), hooks


def _root_seen(hooks: Any) -> bytes:
    buf = ctypes.create_string_buffer(16)
    hooks.standin_root_seen(buf)
    return buf.raw


# the expected C signatures (hccl.h), independent of the module's own table
EXPECTED = {
    "HcclGetErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "HcclGetRootInfo": (ctypes.c_int, [ctypes.POINTER(pw.hcclUniqueId)]),
    "HcclCommInitRootInfo": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(pw.hcclUniqueId),
                                            ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]),
    "HcclAllReduce": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                     ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                     ctypes.c_void_p]),
    "HcclAllGather": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                     ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]),
    "HcclSend": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_void_p]),
    "HcclRecv": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_void_p]),
    "HcclBroadcast": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                     ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]),
    "HcclCommDestroy": (ctypes.c_int, [ctypes.c_void_p]),
}


def test_missing_library_names_hccl_so_path(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HCCL_SO_PATH", str(tmp_path / "libhccl.so"))
    with pytest.raises(HcclLibraryError, match="HCCL_SO_PATH") as info:
        pw.HCCLLibrary()
    assert str(tmp_path / "libhccl.so") in str(info.value)
    assert isinstance(info.value, OSError)
    monkeypatch.delenv("HCCL_SO_PATH")
    assert pw.find_hccl_library() == "libhccl.so"
    if not os.path.exists("/usr/local/Ascend"):
        with pytest.raises(HcclLibraryError, match="HCCL_SO_PATH=<unset>"):
            pw.HCCLLibrary()


def test_library_without_hccl_symbols(tmp_path: Path) -> None:
    path = _compile("int not_hccl(void) { return 0; }\n", tmp_path / "libother.so")
    with pytest.raises(HcclLibraryError, match="no symbol HcclGetErrorString.*HCCL_SO_PATH"):
        pw.HCCLLibrary(str(path))


def test_signatures_match_hccl_h(standin: tuple[str, Any]) -> None:
    lib = pw.HCCLLibrary(standin[0])
    assert set(lib._funcs) == set(EXPECTED)
    for name, (restype, argtypes) in EXPECTED.items():
        f = lib._funcs[name]
        assert f.restype is restype, name
        assert len(f.argtypes) == len(argtypes), name
        for got, want in zip(f.argtypes, argtypes, strict=True):
            # POINTER(x) builds a cached type: identity holds for equal pointees
            assert got is want or ctypes.sizeof(got) == ctypes.sizeof(want), (name, got, want)
            assert got._type_ == want._type_, (name, got, want)
    # one CDLL and one bound table per path
    assert pw.HCCLLibrary(standin[0])._funcs is lib._funcs


def test_arguments_cross_the_boundary(standin: tuple[str, Any]) -> None:
    path, hooks = standin
    lib = pw.HCCLLibrary(path)
    uid = lib.hcclGetUniqueId()
    assert bytes(uid.internal)[:5] == bytes([0, 1, 2, 3, 4])
    assert bytes(uid.internal)[251] == 0 and len(bytes(uid.internal)) == 4108
    comm = lib.hcclCommInitRank(4, uid, 3)
    assert comm.value == 0xC0FFEE
    assert (hooks.standin_int(NRANKS), hooks.standin_int(RANK)) == (4, 3)
    assert _root_seen(hooks) == bytes(i % 251 for i in range(4092, 4108))

    x = torch.arange(5, dtype=torch.float32)
    y = torch.empty_like(x)
    lib.hcclAllReduce(pw.buffer_type(x.data_ptr()), pw.buffer_type(y.data_ptr()), 5,
                      pw.hcclDataTypeEnum.from_torch(x.dtype),
                      pw.hcclRedOpTypeEnum.from_torch(ReduceOp.MAX), comm,
                      pw.aclrtStream_t(0x5150))
    assert torch.equal(y, 2 * x)
    assert hooks.standin_ptr(SEND) == x.data_ptr() and hooks.standin_ptr(RECV) == y.data_ptr()
    assert (hooks.standin_int(COUNT), hooks.standin_int(DTYPE), hooks.standin_int(OP)) == (5, 4, 2)
    assert hooks.standin_ptr(COMM) == 0xC0FFEE and hooks.standin_ptr(STREAM) == 0x5150

    big = 2**33 + 7  # uint64_t count: no truncation to 32 bits
    lib.hcclAllGather(pw.buffer_type(0), pw.buffer_type(0), big, 11, comm, pw.aclrtStream_t(1))
    assert hooks.standin_int(COUNT) == big and hooks.standin_int(DTYPE) == 11

    b = torch.zeros(3, dtype=torch.int32)
    lib.hcclBroadcast(pw.buffer_type(b.data_ptr()), 3, pw.hcclDataTypeEnum.from_torch(b.dtype),
                      2, comm, pw.aclrtStream_t(None))
    assert b.tolist() == [102, 103, 104] and hooks.standin_int(ROOT) == 2
    assert hooks.standin_ptr(STREAM) is None

    lib.hcclSend(pw.buffer_type(b.data_ptr()), 3, 2, 1, comm, pw.aclrtStream_t(9))
    assert hooks.standin_int(ROOT) == 1 and hooks.standin_ptr(SEND) == b.data_ptr()
    lib.hcclRecv(pw.buffer_type(b.data_ptr()), 3, 2, 0, comm, pw.aclrtStream_t(9))
    assert hooks.standin_int(ROOT) == 0 and hooks.standin_ptr(RECV) == b.data_ptr()

    hooks.standin_fail(7)
    try:
        with pytest.raises(HcclError, match="HcclBroadcast returned 7: stand-in error seven") as e:
            lib.hcclBroadcast(pw.buffer_type(b.data_ptr()), 3, 2, 0, comm, pw.aclrtStream_t(0))
        assert e.value.code == 7 and isinstance(e.value, RuntimeError)
    finally:
        hooks.standin_fail(0)
    destroyed = hooks.standin_int(DESTROYED)
    lib.hcclCommDestroy(comm)
    assert hooks.standin_int(DESTROYED) == destroyed + 1
    assert hooks.standin_ptr(DESTROYED_COMM) == 0xC0FFEE


def test_enums() -> None:
    assert pw.hcclDataTypeEnum.from_torch(torch.bfloat16) == 11
    assert pw.hcclDataTypeEnum.from_torch(torch.int64) == 5
    with pytest.raises(ValueError, match="complex64"):
        pw.hcclDataTypeEnum.from_torch(torch.complex64)
    assert [pw.hcclRedOpTypeEnum.from_torch(op) for op in
            (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MAX, ReduceOp.MIN)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="Unsupported op"):
        pw.hcclRedOpTypeEnum.from_torch(ReduceOp.AVG)


class StatelessGroup:
    """vLLM's ``StatelessProcessGroup`` as the communicator sees it (rank, size, broadcast)."""

    def __init__(self, rank: int, world_size: int, root_bytes: bytes | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.root_bytes = root_bytes
        self.sent: list[Any] = []

    def broadcast_obj(self, obj: Any, src: int) -> Any:
        assert src == 0
        self.sent.append(obj)
        return obj if self.rank == 0 else self.root_bytes


def test_communicator_rank0_stateless(standin: tuple[str, Any]) -> None:
    path, hooks = standin
    calls = hooks.standin_int(CALLS)
    comm = PyHcclCommunicator(StatelessGroup(0, 2), "cpu", library_path=path)
    assert comm.available and not comm.disabled and comm.comm is not None
    assert comm.comm.value == 0xC0FFEE
    assert (hooks.standin_int(NRANKS), hooks.standin_int(RANK)) == (2, 0)
    assert hooks.standin_int(CALLS) == calls + 1  # the warm-up all-reduce
    assert hooks.standin_int(COUNT) == 1
    assert isinstance(comm.group.sent[0], bytes) and len(comm.group.sent[0]) == 4108

    x = torch.tensor([1.5, -2.0, 3.0])
    out = comm.all_reduce(x, op=ReduceOp.MIN, stream=0x77)
    assert out is not None and torch.equal(out, 2 * x) and out.data_ptr() != x.data_ptr()
    assert hooks.standin_int(OP) == 3 and hooks.standin_ptr(STREAM) == 0x77
    assert hooks.standin_ptr(SEND) == x.data_ptr()

    b = torch.zeros(4, dtype=torch.int32)
    comm.broadcast(b, src=1)
    assert b.tolist() == [101, 102, 103, 104] and hooks.standin_int(ROOT) == 1
    assert hooks.standin_ptr(STREAM) is None  # CPU device: the NULL stream

    with pytest.raises(ValueError, match="created to work on cpu"):
        comm.all_reduce(torch.zeros(1, device="meta"))
    destroyed = hooks.standin_int(DESTROYED)
    comm.close()
    comm.close()
    assert hooks.standin_int(DESTROYED) == destroyed + 1
    with pytest.raises(RuntimeError, match="closed"):
        comm.all_reduce(x)


def test_communicator_rank1_uses_rank0_root_info(standin: tuple[str, Any]) -> None:
    path, hooks = standin
    root = bytes((7 * i) % 256 for i in range(4108))
    comm = PyHcclCommunicator(StatelessGroup(1, 3, root), torch.device("cpu"), library_path=path)
    assert comm.group.sent == [None]
    assert (hooks.standin_int(NRANKS), hooks.standin_int(RANK)) == (3, 1)
    assert _root_seen(hooks) == root[4092:]
    comm.close()


def test_communicator_disabled_without_library_or_peers(tmp_path: Path,
                                                        standin: tuple[str, Any]) -> None:
    missing = PyHcclCommunicator(StatelessGroup(0, 2), "cpu",
                                 library_path=str(tmp_path / "none.so"))
    assert missing.disabled and not missing.available
    assert missing.all_reduce(torch.ones(1)) is None
    assert missing.broadcast(torch.ones(1), 0) is None
    alone = PyHcclCommunicator(StatelessGroup(0, 1), "cpu", library_path=standin[0])
    assert alone.disabled and alone.all_reduce(torch.ones(1)) is None
    with pytest.raises(TypeError, match="device"):
        PyHcclCommunicator(StatelessGroup(0, 2), 1.5, library_path=standin[0])  # type: ignore[arg-type]


WORKER = textwrap.dedent("""
    import ctypes, json, os, sys
    import torch, torch.distributed as dist
    from vllm_ascend.distributed.device_communicators.pyhccl import PyHcclCommunicator
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method=sys.argv[2], rank=rank, world_size=2)
    comm = PyHcclCommunicator(dist.group.WORLD, "cpu", library_path=sys.argv[3])
    hooks = ctypes.CDLL(sys.argv[3])
    hooks.standin_int.restype = ctypes.c_int64
    seen = ctypes.create_string_buffer(16)
    hooks.standin_root_seen(seen)
    out = comm.all_reduce(torch.full((3,), float(rank + 1)))
    print(json.dumps({"rank": hooks.standin_int(1), "nranks": hooks.standin_int(0),
                      "root_tail": list(seen.raw), "out": out.tolist()}))
    sys.stdout.flush()
    comm.close()
    # both ranks are done before either tears gloo down; then leave without the C++
    # teardown, whose ordering between the two processes aborts ("terminate called
    # without an active exception") when the peer's store went away first
    dist.barrier()
    os._exit(0)
""")


@pytest.mark.timeout(180)
def test_communicator_on_a_gloo_group_shares_rank0_root_info(
        tmp_path: Path, standin: tuple[str, Any]) -> None:
    """Two real processes: rank 1's HCCL init sees the root info rank 0's library made."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), f"tcp://127.0.0.1:{port}",
                               standin[0]], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(2)]
    results = []
    for p in procs:
        out, errout = p.communicate(timeout=170)
        assert p.returncode == 0, errout
        results.append(json.loads(out.strip().splitlines()[-1]))
    expected_tail = [i % 251 for i in range(4092, 4108)]
    for r, res in enumerate(results):
        assert res["rank"] == r and res["nranks"] == 2
        assert res["root_tail"] == expected_tail  # rank 1 got rank 0's bytes over gloo
        assert res["out"] == [2.0 * (r + 1)] * 3
