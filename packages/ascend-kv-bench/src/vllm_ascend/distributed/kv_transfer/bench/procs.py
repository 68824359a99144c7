# SPDX-License-Identifier: Apache-2.0
"""Child processes of tools and tests, never left behind.

Each is started in its own process group and waited for on its port."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def wait_port(host: str, port: int, timeout: float = 30.0,
              proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until ``host:port`` accepts TCP connections.

    Raises:
        RuntimeError: ``proc`` exited first.
        TimeoutError: nothing listens after ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode} before "
                               f"listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")


def spawn(cmd: list[str], *, log: Path | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own process group, output to ``log`` (or discarded)."""
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - the child holds it
    try:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    finally:
        if log:
            out.close()  # type: ignore[union-attr]


class PausableGroup:
    """A child process leading its own session (:func:`spawn`), its whole process group
    stopped (SIGSTOP) while other processes are measured, so an idle one takes no CPU time
    from them, and continued (SIGCONT). A subclass sets ``self.proc``."""

    proc: subprocess.Popen[bytes]
    #: stopped (SIGSTOP): :meth:`pause`
    paused: bool = False

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:  # the group: its worker processes get the signal too
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def pause(self) -> None:
        """Stop the process group (SIGSTOP)."""
        if not self.paused:
            self._signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        """Continue a paused process group (SIGCONT)."""
        if self.paused:
            self._signal(signal.SIGCONT)
            self.paused = False


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL the whole process group after ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout)
