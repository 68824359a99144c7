# SPDX-License-Identifier: Apache-2.0
"""Reads from a peer process on the same host, straight from its memory.

When P and D run on one host and their KV caches are in host memory (the CPU device
layer), D can copy P's blocks with one ``process_vm_readv`` system call (Linux cross
memory attach, the same-host path of UCX's ``cma`` transport) instead of sending them
through the transfer engine's TCP transport over loopback. The copy runs in D's calling
thread on D's CPU: no socket, no thread of P's, no CPU of P's.

What a peer advertises is its :func:`host_identity` and its pid. A peer is read this way
only when its identity equals this process's (the same boot of the same kernel, the same
pid namespace), and only when the kernel allows it: ``process_vm_readv`` needs the rights
of ``ptrace`` over the peer (the same user, and a Yama ``ptrace_scope`` of 0, or
``CAP_SYS_PTRACE``). Nothing is loosened to make it work: a refused read
(:class:`LocalReadError`) makes the transfer-engine wrapper read over the transfer engine
and stop trying the peer this way.

NPU and CUDA KV caches live in device memory, which this cannot reach: peers there
advertise nothing and are read over the transfer engine as before.

``VLLM_ASCEND_KV_LOCAL_READS=0`` turns the path off (a P then advertises nothing, and a D
reads every peer over the transfer engine).
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
from collections.abc import Sequence
from functools import lru_cache

#: ``0``/``off``/``false`` turns same-host reads off (default on).
LOCAL_READS_ENV = "VLLM_ASCEND_KV_LOCAL_READS"
#: iovec entries one system call takes (Linux ``UIO_MAXIOV``).
IOV_MAX = 1024


class LocalReadError(OSError):
    """The kernel refused or cut short a same-host read (``errno`` says why)."""


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def enabled() -> bool:
    """Whether same-host reads are on (:data:`LOCAL_READS_ENV`)."""
    value = os.environ.get(LOCAL_READS_ENV, "1").strip().lower()
    return value not in ("0", "off", "false", "no")


@lru_cache(maxsize=1)
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def host_identity() -> str:
    """This process's host for same-host reads: the kernel's boot id and the pid namespace
    (two processes with the same identity name each other's pids alike); ``""`` where
    either is not known (not Linux), or same-host reads are off."""
    if not enabled():
        return ""
    boot = _boot_id()
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{pid_ns}" if boot else ""


@lru_cache(maxsize=1)
def _readv() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn  # type: ignore[no-any-return]


def available() -> bool:
    """Whether this system has ``process_vm_readv`` (Linux 3.2 and later) and pid file
    descriptors (Linux 5.3 and later), which :class:`Peer` needs."""
    return _readv() is not None and hasattr(os, "pidfd_open")


class Peer:
    """A peer process read from its memory, held by a pid file descriptor.

    A pid names another process once its process exited and the number was reused; a read
    by pid alone could then copy another process's memory as the peer's blocks. The
    descriptor, opened while the peer is known to be alive (it just answered the
    handshake), names the peer alone: a read counts only if the peer is still alive after
    it, so the pid named the peer all along.

    Raises:
        LocalReadError: no such process, or no pid file descriptors here.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd = -1
        try:
            self._fd = os.pidfd_open(pid)
        except (OSError, AttributeError) as exc:
            err = getattr(exc, "errno", None) or errno.ENOSYS
            raise LocalReadError(err, f"pidfd_open({pid}): {exc}") from exc

    def alive(self) -> bool:
        """Whether the peer has not exited."""
        try:
            signal.pidfd_send_signal(self._fd, 0)
        except PermissionError:  # alive, only not ours to signal
            return True
        except OSError:  # exited (ESRCH), or the descriptor was closed
            return False
        return True

    def read(self, local: Sequence[int], remote: Sequence[int],
             lengths: Sequence[int]) -> int:
        """:func:`read_from` the peer, checked to be the peer afterwards.

        Raises:
            LocalReadError: as :func:`read_from`; ``ESRCH`` if the peer exited.
        """
        total = read_from(self.pid, local, remote, lengths)
        if not self.alive():
            raise LocalReadError(errno.ESRCH, f"pid {self.pid} exited during the read")
        return total

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass


def read_from(pid: int, local: Sequence[int], remote: Sequence[int],
              lengths: Sequence[int]) -> int:
    """Copy ``lengths[i]`` bytes at ``remote[i]`` in process ``pid`` to ``local[i]`` here.

    The call releases the GIL while the kernel copies. Ranges are sent :data:`IOV_MAX` at a
    time; a partial copy (which the kernel makes only at a range's boundary) goes on from
    where it stopped.

    Returns:
        The bytes copied (the sum of ``lengths``).

    Raises:
        LocalReadError: the kernel refused (``EPERM``: no ptrace rights over ``pid``;
            ``ESRCH``: no such process; ``EFAULT``: an address not mapped on either side), or
            copied nothing of what was left.
    """
    fn = _readv()
    if fn is None:
        raise LocalReadError(errno.ENOSYS, "process_vm_readv is not available here")
    if not (len(local) == len(remote) == len(lengths)):
        raise ValueError(f"range lists differ in length: {len(local)} local, {len(remote)} "
                         f"remote, {len(lengths)} lengths")
    todo = [(loc, rem, n) for loc, rem, n in zip(local, remote, lengths, strict=True) if n > 0]
    total = 0
    i = 0
    while i < len(todo):
        chunk = todo[i:i + IOV_MAX]
        n = len(chunk)
        liov = (_IOVec * n)(*(_IOVec(loc, size) for loc, _rem, size in chunk))
        riov = (_IOVec * n)(*(_IOVec(rem, size) for _loc, rem, size in chunk))
        want = sum(size for _l, _r, size in chunk)
        got = fn(pid, liov, n, riov, n, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise LocalReadError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        total += got
        if got == want:
            i += n
            continue
        if got == 0:
            raise LocalReadError(errno.EFAULT,
                                 f"process_vm_readv from pid {pid} copied nothing of "
                                 f"{want} bytes")
        # a partial copy: skip the ranges copied whole, go on with the rest of the one cut
        done = got
        for _loc, _rem, size in chunk:
            if done < size:
                break
            done -= size
            i += 1
        if done:
            loc, rem, size = todo[i]
            todo[i] = (loc + done, rem + done, size - done)
    return total
