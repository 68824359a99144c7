# SPDX-License-Identifier: Apache-2.0
"""A subscriber to one vLLM instance's KV cache events (``--kv-events-config``, ZeroMQ).

vLLM's ``ZmqEventPublisher`` sends ``(topic, seq, payload)`` on a PUB socket: ``seq`` an
8-byte big-endian counter from 0 per publisher, ``payload`` a msgpack ``KVEventBatch``
(``[ts, [events...], dp_rank]``, each event a tagged map: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``). Its optional ROUTER replay socket resends every
buffered batch from a sequence number on, then an end marker (seq ``-1``).

Decoded with msgspec only (never pickle), into mirrors of vLLM's event classes: the fields
the index reads (fields vLLM adds are skipped). Importing vLLM for its own classes made
the proxy's start take 10-20 s instead of about 2 on a loaded host. A frame that does not
decode is counted and treated as a lost batch; an event of an unknown type is counted and
skipped.

Sequence handling, so that no stale knowledge steers a request:

- the first batch, or a gap (``seq > last + 1``): the missed batches are asked for on the
  replay socket; without one, or when it does not answer in time, the index is cleared and
  rebuilt from the live events (it can then only under-predict);
- a replay that starts later than asked (vLLM keeps only its last ``buffer_steps`` batches,
  10,000 by default: a subscriber that starts, or comes back, after an instance has sent
  more has lost the batches before): the index is cleared and rebuilt from the batches the
  buffer holds, and the stream is live (it misses at most blocks stored before the buffer,
  never holds one removed); counted ``gaps_partial``;
- ``seq <= last`` that is not a replayed duplicate: the publisher restarted (its cache is
  empty): the index is cleared and the new publisher's history replayed;
- ``AllBlocksCleared``: the index is cleared;
- an error in the subscriber itself (a dropped socket): the stream is ``dropped`` while it
  reconnects, and the next batch's sequence number decides as above.

A stream is ``connecting`` until it has heard from the publisher (a batch, or an answer of
the replay socket, asked again every few seconds): a wrong endpoint shows there in
``/status``.

While the stream is not ``live`` the policy does not use the index (load-based routing).

KV pool events: an ``AscendStoreConnector`` instance publishes, on the same stream, the
blocks it stored in the pool and (where its backend reports them) the pool's evictions,
as ``BlockStored`` / ``BlockRemoved`` with ``medium="cpu"`` and vLLM's own block hashes.
Without a shared pool index they are held by the instance's own index like any medium.
With one (``pool``: the instances share their pool), they feed that index instead, and
every loss of knowledge above (gap, restart, garbled batch, reconnect without replay) also
makes the pool index forget what this stream announced (:meth:`.PoolIndex.forget`): its
removals may have been lost. ``AllBlocksCleared`` (vLLM's reset of its device cache)
leaves the pool alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from .prefix_index import POOL_MEDIUM, PoolIndex, PrefixCacheHasher, PrefixIndex, block_key

logger = logging.getLogger(__name__)

END_SEQ = -1
#: How often a stream that has not heard from its publisher asks the replay socket again.
SYNC_RETRY_S = 3.0
#: The longest one replay may take, however steadily its batches come (the wait for each
#: next batch is the stream's ``replay_timeout_s``).
REPLAY_LIMIT_S = 60.0
#: Stream states; only ``live`` lets the policy use the index.
STATES = ("connecting", "replaying", "live", "dropped", "stopped")


@dataclass(frozen=True)
class EventsEndpoint:
    """Where an instance publishes its KV events (``endpoint`` of ``--kv-events-config``,
    host made reachable) and its replay socket (``replay_endpoint``), if any."""

    endpoint: str
    replay: str | None = None
    topic: str = ""

    @classmethod
    def parse(cls, spec: str, topic: str = "") -> EventsEndpoint:
        """``tcp://host:5557`` or ``tcp://host:5557,tcp://host:5558`` (with replay)."""
        parts = [p.strip() for p in spec.split(",")]
        if not 1 <= len(parts) <= 2 or not all(p.startswith(("tcp://", "ipc://", "inproc://"))
                                               for p in parts):
            raise ValueError(f"bad KV events endpoint {spec!r}: expected tcp://HOST:PORT or "
                             "tcp://HOST:PORT,tcp://HOST:REPLAY_PORT")
        return cls(parts[0], parts[1] if len(parts) == 2 else None, topic)


