# SPDX-License-Identifier: Apache-2.0
"""Processes that stand in for a remote peer (spawned with ``multiprocessing``).

Test modules load with ``--import-mode=importlib`` and cannot be imported by a
spawned child, so child entry points live here.
"""

from __future__ import annotations

import hashlib
import queue
from typing import Any


def transfer_engine_target(q_out: Any, q_in: Any, size: int) -> None:
    """A process with two registered buffers of ``size`` bytes.

    Puts ``(session_id, src_addr, dst_addr, sha256(src))`` on ``q_out``; after
    ``"written"`` arrives on ``q_in`` it puts ``sha256(dst)``; exits on ``"bye"``.
    """
    import torch

    from vllm_ascend.distributed.kv_transfer.core.transfer_engine import get_transfer_engine

    te = get_transfer_engine("127.0.0.1", "tcp")
    src = torch.arange(size // 8, dtype=torch.int64)
    dst = torch.zeros(size, dtype=torch.uint8)
    te.register_memory(src.data_ptr(), size)
    te.register_memory(dst.data_ptr(), size)
    q_out.put((te.session_id, src.data_ptr(), dst.data_ptr(),
               hashlib.sha256(src.numpy().tobytes()).hexdigest()))
    while True:
        try:
            cmd = q_in.get(timeout=300)
        except queue.Empty:
            return
        if cmd == "written":
            q_out.put(hashlib.sha256(dst.numpy().tobytes()).hexdigest())
        elif cmd == "bye":
            return


def get_or_die(q: Any, proc: Any, timeout: float) -> Any:
    """``q.get`` that fails fast when ``proc`` died instead of waiting ``timeout``."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"peer process exited with {proc.exitcode}") from None
    raise TimeoutError(f"no message from the peer within {timeout}s")
