# SPDX-License-Identifier: Apache-2.0
"""Side-channel messages between a decode (D) and a prefill (P) instance.

One ZeroMQ REQ/ROUTER channel per P worker rank, msgspec on the wire
(:mod:`vllm_ascend.distributed.kv_transfer.core.wire`), never pickle:

* ``GetMeta`` -> ``AgentMeta``: who P is and where its KV cache lives; D
  compares it with its own before the first transfer (compatibility check).
* ``Claim`` -> ``ClaimOK``: D asks to read blocks of a request; P answers only
  if it holds exactly those blocks for that request, and renews the lease.
* ``Renew`` -> ``RenewReply``: D keeps P's leases alive while it waits.
* ``Done`` -> ``DoneAck``: D has read (or gives up); P frees the blocks once
  every expected reader is done. ``valid`` says whether the lease was still
  held when the read finished, i.e. whether the bytes D read are the request's.
"""

from __future__ import annotations

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
    region_addrs: list[int]
    region_strides: list[int]
    vllm_version: str = ""


class Claim(Message):
    """D will read ``block_ids`` of P's request ``request_id``."""

    request_id: str
    block_ids: list[int]
    reader: str
    num_readers: int = 1


class ClaimOK(Message):
    """P holds the blocks; the lease now runs ``lease_s`` more seconds."""

    lease_s: float


class Renew(Message):
    """Keep the leases of these requests alive."""

    request_ids: list[str]


class RenewReply(Message):
    """Which of the requests P still holds."""

    held: list[str]


class Done(Message):
    """D finished with ``request_id`` (read or gave up)."""

    request_id: str
    reader: str
    success: bool = True
    num_readers: int = 1


class DoneAck(Message):
    """``valid``: the blocks were held for the request until this Done arrived."""

    valid: bool


CODEC: Codec[Message] = Codec([GetMeta, AgentMeta, Claim, ClaimOK, Renew, RenewReply, Done,
                               DoneAck], max_size=1 << 22)


def side_channel_port(kv_port: int, *, dp_rank: int, tp_size: int, pp_size: int) -> int:
    """Base side-channel port of a data-parallel rank (upstream's layout)."""
    return kv_port + dp_rank * tp_size * pp_size


def worker_port(base_port: int, *, tp_rank: int, tp_size: int, pp_rank: int = 0) -> int:
    """Side-channel port of one worker: ``base + pp_rank * tp_size + tp_rank``."""
    return base_port + pp_rank * tp_size + tp_rank
