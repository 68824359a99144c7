# SPDX-License-Identifier: Apache-2.0
"""Faults injected inside a running engine (``EngineProcess.call("ascend_kv_testing.fault_hooks:...")``).

Each hook wraps one method of a live connector object so that a fault happens at an
exact point of the protocol (after P granted a claim, while D reads, half-way through
a pool put), which a kill from outside could only hit by luck. The hooks do not
change what the connector does otherwise.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from .probes import _worker_connectors, _worker_of


def _worker(llm: Any, connector: str) -> Any:
    for conn in _worker_connectors(llm):
        if type(conn).__name__ == connector:
            return _worker_of(conn)
    raise LookupError(f"no {connector} in this engine")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def pause_before_read(llm: Any, flag_dir: str, max_wait_s: float = 60.0) -> bool:
    """D (pull): the next read waits, after P granted the claim, until ``flag_dir/go``
    exists or ``max_wait_s`` passed (a read stalled on the network); ``flag_dir/reading``
    tells the test that the read is waiting. Later reads are not paused."""
    reader = _worker(llm, "MooncakeConnector").reader  # the D-side puller
    original = reader._read
    flags = Path(flag_dir)

    def paused(*args: Any, **kwargs: Any) -> Any:
        reader._read = original
        (flags / "reading").touch()
        end = time.monotonic() + max_wait_s
        while not (flags / "go").exists() and time.monotonic() < end:
            time.sleep(0.02)
        (flags / "resumed").touch()
        return original(*args, **kwargs)

    reader._read = paused
    return True


def die_on_read(llm: Any) -> bool:
    """D (pull): SIGKILL this process when the first read starts (P granted the claim and
    holds the blocks for a reader that is now dead)."""
    reader = _worker(llm, "MooncakeConnector").reader  # the D-side puller

    def dying(*args: Any, **kwargs: Any) -> Any:
        _die()

    reader._read = dying
    return True


def die_mid_put(llm: Any, after_keys: int = 1) -> bool:
    """Pool worker: the next put stores its first ``after_keys`` objects, then the process
    is SIGKILLed before it stores the rest (a client killed mid-put)."""
    worker = _worker(llm, "AscendStoreConnector")
    backend = worker.backend
    original = backend.put

    def dying(keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        if len(keys) > after_keys:
            original(keys[:after_keys], addrs[:after_keys], sizes[:after_keys])
            _die()
        return original(keys, addrs, sizes)

    backend.put = dying
    return True


def _layer_writes(llm: Any) -> Any:
    """The object whose ``write_layers`` does P's batched writes into D's blocks (the
    layerwise worker's P sender's links)."""
    return _worker(llm, "MooncakeLayerwiseConnector").sender.links


def die_mid_push(llm: Any, after_writes: int = 1) -> bool:
    """P (layerwise): SIGKILL this process once ``after_writes`` writes into D's blocks have
    completed (D granted the lease and holds part of the prompt's KV). A write carries one
    layer, or several of one step when they queued up behind each other."""
    links = _layer_writes(llm)
    original = links.write_layers
    done = [0]

    def counting(*args: Any, **kwargs: Any) -> Any:
        nbytes = original(*args, **kwargs)
        done[0] += 1
        if done[0] >= after_writes:
            _die()
        return nbytes

    links.write_layers = counting
    return True


def pause_push(llm: Any, flag_dir: str, after_writes: int = 1, max_wait_s: float = 60.0) -> bool:
    """P (layerwise): once ``after_writes`` writes (of one or more layers) completed, the next
    one waits until
    ``flag_dir/go`` exists or ``max_wait_s`` passed; ``flag_dir/pushing`` tells the test
    that P is mid-push (it holds D's write lease). Later writes are not paused."""
    links = _layer_writes(llm)
    original = links.write_layers
    flags = Path(flag_dir)
    done = [0]

    def paused(*args: Any, **kwargs: Any) -> Any:
        if done[0] >= after_writes:
            links.write_layers = original
            (flags / "pushing").touch()
            end = time.monotonic() + max_wait_s
            while not (flags / "go").exists() and time.monotonic() < end:
                time.sleep(0.02)
            (flags / "resumed").touch()
            return original(*args, **kwargs)
        done[0] += 1
        return original(*args, **kwargs)

    links.write_layers = paused
    return True


def slow_read(llm: Any, flag_dir: str, pieces: int = 64, pause_s: float = 0.03) -> bool:
    """D (pull): the next transfer-engine read is cut into ``pieces`` reads of about equal
    size, ``pause_s`` apart (a slow link): the read is really in flight for about
    ``pieces * pause_s`` seconds. ``flag_dir/reading`` appears once the first piece landed;
    ``flag_dir/pieces`` holds how many pieces landed when the read returned or raised."""
    worker = _worker(llm, "MooncakeConnector")
    te = worker.te
    original = te.read
    flags = Path(flag_dir)

    def sliced(peer: str, local: Any, remote: Any, lengths: Any, **kwargs: Any) -> int:
        # kwargs: the read's own options (``merged``, ``wait``), kept for every piece
        te.read = original
        ranges: list[tuple[int, int, int]] = []
        total = sum(lengths)
        step = max(1, -(-total // pieces))
        for lo, ro, n in zip(local, remote, lengths, strict=True):
            for off in range(0, n, step):
                ranges.append((lo + off, ro + off, min(step, n - off)))
        per = max(1, -(-len(ranges) // pieces))
        landed = moved = 0
        try:
            for i in range(0, len(ranges), per):
                part = ranges[i:i + per]
                moved += original(peer, [r[0] for r in part], [r[1] for r in part],
                                  [r[2] for r in part], **kwargs)
                landed += 1
                if landed == 1:
                    (flags / "reading").touch()
                time.sleep(pause_s)
        finally:
            (flags / "pieces").write_text(f"{landed} {-(-len(ranges) // per)}")
        return moved

    te.read = sliced
    return True
