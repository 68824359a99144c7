# SPDX-License-Identifier: Apache-2.0
"""Fixtures of the ascend-kv-core tests (shared ones come from the ascend-kv-testing plugin)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest

from ascend_kv_testing.requires import require_installed

# Mooncake advertises and binds the loopback address only.
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
os.environ.setdefault("VLLM_ASCEND_KV_HOST", "127.0.0.1")

# This session installs them (noxfile.py): one missing is a broken install, which must fail
# the session, not turn the tests that need it into skips.
require_installed("vllm", "transformers", "mooncake.engine", "mooncake.store")


_CHILD = """
import ctypes, os, sys
buf = ctypes.create_string_buffer(bytes((i * 7 + 3) % 256 for i in range(1 << 20)), 1 << 20)
print(ctypes.addressof(buf), os.getpid(), flush=True)
sys.stdin.read()
"""


def _child_bytes(start: int, n: int) -> bytes:
    return bytes((i * 7 + 3) % 256 for i in range(start, start + n))


@pytest.fixture(scope="session")
def child_bytes() -> Callable[[int, int], bytes]:
    """What the :func:`child` process holds: ``child_bytes(start, n)``, ``n`` bytes from its
    buffer's offset ``start``."""
    return _child_bytes


@pytest.fixture(scope="module")
def child() -> Iterator[tuple[int, int]]:
    """A process on this host holding 1 MiB of known bytes (:func:`child_bytes`), to read
    from its memory (same-host reads): (address, pid)."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    addr, pid = map(int, proc.stdout.readline().split())
    try:
        yield addr, pid
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)
