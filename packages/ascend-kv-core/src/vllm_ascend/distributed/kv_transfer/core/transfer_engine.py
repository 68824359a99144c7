# SPDX-License-Identifier: Apache-2.0
"""The Mooncake transfer engine, one per process.

:func:`get_transfer_engine` creates the engine lazily and thread-safely the
first time a connector (or the pool's Mooncake backend) needs it, with the
protocol of the device (``ascend`` on NPU, ``rdma`` on CUDA, ``tcp`` on CPU)
unless overridden; protocol ``local`` (:mod:`.local_protocol`) starts no Mooncake engine
and opens no port, reading same-host peers only. Memory is registered once even when asked twice (the
P/D connector and the pool backend may both register the KV cache). Batches
are coalesced (adjacent ranges merged) and chunked (the engine rejects
batches of thousands of descriptors), and a negative return code becomes a
:class:`~vllm_ascend.distributed.kv_transfer.core.errors.TransferError` that
says what failed and with whom.
"""

from __future__ import annotations

import bisect
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import local_protocol, local_reads, own_sockets, transfer_polling
from .errors import TransferError
from .transfer_polling import PendingTransfer
from .vllm_compat import optional_dependency

logger = logging.getLogger(__name__)

#: Descriptors per engine call; larger batches overflow the TCP lane queue.
DEFAULT_MAX_BATCH = 512
PROTOCOL_ENV = "VLLM_ASCEND_KV_PROTOCOL"
#: Mooncake's TCP transport fails a transfer that made no progress for this long. Its own
#: default (30 s) lets a read or write stalled by the network land long after a lease or
#: deadline ended; ours bounds that window below the connectors' lease margins.
TCP_PROGRESS_TIMEOUT_ENV = "MC_TCP_PROGRESS_TIMEOUT_SEC"
DEFAULT_TCP_PROGRESS_TIMEOUT_S = 5
#: How a transfer is waited for (docs/configuration.md has the measurements): ``yield``
#: (default over TCP) submits each range as an engine batch of its own (Mooncake's
#: non-blocking ``transfer_check_status`` looks at a batch's first task only) and polls them
#: in order with ``sched_yield`` between polls; ``spin`` (default over RDMA and Ascend's
#: transports, :func:`default_wait`) is Mooncake's synchronous call, whose loop never
#: yields: over TCP a transport thread that lands on the spinner's CPU waits for its time
#: slice (a one-block load took 1-1.7 ms at the median after a read on another thread,
#: 0.5 ms with ``yield``); ``sleep`` submits a batch of :data:`SLEEP_MIN_BYTES` or more,
#: sleeps through part of its expected time, then lets Mooncake spin for the rest (beside a
#: busy Python thread 20-40% faster than ``spin``, on an idle machine 8-20% slower).
#: ``yield`` takes a CPU as the spin does when nothing else wants it, and the GIL at each
#: poll (released while yielding); an engine without the asynchronous calls is waited for
#: by Mooncake.
WAIT_ENV = "VLLM_ASCEND_KV_TE_WAIT"
WAIT_MODES = ("yield", "spin", "sleep")
#: Batches of at least this many bytes are submitted, slept on for part of the time they
#: are expected to take, then waited for by Mooncake (which spins only for the rest).
#: Smaller ones are one synchronous call: they take less than a sleep's wake-up.
SLEEP_MIN_BYTES = 4 << 20
#: The part of a batch's expected time that is slept. The time expected is from the
#: fastest of the last :data:`RATE_WINDOW` large transfers in that direction with that peer
#: (a slow one, such as the first with its connection set up, must not make later ones
#: sleep past their end; one faster than all of them ends at worst this far into the sleep).
SLEEP_FRACTION = 0.5
RATE_WINDOW = 8
#: Bytes per second assumed in that direction with that peer until :data:`RATE_WINDOW`
#: transfers were timed: high, so the first ones (the first sets up its connection) mostly
#: wait in Mooncake's loop.
INITIAL_RATE = 16e9


@dataclass
class TransferStats:
    """Counters of one engine (monotonic)."""

    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    failures: int = 0
    seconds: float = 0.0
    #: reads (and their bytes) copied from a same-host peer's memory (:mod:`.local_reads`),
    #: counted in ``reads`` and ``bytes_read`` too
    local_reads: int = 0
    bytes_read_local: int = 0


