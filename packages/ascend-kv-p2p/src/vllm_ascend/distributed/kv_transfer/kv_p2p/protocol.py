# SPDX-License-Identifier: Apache-2.0
"""Side-channel messages between a decode (D) and a prefill (P) instance.

One ZeroMQ REQ/ROUTER channel per P worker rank, msgspec on the wire
(:mod:`vllm_ascend.distributed.kv_transfer.core.wire`), never pickle:

* ``GetMeta`` -> ``AgentMeta``: who P is and where its KV cache lives; D
  compares it with its own before the first transfer (compatibility check).
* ``Claim`` -> ``ClaimOK``: D asks to read blocks of a request; P answers only
  if it holds exactly those blocks for that request, and renews the lease.
  With a deployment key configured P answers ``ClaimGrant`` instead, which also
  carries the addresses of the claimed blocks in each region (:mod:`.grants`): a keyed
  P's ``AgentMeta`` leaves its region bases out (``region_addrs`` empty) and no message
  carries them, so a D that holds a request's capability learns where that request's
  blocks are, not P's memory map.
* ``Renew`` -> ``RenewReply``: D (and the proxy) keep P's leases alive while D waits,
  presenting each request's capability; P renews only up to the request's hold limit
  (``max_hold_s``), so no peer keeps blocks held indefinitely.
* ``Done`` -> ``DoneAck``: D has read (or gives up); P frees the blocks once
  every expected reader is done. ``valid`` says whether the lease was still
  held when the read finished, i.e. whether the bytes D read are the request's.
"""

from __future__ import annotations

import msgspec

from vllm_ascend.distributed.kv_transfer.core.layout import LayoutDescriptor
from vllm_ascend.distributed.kv_transfer.core.wire import Codec, Message

#: Bumped on incompatible changes of these messages; checked in the handshake.
PROTOCOL_VERSION = 1


class GetMeta(Message):
    """D asks for P's :class:`AgentMeta`."""

    requester: str = ""


class AgentMeta(Message):
    """A worker's identity and KV cache description."""

    protocol_version: int
    engine_id: str
    model: str
    session: str  # transfer engine "host:rpc_port"
    tp_rank: int
    tp_size: int
    pp_rank: int
    total_num_kv_heads: int
    layout: LayoutDescriptor
    #: base address of each registered KV region (empty from a worker with a deployment
    #: key: its grants name the addresses of each request's blocks instead)
    region_addrs: list[int]
    region_strides: list[int]
    vllm_version: str = ""
    #: a pipeline-parallel P stage (:mod:`.pull.contract`): the instance's stages, the index of
    #: this stage's first layer and the model's layer count (``layout`` has the stage's
    #: layers only); ``total_num_layers`` 0: ``layout.num_layers``
    pp_size: int = 1
    first_layer: int = 0
    total_num_layers: int = 0
    #: this start of the engine (:func:`~.params.engine_instance`; ``""``: not told): a
    #: P that restarted at the same address has another
    instance: str = ""
    #: a KV cache in host memory: the host (:func:`~vllm_ascend.distributed.kv_transfer.
    #: core.local_reads.host_identity`) and process that hold it, so that a peer on the same
    #: host copies from it directly (``""``/0: device memory, or not offered)
    local_host: str = ""
    pid: int = 0
    #: the KV cache groups under vLLM's hybrid KV cache manager
    #: (:meth:`~vllm_ascend.distributed.kv_transfer.core.kv_groups.KVGroups.signature`:
    #: kind, block size, window and layers of each; empty: one group)
    kv_groups: list[str] = msgspec.field(default_factory=list)


class Claim(Message):
    """D will read ``block_ids`` of P's request ``request_id``."""

    request_id: str
    block_ids: list[int]
    reader: str
    num_readers: int = 1
    #: the request's capability from ``kv_transfer_params`` (``remote_claim_token``)
    token: str = ""


class ClaimOK(Message):
    """P holds the blocks; the lease now runs ``lease_s`` more seconds."""

    lease_s: float


class ClaimGrant(Message):
    """``ClaimOK`` of a P with a deployment key: the lease, and where the claimed blocks are.

    ``block_addrs`` names, for each of P's ``num_regions`` regions, the address of each
    block of the claim, in the claim's order (little-endian u64, region-major:
    :mod:`.grants`): ``8 * num_regions * len(block_ids)`` bytes. Nothing else of P's
    memory (no region base, no stride); D refuses a grant of another size (``bad_grant``).
    """

    lease_s: float
    block_addrs: bytes = b""
    num_regions: int = 0


