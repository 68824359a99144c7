# SPDX-License-Identifier: Apache-2.0
"""Start and stop helper processes in tests, never leaving one behind.

The implementations are ascend-kv-core's ``core.net.free_port`` and ascend-kv-bench's
``bench.procs`` (the one implementation the benchmarks use too), imported when called:
the sessions of ascend-dist-utils and ascend-kernels run without ascend-kv-core, and there
:func:`free_port` is torch's own; only the engine and Store launchers need ascend-kv-bench.
"""

from __future__ import annotations

import atexit
import subprocess
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


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
    from vllm_ascend.distributed.kv_transfer.bench.procs import wait_port as impl

    impl(host, port, timeout, proc=proc)


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL the whole process group after ``timeout``."""
    from vllm_ascend.distributed.kv_transfer.bench.procs import stop as impl

    impl(proc, timeout)


def group_states(pgid: int) -> list[str]:
    """The state letter of each live process of process group ``pgid`` (``T``: stopped,
    ``Z``: a zombie), read from Linux's ``/proc``."""
    out = []
    for path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = path.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out.append(fields[0])
    return out


def spawn(cmd: list[str], *, log: Path | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own process group, output to ``log`` (or discarded)."""
    from vllm_ascend.distributed.kv_transfer.bench.procs import spawn as impl

    return impl(cmd, log=log, env=env)


class Background:
    """A command started at once in the background, its result read when a test needs it.

    A test module starts a slow, self-contained check (a fresh interpreter importing vLLM)
    when it is collected, so the check runs on a free core while the tests before it do; the
    test then asserts on :meth:`result` exactly as on ``subprocess.run``. A process still
    running when the interpreter exits (its test deselected or never reached) is killed.
    """

    def __init__(self, cmd: list[str], *, timeout: float = 300.0,
                 cwd: str | Path | None = None) -> None:
        self.cmd, self.timeout = cmd, timeout
        # files, not pipes: nobody reads while it runs, and a full pipe would block it
        self._out = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by result())
        self._err = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self._proc = subprocess.Popen(cmd, stdout=self._out, stderr=self._err, text=True,
                                      cwd=cwd)
        self._result: subprocess.CompletedProcess[str] | None = None
        atexit.register(self._kill)

    def result(self) -> subprocess.CompletedProcess[str]:
        """Wait for the command (``timeout`` seconds from now at most) and return what
        ``subprocess.run(cmd, capture_output=True, text=True)`` would have."""
        if self._result is None:
            try:
                rc = self._proc.wait(self.timeout)
            except subprocess.TimeoutExpired:
                self._kill()
                raise
            self._out.seek(0)
            self._err.seek(0)
            self._result = subprocess.CompletedProcess(self.cmd, rc, self._out.read(),
                                                       self._err.read())
            self._out.close()
            self._err.close()
        return self._result

    def _kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()


def start_in_background(cmd: list[str], *, timeout: float = 300.0,
                        cwd: str | Path | None = None) -> Background:
    """Start ``cmd`` now (see :class:`Background`); ``.result()`` waits for it."""
    return Background(cmd, timeout=timeout, cwd=cwd)


def call_in_background(fn: Callable[..., T], *args: Any) -> Future[T]:
    """``fn(*args)`` in a daemon thread started now (a slow check whose work happens in a
    child process, such as an engine start); the future holds its result or exception."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever reads the result
            future.set_exception(exc)

    threading.Thread(target=run, name=f"background-{getattr(fn, '__name__', 'call')}",
                     daemon=True).start()
    return future
