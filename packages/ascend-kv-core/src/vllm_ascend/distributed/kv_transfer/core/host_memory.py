# SPDX-License-Identifier: Apache-2.0
"""Host memory that processes starting side by side are about to make resident.

A worker that touches a large buffer at start-up (the pool's ``local_pool_prefault``)
checks it against the host's available memory first. The workers of one instance (its TP,
PP and local DP ranks) start side by side: each saw the memory available before any of
them had touched theirs, so all passed and together they could take more than the host
had. A claim closes that race: under a lock held by one process of the host at a time,
a process subtracts what the others claimed and have not made resident yet (so is not
yet missing from the available memory) from the memory available, records its own claim,
and lowers it as it touches its memory (:meth:`MemoryClaim.advance`), until it drops it.

The claims live in a small JSON file per user in the temporary directory
(:data:`LEDGER_ENV` names another path), locked with ``flock``; a claim of a process that
is gone is ignored. Where the file cannot be used (no ``fcntl``, a read-only directory)
the check falls back to the memory available alone, as before.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .device import available_host_memory

logger = logging.getLogger(__name__)

__all__ = ["LEDGER_ENV", "HostMemoryError", "MemoryClaim", "claim_host_memory"]

#: Path of the claims file (default: one per user in the temporary directory).
LEDGER_ENV = "VLLM_ASCEND_KV_MEMORY_LEDGER"
#: A claim's progress is written to the file at most once per this many bytes touched.
REPORT_BYTES = 256 << 20


class HostMemoryError(ValueError):
    """The host cannot hold what a process is about to make resident."""

    def __init__(self, message: str, *, need: int, available: int, claimed: int) -> None:
        super().__init__(message)
        self.need, self.available, self.claimed = need, available, claimed


def ledger_path() -> str:
    """Where the claims of this user's processes are kept."""
    return os.environ.get(LEDGER_ENV) or os.path.join(
        tempfile.gettempdir(), f"vllm-ascend-kv-host-memory-{os.getuid()}.json")


def _start_ticks(pid: int) -> str:
    """When process ``pid`` started (``/proc``'s clock ticks since boot; '' where unknown),
    so a claim is not taken for a later process that reuses the id."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else ""


def _alive(key: str) -> bool:
    pid_s, _, ticks = key.partition(":")
    try:
        pid = int(pid_s)
        os.kill(pid, 0)
    except PermissionError:
        return True  # another user's process of that id: it is alive
    except (ValueError, OSError):
        return False
    return not ticks or _start_ticks(pid) in ("", ticks)


@contextmanager
def _locked(path: str) -> Iterator[dict[str, int]]:
    """The claims in the file, under its lock; written back when the block ends."""
    import fcntl

    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            try:
                with open(path) as f:
                    loaded: Any = json.load(f)
            except (OSError, ValueError):
                loaded = {}
            claims = {str(k): int(v) for k, v in loaded.items()
                      if isinstance(v, int) and v > 0} if isinstance(loaded, dict) else {}
            yield claims
            live = {k: v for k, v in claims.items() if v > 0 and _alive(k)}
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(live, f)
            os.replace(tmp, path)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class MemoryClaim:
    """This process's claim on host memory it is about to make resident (see the module).

    Use it as a context manager, or call :meth:`release`. :meth:`advance` is thread-safe.
    """

    def __init__(self, nbytes: int, path: str | None) -> None:
        self.nbytes = nbytes
        self.path = path  # None: not recorded (no claims file)
        self.key = f"{os.getpid()}:{_start_ticks(os.getpid())}"
        self._left = nbytes
        self._unreported = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        """Bytes claimed and not made resident yet."""
        return self._left

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more of the claim are resident now (they count in the host's used
        memory from here on, not as a claim)."""
        with self._lock:
            self._left = max(0, self._left - nbytes)
            self._unreported += nbytes
            if self._unreported < REPORT_BYTES and self._left:
                return
            self._unreported = 0
            self._write(self._left)

    def release(self) -> None:
        """Drop the claim (the memory is resident, or will not be)."""
        with self._lock:
            self._left = 0
            self._write(0)

    def _write(self, left: int) -> None:
        if self.path is None:
            return
        try:
            with _locked(self.path) as claims:
                claims[self.key] = left
        except OSError as exc:  # the claim lapses with the process anyway
            logger.debug("host memory claims file %s: %s", self.path, exc)

    def __enter__(self) -> MemoryClaim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_host_memory(nbytes: int, *, what: str, path: str | None = None,
                      available: Callable[[], int | None] = available_host_memory
                      ) -> MemoryClaim:
    """Claim ``nbytes`` of host memory this process is about to make resident.

    Args:
        nbytes: the bytes about to be touched.
        what: what claims them, for the error message.
        path: the claims file (default :func:`ledger_path`).
        available: the host memory available now (``None``: unknown, nothing is refused).

    Raises:
        HostMemoryError: ``nbytes`` is more than the memory available less the claims
            of this user's other processes that they have not made resident yet.
    """
    path = path or ledger_path()
    try:
        with _locked(path) as claims:
            claim = MemoryClaim(nbytes, path)
            others = sum(v for k, v in claims.items() if k != claim.key and _alive(k))
            free = available()
            if free is not None and nbytes > free - others:
                raise HostMemoryError(
                    f"{what}: {nbytes >> 20} MiB is more than the {free >> 20} MiB of host "
                    f"memory available" + (f", less the {others >> 20} MiB other processes "
                                           "of this host are touching now" if others else ""),
                    need=nbytes, available=free, claimed=others)
            claims[claim.key] = nbytes
            return claim
    except (ImportError, OSError) as exc:  # no fcntl, or no writable claims file
        logger.debug("host memory claims file %s unusable (%s): checking the memory "
                     "available alone", path, exc)
    free = available()
    if free is not None and nbytes > free:
        raise HostMemoryError(f"{what}: {nbytes >> 20} MiB is more than the {free >> 20} MiB "
                              "of host memory available", need=nbytes, available=free,
                              claimed=0)
    return MemoryClaim(nbytes, None)
