# SPDX-License-Identifier: Apache-2.0
"""The read window: D reads a fresh request's blocks without claiming them first.

A claim costs D a side-channel round trip before a load may end; for a small request
that is as long as the read itself. P therefore promises more than the lease:

* P's scheduler stamps the request's ``kv_transfer_params`` with the wall time it began
  holding the blocks (``remote_held_at``), the window (``remote_hold_s``, P's
  ``read_window_s``, at most half the lease), its engine start (``remote_instance``) and a
  tag over these, the request id, its block ids and its token (``remote_window_tag``,
  :func:`window_tag`), which stands for the claim's checks of them.
* P's worker keeps the blocks at least that long from when it registers the hold (after
  the stamp), even when D's ``Done`` comes sooner (:mod:`.holder` defers the
  release; a ``Claim`` after a ``Done`` is still refused).

So a read that ended before ``remote_held_at + remote_hold_s`` in P's clock read the
request's KV, whoever read it and however often: P could not have freed the blocks yet.
D checks that with its own clock at the end of the read, less :data:`CLOCK_SKEW_S` for the
difference between the clocks (:func:`window_end`). A read that ends later is claimed
after it, which proves as much (held at the answer, and continuously since before the
read: see :meth:`~.reader.PullReader._pull`).

The tag is checked once a request, by D's scheduler when it parses the params; its
verdict, the window's end, goes to the worker with the request
(:attr:`~.contract.RecvMeta.window_until`, read through :func:`read_until`), which does not
check the tag again. The verdict depends on the params alone, so it goes stale only by
time: the worker compares it with its clock before the read goes out and when it ended, as
above.

D uses the window only with region addresses of the same P engine start
(:func:`same_instance`): a P restarted at the same address is another instance, whose
memory D's cached metadata does not describe. D's scheduler does not claim ahead a
request still well within its window (:func:`in_window`); one that waited longer in D's
queue is claimed ahead as before.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_ascend.distributed.kv_transfer.core import auth

from ..params import RemotePrefill
from ..protocol import AgentMeta

#: How far (seconds) one host's wall clock may seem ahead of another's before D distrusts
#: a time it did not measure itself (P's stamp, its scheduler's claim sent ahead): the
#: same host never; NTP-synced hosts, milliseconds.
CLOCK_SKEW_S = 0.5

#: How much of the window must be left for D's scheduler to leave a request unclaimed
#: (the read and the hand-off to the worker must fit in it).
AHEAD_MARGIN_S = 0.1


#: what the window tag's key is derived for (from the deployment key, if any)
TAG_PURPOSE = "p2p-read-window"


def _tag(key: bytes, instance: str, request_id: str, block_ids: Sequence[int],
         held_at: float, hold_s: float, token: str) -> str:
    text = "|".join([instance, request_id, ",".join(map(str, block_ids)), repr(float(held_at)),
                     repr(float(hold_s)), token])
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def window_tag(*, instance: str, request_id: str, block_ids: Sequence[int], held_at: float,
               hold_s: float, token: str) -> str:
    """P's tag over what D reads unclaimed: a request id, its block ids, the window and the
    capability token. Without a claim P cannot check them, so D checks this instead: params
    changed on the way (another request's id or blocks, a stale token) do not match and are
    claimed (and refused) as before. Keyed with the deployment key when there is one (a
    proxy without it cannot forge a tag); without one a plain checksum, as good as the
    unkeyed claim's checks (which anyone who reaches the side channel gets past)."""
    a = auth.from_env()
    key = a.purpose_keys(TAG_PURPOSE)[0] if a is not None else b""
    return _tag(key, instance, request_id, block_ids, held_at, hold_s, token)


def stamp(*, instance: str, request_id: str, block_ids: Sequence[int], token: str,
          hold_s: float) -> dict[str, Any]:
    """The ``kv_transfer_params`` keys of P's read window for a request P holds from now
    (none when the window is off or the engine start is not known)."""
    if not instance or hold_s <= 0:
        return {}
    held_at = time.time()
    return {"remote_instance": instance, "remote_held_at": held_at, "remote_hold_s": hold_s,
            "remote_window_tag": window_tag(instance=instance, request_id=request_id,
                                            block_ids=block_ids, held_at=held_at,
                                            hold_s=hold_s, token=token)}


def tag_ok(remote: RemotePrefill) -> bool:
    """Whether ``remote``'s window tag is P's for exactly these params."""
    if not remote.window_tag:
        return False
    a = auth.from_env()
    keys = a.purpose_keys(TAG_PURPOSE) if a is not None else (b"",)
    return any(hmac.compare_digest(remote.window_tag, _tag(
        k, remote.instance, remote.request_id, remote.block_ids, remote.held_at, remote.hold_s,
        remote.token)) for k in keys)


def window_end(remote: RemotePrefill) -> float:
    """D's ``time.time()`` by which a read of ``remote``'s blocks must end to be trusted
    without a claim; ``-inf`` when P made no such promise, or the params are not the ones
    P tagged."""
    if remote.hold_s <= 0 or remote.held_at <= 0 or not remote.instance or not tag_ok(remote):
        return -math.inf
    return remote.held_at + remote.hold_s - CLOCK_SKEW_S


def read_until(remote: RemotePrefill, verdict: float | None) -> float:
    """:func:`window_end` of ``remote``, or the ``verdict`` D's scheduler sent with the
    request (:attr:`~.contract.RecvMeta.window_until`: it checked the tag when it parsed the
    params, so the worker does not check it again); ``None``: not judged, checked here."""
    return window_end(remote) if verdict is None else verdict


def in_window(remote: RemotePrefill, *, margin_s: float = AHEAD_MARGIN_S,
              now: float | None = None, until: float | None = None) -> bool:
    """Whether more than ``margin_s`` of the request's read window is left (``until``: its
    :func:`window_end` if known already, not computed again)."""
    end = window_end(remote) if until is None else until
    return (time.time() if now is None else now) + margin_s < end


def same_instance(remote: RemotePrefill, metas: Mapping[int, AgentMeta]) -> bool:
    """Whether every P rank's regions in ``metas`` are of the engine start that holds the
    request (both told; an unknown instance never matches)."""
    return bool(remote.instance) and all(m.instance == remote.instance
                                         for m in metas.values())