#: From this many ranges :func:`coalesce` merges with numpy; below, the Python loop is
#: faster (2026-12-06, 2 CPUs, ranges in random order, best of 5: 32 ranges 12 us in Python
#: against 21 us with numpy, 128 46 against 34, 1,024 450 against 182; already sorted, the
#: loop's sort costs little and numpy only draws level at 128)
VECTOR_MIN_RANGES = 128


def coalesce(local: Sequence[int], remote: Sequence[int],
             lengths: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """Merge ranges adjacent on both sides (sorted by local address).

    ``(0, 100, 16), (16, 116, 16)`` becomes ``(0, 100, 32)``.
    """
    if not (len(local) == len(remote) == len(lengths)):
        raise ValueError(f"range lists differ in length: {len(local)} local, {len(remote)} "
                         f"remote, {len(lengths)} lengths")
    if len(local) >= VECTOR_MIN_RANGES:
        return coalesce_arrays(np.asarray(local, dtype=np.int64),
                               np.asarray(remote, dtype=np.int64),
                               np.asarray(lengths, dtype=np.int64))
    order = sorted(range(len(local)), key=lambda i: (local[i], remote[i]))
    out_l: list[int] = []
    out_r: list[int] = []
    out_n: list[int] = []
    for i in order:
        length = lengths[i]
        if length <= 0:
            if length < 0:
                raise ValueError(f"negative transfer length {length}")
            continue
        if out_l and out_l[-1] + out_n[-1] == local[i] and out_r[-1] + out_n[-1] == remote[i]:
            out_n[-1] += length
        else:
            out_l.append(local[i])
            out_r.append(remote[i])
            out_n.append(length)
    return out_l, out_r, out_n


def coalesce_arrays(local: np.ndarray, remote: np.ndarray,
                    lengths: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    """:func:`coalesce` of int64 arrays, vectorized (the same ranges, as lists)."""
    if lengths.size and int(lengths.min()) < 0:
        raise ValueError(f"negative transfer length {int(lengths.min())}")
    if lengths.size and not lengths.all():
        keep = lengths > 0
        local, remote, lengths = local[keep], remote[keep], lengths[keep]
    order = np.lexsort((remote, local))
    local, remote, lengths = local[order], remote[order], lengths[order]
    if local.size > 1:
        # a range starts a run unless it begins where the one before ends on both sides
        starts = np.flatnonzero(np.concatenate((
            [True], (local[1:] != local[:-1] + lengths[:-1])
            | (remote[1:] != remote[:-1] + lengths[:-1]))))
        if starts.size < local.size:
            lengths = np.add.reduceat(lengths, starts)
            local, remote = local[starts], remote[starts]
    return local.tolist(), remote.tolist(), lengths.tolist()


class MooncakeTransferEngine:
    """A thin, checked wrapper of ``mooncake.engine.TransferEngine``.

    Args:
        hostname: address advertised to peers (also the TCP bind address).
        protocol: ``tcp``, ``rdma``, ``ascend``, or ``local``: no Mooncake engine and no
            port, peers read only from their memory on this host (:mod:`.local_protocol`).
        device_name: RDMA device name(s), empty for auto.
        metadata_server: ``P2PHANDSHAKE`` (default) or an HTTP metadata URL.
        max_batch: descriptors per engine call.
    """

    def __init__(self, hostname: str, protocol: str, *, device_name: str = "",
                 metadata_server: str = "P2PHANDSHAKE", max_batch: int = DEFAULT_MAX_BATCH) -> None:
        local = protocol == local_protocol.LOCAL_PROTOCOL
        if local:
            local_protocol.refuse_unavailable()
        else:
            module = optional_dependency(
                "mooncake.engine", extra="cpu", package="ascend-kv-core",
                feature="the Mooncake transfer engine (use the [cuda] or [npu] extra on those "
                        "platforms)")
        if _is_ip(hostname) and not local:
            # Mooncake binds its TCP transport here and advertises it; without it the
            # engine may advertise (and listen on) another interface.
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname)
        os.environ.setdefault(TCP_PROGRESS_TIMEOUT_ENV, str(DEFAULT_TCP_PROGRESS_TIMEOUT_S))
        try:
            self._stall_bound_s = float(int(os.environ[TCP_PROGRESS_TIMEOUT_ENV]))
        except ValueError:
            self._stall_bound_s = 30.0  # Mooncake ignores a non-integer value: its default
        self.hostname = hostname
        self.protocol = protocol
        self.device_name = device_name
        self.max_batch = max_batch
        wait = os.environ.get(WAIT_ENV, "").strip().lower() or default_wait(protocol)
        if wait not in WAIT_MODES:
            raise ValueError(f"{WAIT_ENV}={wait!r}: expected one of {', '.join(WAIT_MODES)}")
        #: how transfers are waited for (see :data:`WAIT_ENV`)
        self.wait = wait
        # (op, peer) -> bytes per second of its last large transfers (replaced, not changed:
        # pull threads read and time transfers at once)
        self._rates: dict[tuple[str, str], tuple[float, ...]] = {}
        #: the TCP ports the engine opened here (its RPC port, the TCP transport's data port):
        #: the connections peers' transfers arrive on (:mod:`.own_sockets`; empty off Linux,
        #: and under protocol ``local``, which starts no Mooncake engine: ``_engine`` None)
        self.listen_ports: set[int] = set()
        self._engine: Any = None
        self.rpc_port = 0
        self._session = local_protocol.session_name(hostname)
        if not local:
            self._engine = module.TransferEngine()
            listening = own_sockets.listening_ports()
            rc = self._engine.initialize(hostname, metadata_server, protocol, device_name)
            self.listen_ports = own_sockets.listening_ports() - listening
            if rc != 0:
                raise TransferError(
                    f"Mooncake transfer engine failed to start on {hostname} with protocol "
                    f"{protocol!r} (metadata {metadata_server!r}): rc={rc}", op="initialize",
                    rc=rc)
            self.rpc_port = int(self._engine.get_rpc_port())
            self._session = f"{hostname}:{self.rpc_port}"
        self._lock = threading.Lock()
        # sorted (start, end) of memory registered with the engine
        self._segments: list[tuple[int, int]] = []
        # (start, end) asked for -> [references, engine segments it owns]
        self._regs: dict[tuple[int, int], list[Any]] = {}
        # peer session -> the peer process, for peers read from their memory
        # (:mod:`.local_reads`)
        self._local_peers: dict[str, local_reads.Peer] = {}
        self.stats = TransferStats()
        logger.info("%s: %s protocol=%s", "no Mooncake engine, no port (same-host reads only)"
                    if local else "Mooncake transfer engine up", self.session_id, protocol)

    # ------------------------------------------------------------ identity
    @property
    def session_id(self) -> str:
        """``host:rpc_port``, the name peers use to reach this engine (under protocol
        ``local``: ``host:local-<pid>-<random>``, :func:`.local_protocol.session_name`)."""
        return self._session

    @property
    def stall_bound_s(self) -> float:
        """Longest a transfer can stay in flight without progress before the engine fails it
        (TCP transport); a peer must keep memory valid at least this long past a transfer's
        start."""
        return self._stall_bound_s

    @property
    def raw(self) -> Any:
        """The underlying ``mooncake.engine.TransferEngine``.

        Raises:
            TransferError: protocol ``local`` runs none.
        """
        if self._engine is None:
            raise local_protocol.no_engine("using the Mooncake engine itself")
        return self._engine

    # ------------------------------------------------------------ same-host peers
    def add_local_peer(self, peer: str, host: str, pid: int) -> bool:
        """Read ``peer`` (``host:rpc_port``) from its memory from now on, if it runs on this
        host: ``host`` and ``pid`` are what the peer advertised (its
        :func:`~.local_reads.host_identity` and process id).

        Only for memory both sides hold in host memory (a caller's promise: the peer
        advertises a host only for a host-memory KV cache, and the caller asks only for its
        own). A read the kernel refuses goes over the transfer engine, and the peer is then
        read that way for good.

        Returns:
            Whether the peer will be read from its memory (if not, an earlier
            :meth:`add_local_peer` of ``peer`` no longer holds).
        """
        why = ("it offers none" if not host or pid <= 0
               else "same-host reads are off here" if not local_reads.enabled()
               else "it runs in this process" if pid == os.getpid()
               else "it runs on another host" if host != local_reads.host_identity()
               else "this system has no process_vm_readv or pidfd_open"
               if not local_reads.available() else "")
        if why:
            self.forget_local_peer(peer)  # what the peer (or this process) says now wins
            logger.log(logging.INFO if self._engine is not None else logging.WARNING,
                       "peer %s is read over the transfer engine: %s" if self._engine
                       is not None else "peer %s cannot be read under protocol local: %s",
                       peer, why)
            return False
        known = self._local_peers.get(peer)
        if known is not None and known.pid == pid and known.alive():
            return True
        try:
            process = local_reads.Peer(pid)
        except local_reads.LocalReadError as exc:
            self.forget_local_peer(peer)
            logger.info("peer %s (pid %d) is not read from its memory: %s", peer, pid, exc)
            return False
        with self._lock:  # replaced, not changed: reads look it up unlocked
            self._local_peers = {**self._local_peers, peer: process}
        # the one replaced (if any) may still serve a read: it closes with its last reference
        logger.info("peer %s (pid %d) runs on this host: reads copy from its memory",
                    peer, pid)
        return True

    def forget_local_peer(self, peer: str) -> None:
        """Read ``peer`` over the transfer engine from now on."""
        # a read may still use it: its descriptor closes with the last reference
        with self._lock:
            if peer in self._local_peers:
                self._local_peers = {k: v for k, v in self._local_peers.items() if k != peer}

    def is_local_peer(self, peer: str) -> bool:
        """Whether reads of ``peer`` copy from its memory (:meth:`add_local_peer`)."""
        return peer in self._local_peers

    # ------------------------------------------------------------ memory
    def register_memory(self, addr: int, length: int) -> bool:
        """Register ``[addr, addr + length)`` for transfers.

        Registrations are reference counted per range: registering the same range
        twice (the P/D connector and the pool backend both registering the KV
        cache) keeps one engine registration, released by the last
        :meth:`unregister_memory`. A range overlapping already registered memory
        registers only the uncovered parts (the engine refuses overlaps).

        Returns:
            True when new memory was registered with the engine.

        Raises:
            TransferError: the engine refused the registration.
        """
        if length <= 0:
            raise ValueError(f"cannot register {length} bytes at {addr:#x}")
        key = (addr, addr + length)
        with self._lock:
            reg = self._regs.get(key)
            if reg is not None:
                reg[0] += 1
                return False
            gaps = self._gaps(*key)
            done: list[tuple[int, int]] = []
            for start, end in gaps:  # protocol local: only recorded (no engine)
                rc = (self._engine.register_memory(start, end - start)
                      if self._engine is not None else 0)
                if rc != 0:
                    for s, _e in done:
                        self._engine.unregister_memory(s)
                    whole = "" if (start, end) == key else \
                        f" (part of {length} bytes at {addr:#x})"
                    raise TransferError(
                        f"registering {end - start} bytes at {start:#x}{whole} with the "
                        f"Mooncake engine {self.session_id} ({self.protocol}) failed: rc={rc}",
                        op="register", rc=rc)
                done.append((start, end))
            for seg in done:
                bisect.insort(self._segments, seg)
            self._regs[key] = [1, done]
            return bool(done)

    def unregister_memory(self, addr: int, length: int | None = None) -> bool:
        """Drop one registration of the range starting at ``addr``.

        Returns:
            False if no such registration exists; True otherwise (the engine
            registration is released with the last reference, unless another
            live range still needs that memory).
        """
        with self._lock:
            key = next((k for k in self._regs if k[0] == addr
                        and (length is None or k[1] - k[0] == length)), None)
            if key is None:
                return False
            reg = self._regs[key]
            reg[0] -= 1
            if reg[0] > 0:
                return True
            del self._regs[key]
            for seg in reg[1]:
                heir = next((k for k in self._regs if k[0] < seg[1] and seg[0] < k[1]), None)
                if heir is not None:
                    self._regs[heir][1].append(seg)  # still needed by another range
                    continue
                rc = (self._engine.unregister_memory(seg[0])
                      if self._engine is not None else 0)
                self._segments.remove(seg)
                if rc != 0:
                    raise TransferError(f"unregistering {seg[0]:#x} failed: rc={rc}",
                                        op="unregister", rc=rc)
            return True

    @property
    def registered_bytes(self) -> int:
        """Bytes currently registered with the engine (for leak checks)."""
        with self._lock:
            return sum(end - start for start, end in self._segments)

    @property
    def registrations(self) -> int:
        """Live registrations (ranges times references)."""
        with self._lock:
            return sum(reg[0] for reg in self._regs.values())

    def _gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """Parts of ``[start, end)`` not covered by registered segments."""
        gaps = []
        cur = start
        i = bisect.bisect_right(self._segments, (start, float("inf"))) - 1
        i = max(i, 0)
        for s, e in self._segments[i:]:
            if s >= end:
                break
            if e <= cur:
                continue
            if s > cur:
                gaps.append((cur, s))
            cur = max(cur, e)
        if cur < end:
            gaps.append((cur, end))
        return gaps

    # ------------------------------------------------------------ transfers
    def read(self, peer: str, local: Sequence[int], remote: Sequence[int],
             lengths: Sequence[int], *, wait: str | None = None, merged: bool = False) -> int:
        """Read remote ranges of ``peer`` (``host:rpc_port``) into local memory; returns
        bytes. ``wait``: how to wait for it (:data:`WAIT_ENV`; ``None``: :attr:`wait`);
        ``merged``: as for :meth:`submit_read`."""
        return self._batch("read", peer, local, remote, lengths, wait or self.wait, merged)

    def write(self, peer: str, local: Sequence[int], remote: Sequence[int],
              lengths: Sequence[int], *, wait: str | None = None) -> int:
        """Write local ranges into ``peer``'s memory; returns bytes. ``wait`` as for
        :meth:`read`."""
        return self._batch("write", peer, local, remote, lengths, wait or self.wait)

    def _batch(self, op: str, peer: str, local: Sequence[int], remote: Sequence[int],
               lengths: Sequence[int], wait: str, merged: bool = False) -> int:
        if wait not in WAIT_MODES:
            raise ValueError(f"wait={wait!r}: expected one of {', '.join(WAIT_MODES)}")
        loc, rem, lens = ((list(local), list(remote), list(lengths)) if merged
                          else coalesce(local, remote, lengths))
        if not loc:
            return 0
        start = time.perf_counter()
        process = self._local_peers.get(peer) if op == "read" else None
        if process is not None:
            try:
                total = process.read(loc, rem, lens)
            except local_reads.LocalReadError as exc:
                self.forget_local_peer(peer)
                if self._engine is None:
                    self.stats.failures += 1
                    raise local_protocol.not_readable(op, peer, self.protocol,
                                                      str(exc)) from exc
                logger.warning("reading %s (pid %d) from its memory failed (%s): it is read "
                               "over the transfer engine from now on", peer, process.pid, exc)
            else:
                self.stats.reads += 1
                self.stats.bytes_read += total
                self.stats.local_reads += 1
                self.stats.bytes_read_local += total
                self.stats.seconds += time.perf_counter() - start
                return total
        if self._engine is None or local_protocol.is_local_session(peer):
            self.stats.failures += 1  # no Mooncake engine here, or none to dial there
            raise local_protocol.not_readable(op, peer, self.protocol)
        total = 0
        for i in range(0, len(loc), self.max_batch):
            chunk = slice(i, i + self.max_batch)
            rc = self._call(op, peer, loc[chunk], rem[chunk], lens[chunk], wait)
            if rc < 0:
                self.stats.failures += 1
                nbytes = sum(lens[chunk])
                raise TransferError(
                    f"{op} of {len(loc[chunk])} ranges ({nbytes} bytes) "
                    f"{'from' if op == 'read' else 'to'} {peer} failed: rc={rc} (peer dead, "
                    "unreachable, or the remote memory is not registered)",
                    op=op, peer=peer, rc=rc)
            total += sum(lens[chunk])
        elapsed = time.perf_counter() - start
        if op == "read":
            self.stats.reads += 1
            self.stats.bytes_read += total
        else:
            self.stats.writes += 1
            self.stats.bytes_written += total
        self.stats.seconds += elapsed
        return total

    def submit_read(self, peer: str, local: Sequence[int], remote: Sequence[int],
                    lengths: Sequence[int], *, merged: bool = False) -> PendingTransfer | None:
        """Start a read of ``peer``'s ranges without waiting for it; poll the returned
        :class:`PendingTransfer` for its end. ``None`` when this read cannot be started
        that way (a same-host peer, read from its memory: see :meth:`read`; an engine
        without asynchronous calls): read it with :meth:`read` instead.

        Each range goes out as a batch of its own (:mod:`.transfer_polling` says why one
        batch of them all cannot be polled). Measured on 2 CPUs over loopback TCP
        (2026-12-05, 300 reads each): 8 ranges of 64 KiB took 229 us submitted one by one and
        polled, 227 us in one synchronous batch; 8 of 1 MiB, 4.45 and 4.39 ms.

        ``merged``: the ranges are :func:`coalesce`'s already (sorted by local address, none
        adjacent to the next on both sides), as a caller that merged them to count them has
        them: they are not merged again.
        """
        if (self._engine is None or local_protocol.is_local_session(peer)
                or not transfer_polling.can_poll(self._engine, "read")
                or peer in self._local_peers):
            return None
        loc, rem, lens = ((local, remote, lengths) if merged
                          else coalesce(local, remote, lengths))
        pending = PendingTransfer(self, peer, sum(lens))
        pending.batches, rc = transfer_polling.submit_each(self._engine, "read", peer, loc, rem,
                                                           lens)
        if rc:  # not submitted: nothing of that range in flight
            pending.error = (f"read of {len(loc)} ranges ({pending.nbytes} bytes) from "
                             f"{peer} failed: the engine refused a range (rc={rc}; peer dead, "
                             "unreachable, or the remote memory is not registered)")
        return pending

    def _call(self, op: str, peer: str, loc: list[int], rem: list[int],
              lens: list[int], wait: str) -> int:
        """One engine batch, waited for as ``wait`` says; Mooncake's return code."""
        if wait == "yield" and transfer_polling.can_poll(self._engine, op):
            return transfer_polling.wait_yielding(self._engine, op, peer, loc, rem, lens)
        nbytes = sum(lens) if wait == "sleep" else 0
        submit = (getattr(self._engine, f"batch_transfer_async_{op}", None)
                  if nbytes >= SLEEP_MIN_BYTES else None)
        if submit is None:  # spin, a small batch, or an engine without async calls
            return int(getattr(self._engine, f"batch_transfer_sync_{op}")(peer, loc, rem, lens))
        start = time.perf_counter()
        batch = int(submit(peer, loc, rem, lens))
        if batch <= 0 or batch >= 1 << 63:
            return -1  # not submitted (unknown peer, engine refused): nothing in flight
        key = (op, peer)
        rates = self._rates.get(key, (INITIAL_RATE,))
        time.sleep(nbytes / max(rates) * SLEEP_FRACTION)
        # Mooncake spins for the rest, frees the batch, and fails it after its timeout
        # (as its synchronous call does)
        rc = int(self._engine.get_batch_transfer_status([batch]))
        if rc >= 0:
            rate = nbytes / max(time.perf_counter() - start, 1e-6)
            self._rates[key] = (*rates[1 - RATE_WINDOW:], rate)
        return rc


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


_lock = threading.Lock()
_engine: MooncakeTransferEngine | None = None


def default_protocol() -> str:
    """``VLLM_ASCEND_KV_PROTOCOL`` if set, else the device's protocol."""
    forced = os.environ.get(PROTOCOL_ENV, "").strip().lower()
    if forced:
        return forced
    from .device import get_device

    return get_device().default_protocol


def default_wait(protocol: str) -> str:
    """How transfers over ``protocol`` are waited for without :data:`WAIT_ENV`."""
    return "yield" if protocol == "tcp" else "spin"


def get_transfer_engine(hostname: str | None = None, protocol: str | None = None, *,
                        device_name: str = "",
                        metadata_server: str = "P2PHANDSHAKE") -> MooncakeTransferEngine:
    """The process's transfer engine, created on first use.

    Later calls return the same engine; asking for a different protocol or
    host than the running engine uses is logged and ignored (one engine a
    process: registered memory and connections are shared).
    """
    global _engine
    with _lock:
        if _engine is None:
            from .net import get_host_ip

            _engine = MooncakeTransferEngine(hostname or get_host_ip(),
                                             protocol or default_protocol(),
                                             device_name=device_name,
                                             metadata_server=metadata_server)
        else:
            if protocol and protocol != _engine.protocol:
                logger.warning("transfer engine already runs protocol %r; request for %r ignored",
                               _engine.protocol, protocol)
            if hostname and hostname != _engine.hostname:
                logger.warning("transfer engine already runs on %s; request for %s ignored",
                               _engine.hostname, hostname)
        return _engine


def peek_transfer_engine() -> MooncakeTransferEngine | None:
    """The engine if one was created, without creating it."""
    return _engine
