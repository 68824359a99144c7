# SPDX-License-Identifier: Apache-2.0
"""Start and stop helper processes in tests, never leaving one behind.

The implementations are ascend-kv-core's (``core.net.free_port`` and
``core.tooling.procs``), imported when called: the sessions of ascend-dist-utils
and ascend-kernels run without ascend-kv-core, and there :func:`free_port` is
torch's own.
"""

from __future__ import annotations

import subprocess
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free at the time of the call."""
    try:
        from vllm_ascend.distributed.kv_transfer.core.net import free_port as core_free_port
    except ImportError:  # a session without ascend-kv-core (it has torch)
        from torch.distributed.elastic.utils.distributed import get_free_port

        return int(get_free_port())
    return core_free_port(host)


def wait_port(host: str, port: int, timeout: float = 30.0,
              proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until ``host:port`` accepts TCP connections (or the process died)."""
    from vllm_ascend.distributed.kv_transfer.core.tooling.procs import wait_port as impl

    impl(host, port, timeout, proc=proc)


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL the whole process group after ``timeout``."""
    from vllm_ascend.distributed.kv_transfer.core.tooling.procs import stop as impl

    impl(proc, timeout)


def spawn(cmd: list[str], *, log: Path | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own process group, output to ``log`` (or discarded)."""
    from vllm_ascend.distributed.kv_transfer.core.tooling.procs import spawn as impl

    return impl(cmd, log=log, env=env)