class Renew(Message):
    """Keep the leases of these requests alive."""

    request_ids: list[str]
    #: the capability of each request (``remote_claim_token``), in the order of
    #: ``request_ids`` (a missing one is ``""``; required with a deployment key)
    tokens: list[str] = []


class RenewReply(Message):
    """Which of the requests P still holds."""

    held: list[str]


class Done(Message):
    """D finished with ``request_id`` (read or gave up)."""

    request_id: str
    reader: str
    success: bool = True
    num_readers: int = 1
    #: the request's capability, as in :class:`Claim`
    token: str = ""


class DoneAck(Message):
    """``valid``: the blocks were held for the request until this Done arrived."""

    valid: bool


#: The largest side-channel message. A keyed grant names 8 bytes a block and region: 1 MiB
#: for a 128k-token prompt in blocks of 128 at 128 regions (64 layers' K and V); 16 MiB fits
#: 2M addresses (a claim larger than that fails, and is recomputed).
MAX_MESSAGE_BYTES = 1 << 24

CODEC: Codec[Message] = Codec([GetMeta, AgentMeta, Claim, ClaimOK, ClaimGrant, Renew,
                               RenewReply, Done, DoneAck], max_size=MAX_MESSAGE_BYTES)


def side_channel_port(kv_port: int, *, dp_rank: int, tp_size: int, pp_size: int) -> int:
    """Base side-channel port of a data-parallel rank (upstream's layout)."""
    return kv_port + dp_rank * tp_size * pp_size


def worker_port(base_port: int, *, tp_rank: int, tp_size: int, pp_rank: int = 0) -> int:
    """Side-channel port of one worker: ``base + pp_rank * tp_size + tp_rank``."""
    return base_port + pp_rank * tp_size + tp_rank


# ---------------------------------------------------------------------------------------------
# MooncakeLayerwiseConnector: P pushes into D. D serves the side channel, P is the client:
#
# * ``GetMeta`` -> ``AgentMeta``: D's cache description; P checks it against its own
#   (:func:`compatibility_problem`) before the first write.
# * ``PushBegin`` -> ``PushGrant``: P will write ``block_ids`` of D's request ``request_id``;
#   D answers only if it is waiting for that very request with exactly those blocks, and
#   grants a write lease. P writes only while it holds the lease. A keyed D answers
#   ``PushBlocksGrant``, which also names the addresses of those blocks in D's cache.
# * ``PushRenew`` -> ``PushRenewReply``: P keeps its leases alive; a lease D no longer
#   grants (deadline passed, request aborted, another sender failed) means "stop writing".
# * ``PushDone`` -> ``PushDoneAck``: P finished (or gave up on) a request; D counts these
#   against the number of P ranks that push to it and ends the wait.
# ---------------------------------------------------------------------------------------------

#: Bumped on incompatible changes of the layerwise messages.
LAYERWISE_PROTOCOL_VERSION = 1


class PushBegin(Message):
    """P rank ``p_rank`` of ``p_tp_size`` will write ``block_ids`` of D's ``request_id``."""

    request_id: str
    sender: str
    p_rank: int
    p_tp_size: int
    block_ids: list[int]
    #: bytes of one of P's blocks per region (D sizes staging buffers with them)
    block_lens: list[int]
    protocol_version: int = LAYERWISE_PROTOCOL_VERSION
    #: the request's capability D issued (``remote_push_token`` of the params D posted)
    token: str = ""
    #: the host P's transfer engine writes from (D fences its connections from there when
    #: the push fails with a write that could still land; empty: D fences every peer's)
    te_host: str = ""


class PushGrant(Message):
    """D accepts the writes for ``lease_s`` seconds (renewable).

    ``staging_addrs[i]`` non-zero: write region ``i`` of P's whole blocks there (block ``k``
    of the request at ``staging_addrs[i] + k * staging_strides[i]``), not into D's cache; D
    merges the heads it needs once the sender is done (head layouts where a P rank's heads
    are not contiguous inside D's blocks).
    """

    lease_s: float
    num_senders: int
    staging_addrs: list[int]
    staging_strides: list[int]
    #: always empty (the bytes of an unkeyed D's grant as before); a keyed D answers
    #: :class:`PushBlocksGrant`
    region_addrs: list[int] = []
    region_strides: list[int] = []