class _RawBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


class _BlockStored(msgspec.Struct, tag="BlockStored"):
    """vLLM's ``BlockStored`` (``vllm.distributed.kv_events``), the fields read here."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None


class _BlockRemoved(msgspec.Struct, tag="BlockRemoved"):
    """vLLM's ``BlockRemoved``."""

    block_hashes: list[bytes | int]
    medium: str | None = None


class _AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared"):
    """vLLM's ``AllBlocksCleared``."""


def event_decoder() -> msgspec.msgpack.Decoder[Any]:
    """A decoder of one event (a tagged map, as vLLM encodes its ``KVCacheEvent``)."""
    return msgspec.msgpack.Decoder(_BlockStored | _BlockRemoved | _AllBlocksCleared)


class EventStream:
    """A thread that keeps ``index`` in step with one instance's KV events.

    Args:
        name: the instance (logs, metrics).
        where: its events endpoints.
        index: the index fed.
        hasher: checks stored blocks' hashes against ours (``index.aligned``); None: no check.
        on_event: called with a counter name (``batches``, ``bad_frames``, ``unknown_events``,
            ``gaps_replayed``, ``gaps_partial``, ``gaps_rebuilt``, ``restarts``,
            ``cleared``, ``drops``).
        replay_timeout_s: how long to wait for the replay socket's next batch.
        pool: the shared index of the KV pool the instance writes to; None: its pool
            events go to ``index`` like any medium.
        pool_medium: the ``medium`` of the pool's events.
    """

    def __init__(self, name: str, where: EventsEndpoint, index: PrefixIndex,
                 hasher: PrefixCacheHasher | None = None,
                 on_event: Callable[[str], None] | None = None,
                 replay_timeout_s: float = 2.0, pool: PoolIndex | None = None,
                 pool_medium: str = POOL_MEDIUM) -> None:
        self.name = name
        self.pool = pool
        self.pool_medium = pool_medium
        self.where = where
        self.index = index
        self.hasher = hasher
        self.replay_timeout_s = replay_timeout_s
        self._on_event = on_event
        self._decode_event = event_decoder()
        self._decode_batch = msgspec.msgpack.Decoder(_RawBatch)
        self.state = "connecting"
        self.last_seq: int | None = None
        self.last_event_at = 0.0
        self.counts: dict[str, int] = {}
        self._replayed: set[int] = set()
        self._stop = threading.Event()
        self._fail = threading.Event()  # tests: drop the connection
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kv-events-{name}")

    # ------------------------------------------------------------ lifecycle
    def start(self) -> EventStream:
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        """Stop the subscriber (``wait``: until its thread ended, at most ~2 s)."""
        self._stop.set()
        if wait and self._thread.is_alive():
            self._thread.join(timeout=2.0)
        self.state = "stopped"

    def drop(self) -> None:
        """Make the subscriber lose its connection (tests of the reconnect path)."""
        self._fail.set()

    @property
    def usable(self) -> bool:
        """Whether the policy may trust the index now."""
        return self.state == "live" and self.index.aligned and bool(self.index.block_size)

    def as_dict(self) -> dict[str, Any]:
        return {"endpoint": self.where.endpoint, "replay": self.where.replay,
                "state": self.state, "usable": self.usable, "last_seq": self.last_seq,
                "last_event_age_s": (round(time.monotonic() - self.last_event_at, 3)
                                     if self.last_event_at else None),
                **self.counts}

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1
        if self._on_event is not None:
            self._on_event(what)

    def _run(self) -> None:
        import zmq

        while not self._stop.is_set():
            ctx = zmq.Context()
            sub = ctx.socket(zmq.SUB)
            try:
                sub.setsockopt(zmq.LINGER, 0)
                # a peer that vanished without closing is noticed and reconnected
                sub.setsockopt(zmq.HEARTBEAT_IVL, 2000)
                sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, 6000)
                sub.setsockopt(zmq.SUBSCRIBE, self.where.topic.encode())
                sub.connect(self.where.endpoint)
                self._sync(ctx)
                next_sync = time.monotonic() + SYNC_RETRY_S
                while not self._stop.is_set():
                    if self._fail.is_set():
                        self._fail.clear()
                        raise ConnectionError("subscriber dropped (injected)")
                    if sub.poll(100):
                        self.handle(sub.recv_multipart(), ctx)
                    elif (self.state == "connecting" and self.where.replay
                          and time.monotonic() > next_sync):
                        self._sync(ctx)  # the instance was not up yet: ask again
                        next_sync = time.monotonic() + SYNC_RETRY_S
            except Exception as exc:  # a subscriber must outlive anything
                self.state = "dropped"
                self._count("drops")
                logger.warning("KV events of %s: subscriber dropped (%s: %s); reconnecting",
                               self.name, type(exc).__name__, exc)
                self._stop.wait(0.5)
            finally:
                sub.close(linger=0)
                ctx.term()

    # ------------------------------------------------------------ frames
    def handle(self, frames: list[bytes], ctx: Any = None) -> None:
        """One ``(topic, seq, payload)`` frame from the PUB socket."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._count("bad_frames")
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        last = self.last_seq
        if last is not None and seq <= last:
            if seq in self._replayed:
                return  # already applied from the replay socket
            logger.warning("KV events of %s: sequence went back from %d to %d: the instance "
                           "restarted; clearing its prefix index", self.name, last, seq)
            self._count("restarts")
            self._lost()
            self.last_seq = last = None
        self._replayed.clear()
        if last is None and seq > 0 or last is not None and seq > last + 1:
            start = 0 if last is None else last + 1
            if last is not None:
                logger.warning("KV events of %s: lost batches %d..%d", self.name, start,
                               seq - 1)
            self.state = "replaying"
            if not self._replay(start, seq, ctx):
                self._lost()
                self._count("gaps_rebuilt")
                logger.warning("KV events of %s: batches %d..%d not replayable; prefix "
                               "index cleared and rebuilt from live events", self.name, start,
                               seq - 1)
            else:
                self._count("gaps_replayed")
        if self.last_seq is None or seq > self.last_seq:  # else: the replay covered it
            self.apply(seq, frames[2])
        self.state = "live"

    def apply(self, seq: int, payload: bytes) -> None:
        """Apply one batch to the index; a garbled one is a lost batch (index cleared)."""
        self.last_seq = seq
        self.last_event_at = time.monotonic()
        try:
            batch = self._decode_batch.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._count("bad_frames")
            self._lost()
            logger.warning("KV events of %s: batch %d does not decode (%s); prefix index "
                           "cleared", self.name, seq, exc)
            return
        self._count("batches")
        for raw in batch.events:
            try:
                event = self._decode_event.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self._count("unknown_events")
                continue
            pool = (self.pool if self.pool is not None
                    and getattr(event, "medium", None) == self.pool_medium else None)
            if isinstance(event, _BlockStored):
                keys = [block_key(h) for h in event.block_hashes]
                if pool is not None:
                    self._verify(event, pool)
                    pool.store(keys, self.name, event.block_size)
                else:
                    self._verify(event, self.index)
                    self.index.store(keys, event.medium, event.block_size)
            elif isinstance(event, _BlockRemoved):
                keys = [block_key(h) for h in event.block_hashes]
                if pool is not None:
                    pool.remove(keys)
                else:
                    self.index.remove(keys, event.medium)
            elif isinstance(event, _AllBlocksCleared):
                self._count("cleared")
                self.index.clear()

    def _lost(self) -> None:
        """Events of this stream were lost: what it told may be stale."""
        self.index.clear()
        if self.pool is not None:
            self.pool.forget(self.name)

    def _verify(self, event: Any, index: PrefixIndex | PoolIndex) -> None:
        """Recompute the first stored block's hash from its tokens (when the event gives
        its parent as bytes or has none): a mismatch means the proxy's hash settings are
        not the instance's (``index``: the index the event feeds, disabled by it)."""
        hasher = self.hasher
        parent = event.parent_block_hash
        size = event.block_size
        if (hasher is None or not event.block_hashes or not size
                or len(event.token_ids) < size or isinstance(parent, int)
                or getattr(event, "lora_name", None) or getattr(event, "lora_id", None)
                or (getattr(event, "extra_keys", None) or [None])[0] is not None):
            return
        mine = block_key(hasher.hash_block(parent, event.token_ids[:size]))
        if mine == block_key(event.block_hashes[0]):
            index.hash_verified += 1
        else:
            if index.hash_mismatched == 0:
                logger.error("KV events of %s: a stored block's hash differs from the one "
                             "computed with --kv-hash-algo %s and its seed: align them with "
                             "the instance's --prefix-caching-hash-algo and PYTHONHASHSEED; "
                             "its prefix index is not used", self.name, hasher.algo)
            index.hash_mismatched += 1

    def _sync(self, ctx: Any) -> None:
        """On (re)connecting: fetch what the publisher sent before (at start) or while
        the subscriber was away; without a replay socket, a reconnect clears the index."""
        start = 0 if self.last_seq is None else self.last_seq + 1
        if self.where.replay:
            self.state = "replaying"
            if self._replay(start, start, ctx):
                self.state = "live"
                return
        if self.last_seq is None:
            self.state = "connecting"  # nothing heard from the publisher yet
            return
        self._lost()
        self._count("gaps_rebuilt")
        self.state = "live"

    def _replay(self, start: int, until: int, ctx: Any) -> bool:
        """Ask the replay socket for batches ``start`` .. ``until - 1`` and apply them.

        True when the index is consistent through ``until - 1`` afterwards: every batch
        came, or the publisher's buffer no longer held the first ones and the index was
        rebuilt from what it holds (``gaps_partial``). False: no answer in time, or batches
        that do not follow one another."""
        if not self.where.replay or ctx is None:
            return False
        import zmq

        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.where.replay)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            limit = time.monotonic() + REPLAY_LIMIT_S
            got: list[tuple[int, bytes]] = []
            while True:
                # each next batch within the timeout: a full buffer takes longer than one
                left = min(self.replay_timeout_s, limit - time.monotonic())
                if left <= 0 or not sock.poll(int(left * 1000)):
                    # at start the instance may not be up yet: not worth a warning
                    logger.log(logging.INFO if self.last_seq is None else logging.WARNING,
                               "KV events of %s: replay socket %s did not answer in %.1fs "
                               "(%d batches received)", self.name, self.where.replay,
                               self.replay_timeout_s, len(got))
                    return False
                frames = sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    self._count("bad_frames")
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    break
                got.append((seq, frames[3]))
        finally:
            sock.close(linger=0)
        if not got:
            return until <= start
        first = got[0][0]
        if first < start:
            return False  # not what was asked: not the publisher we know
        if first > start:
            # the buffer no longer holds start .. first - 1: what they said is lost (a
            # removal among them would leave a stale block), rebuild from the buffer
            logger.log(logging.INFO if self.last_seq is None else logging.WARNING,
                       "KV events of %s: the publisher no longer buffers batches %d..%d; "
                       "prefix index rebuilt from its %d buffered ones", self.name, start,
                       first - 1, len(got))
            self._lost()
            self._count("gaps_partial")
            self.last_seq = first - 1
        for seq, payload in got:
            if self.last_seq is not None and seq <= self.last_seq:
                continue
            if self.last_seq is not None and seq != self.last_seq + 1:
                return False
            self.apply(seq, payload)
            self._replayed.add(seq)
        return self.last_seq is not None and self.last_seq >= until - 1