class PushBlocksGrant(PushGrant):
    """``PushGrant`` of a D with a deployment key (its ``AgentMeta`` leaves its region bases
    out): also where P writes each block of the push in D's cache.

    ``block_addrs`` names, for each of D's ``num_regions`` regions, the address of each
    block of ``PushBegin.block_ids``, in that order (little-endian u64, region-major:
    :mod:`.grants`); 0 for a region P writes into staging instead. P refuses a grant of
    another size (``bad_grant``).
    """

    block_addrs: bytes = b""
    num_regions: int = 0


class PushRenew(Message):
    """Keep ``sender``'s write leases of these requests alive (D renews none past the
    request's load deadline)."""

    request_ids: list[str]
    sender: str
    #: the capability of each request (``remote_push_token``), in the order of
    #: ``request_ids`` (a missing one is ``""``; required with a deployment key)
    tokens: list[str] = []


def token_of(tokens: list[str], index: int) -> str:
    """The token presented for the ``index``-th request of a renewal (``""``: none)."""
    return tokens[index] if index < len(tokens) else ""


class PushRenewReply(Message):
    """Requests whose lease D renewed; a missing one means: stop writing, send PushDone."""

    granted: list[str]


class PushDone(Message):
    """``sender`` is done with ``request_id``: every layer written, or given up."""

    request_id: str
    sender: str
    success: bool = True
    reason: str = ""
    nbytes: int = 0
    #: the request's capability (as in :class:`PushBegin`)
    token: str = ""
    #: every write of this sender for the request completed or never started, so none can
    #: land later (False, also from an older P: a write failed in the transfer engine and its
    #: bytes may still be on the way; D fences before it hands the blocks back)
    settled: bool = False


class PushDoneAck(Message):
    """``accepted``: D was still waiting for this sender of this request."""

    accepted: bool


LAYERWISE_CODEC: Codec[Message] = Codec(
    [GetMeta, AgentMeta, PushBegin, PushGrant, PushBlocksGrant, PushRenew, PushRenewReply,
     PushDone, PushDoneAck], max_size=MAX_MESSAGE_BYTES)


def compatibility_problem(mine: AgentMeta, theirs: AgentMeta, *, expect_tp: int,
                          configured_tp: int | None = None, me: str = "D", them: str = "P",
                          verb: str = "hand its KV cache to") -> str:
    """Why ``theirs`` cannot exchange KV blocks with ``mine``, naming both values; '' if it can.

    Args:
        mine: this worker's metadata.
        theirs: the peer's metadata (from ``GetMeta``).
        expect_tp: the peer's tensor-parallel size according to the request's params.
        configured_tp: the peer's ``tp_size`` from ``kv_connector_extra_config``, if set.
        me: how this side is called in the message (``"D"`` or ``"P"``).
        them: how the peer is called.
        verb: what the peer cannot do, for the message.
    """
    a, b = mine.layout, theirs.layout
    checks = [
        ("protocol version", mine.protocol_version, theirs.protocol_version),
        ("model", mine.model, theirs.model),
        ("dtype", a.dtype, b.dtype),
        ("block size", a.block_size, b.block_size),
        ("KV layout", a.kind, b.kind),
        ("number of layers", mine.total_num_layers or a.num_layers,
         theirs.total_num_layers or b.num_layers),
        ("head size", a.head_size, b.head_size),
        ("MLA", a.is_mla, b.is_mla),
        ("total KV heads", mine.total_num_kv_heads, theirs.total_num_kv_heads),
        (f"{them} tensor-parallel size", expect_tp, theirs.tp_size),
        ("KV cache groups (hybrid KV cache manager)", mine.kv_groups or "one group",
         theirs.kv_groups or "one group"),
    ]
    if configured_tp is not None:
        side = "prefill" if them == "P" else "decode"
        checks.append((f"{them} tensor-parallel size ({side}.tp_size)", configured_tp,
                       theirs.tp_size))
    bad = [f"{what}: {me} has {x!r}, {them} has {y!r}" for what, x, y in checks if x != y]
    if bad:
        return (f"{them} engine {theirs.engine_id} ({theirs.session}) cannot {verb} this {me} "
                f"instance ({mine.engine_id}): " + "; ".join(bad))
    return ""
