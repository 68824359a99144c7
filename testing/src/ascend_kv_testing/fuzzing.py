# SPDX-License-Identifier: Apache-2.0
"""Hypothesis strategies for fuzzing the project's sockets.

* :func:`struct_strategy` builds valid instances of any ``msgspec.Struct`` from its
  type information (constraints such as ``ge``, ``max_length`` and fixed byte lengths
  included), so every message type of a :class:`~vllm_ascend.distributed.kv_transfer.core.wire.Codec`
  can be generated without writing a strategy per type;
* :func:`wire_payloads` gives what a hostile or broken peer sends: valid messages of the
  endpoint's protocol, the same messages mutated (bytes flipped, cut, spliced, fields
  given values of the wrong type, unknown tags, other wire versions), messages of other
  protocols, and random bytes;
* :func:`json_bodies` does the same for the proxy's JSON API.
"""

from __future__ import annotations

from typing import Any

import msgspec
import msgspec.inspect as mi
from hypothesis import strategies as st

#: Bounds that keep generated messages small enough to send hundreds of them quickly.
MAX_LIST = 6
MAX_TEXT = 24
INT_BOUND = 1 << 62


def _int(t: mi.IntType) -> st.SearchStrategy[int]:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -INT_BOUND)
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else INT_BOUND)
    edges = [v for v in (lo, hi, 0, 1, -1, 2**31, 2**32, 2**63 - 1) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi)) if edges else st.integers(lo, hi)


def _size(lo: int | None, hi: int | None) -> tuple[int, int]:
    lo = lo or 0
    hi = min(hi if hi is not None else MAX_LIST, max(lo, MAX_LIST))
    return lo, hi


def type_strategy(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values valid for the msgspec type ``t``."""
    if isinstance(t, mi.IntType):
        return _int(t)
    if isinstance(t, mi.FloatType):
        return st.floats(allow_nan=False, allow_infinity=False, min_value=t.ge, max_value=t.le)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.StrType):
        lo, hi = _size(t.min_length, t.max_length if t.max_length is not None else MAX_TEXT)
        return st.text(min_size=lo, max_size=hi)
    if isinstance(t, mi.BytesType | mi.ByteArrayType):
        lo, hi = _size(t.min_length, t.max_length if t.max_length is not None else MAX_TEXT)
        return st.binary(min_size=lo, max_size=hi)
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.AnyType):
        return st.one_of(st.none(), st.integers(), st.text(max_size=MAX_TEXT))
    if isinstance(t, mi.ListType | mi.SetType | mi.FrozenSetType | mi.VarTupleType):
        lo, hi = _size(t.min_length, t.max_length)
        return st.lists(type_strategy(t.item_type), min_size=lo, max_size=hi)
    if isinstance(t, mi.DictType):
        lo, hi = _size(t.min_length, t.max_length)
        return st.dictionaries(type_strategy(t.key_type), type_strategy(t.value_type),
                               min_size=lo, max_size=hi)
    if isinstance(t, mi.UnionType):
        return st.one_of([type_strategy(x) for x in t.types])
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(list(t.values))
    if isinstance(t, mi.EnumType):
        return st.sampled_from(list(t.cls))
    if isinstance(t, mi.StructType):
        return struct_strategy(t.cls)
    raise NotImplementedError(f"no strategy for msgspec type {t!r}")


def struct_strategy(cls: type[msgspec.Struct]) -> st.SearchStrategy[msgspec.Struct]:
    """Valid instances of ``cls``; optional fields are sometimes left at their default."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    optional: dict[str, st.SearchStrategy[Any]] = {}
    for f in info.fields:
        (fields if f.required else optional)[f.name] = type_strategy(f.type)
    return st.builds(cls, **fields, **{k: v for k, v in optional.items()}) | st.builds(
        cls, **fields)


def _wrong_value() -> st.SearchStrategy[Any]:
    """Values of every msgpack type, including ones no field accepts."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                        st.floats(allow_nan=True), st.text(max_size=MAX_TEXT),
                        st.binary(max_size=MAX_TEXT))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8)


def _mutate(data: bytes, ops: list[tuple[str, int, bytes]]) -> bytes:
    buf = bytearray(data)
    for op, pos, extra in ops:
        if not buf and op != "insert":
            continue
        i = pos % max(len(buf), 1)
        if op == "flip":
            buf[i] ^= 1 << (pos % 8)
        elif op == "cut":
            del buf[i:]
        elif op == "insert":
            buf[i:i] = extra
        elif op == "delete":
            del buf[i:i + max(1, len(extra))]
        elif op == "replace":
            buf[i:i + len(extra)] = extra
    return bytes(buf)


def wire_payloads(codec: Any, *, others: tuple[Any, ...] = ()) -> st.SearchStrategy[bytes]:
    """Bytes a broken or hostile peer might send to an endpoint speaking ``codec``.

    Args:
        codec: the endpoint's :class:`~vllm_ascend.distributed.kv_transfer.core.wire.Codec`.
        others: codecs of other endpoints (their valid messages are wrong here).
    """
    from vllm_ascend.distributed.kv_transfer.core.wire import HEADER, MAGIC

    valid = st.one_of([struct_strategy(t) for t in codec.types])
    encoded = valid.map(codec.encode)
    ops = st.lists(st.tuples(st.sampled_from(["flip", "cut", "insert", "delete", "replace"]),
                             st.integers(0, 1 << 16), st.binary(min_size=1, max_size=16)),
                   min_size=1, max_size=4)
    mutated = st.builds(_mutate, encoded, ops)

    def retyped(msg: msgspec.Struct, key_pick: int, value: Any) -> bytes:
        doc = msgspec.to_builtins(msg)
        keys = sorted(doc)
        doc[keys[key_pick % len(keys)]] = value
        return HEADER + msgspec.msgpack.encode(doc)

    wrong_field = st.builds(retyped, valid, st.integers(0, 64), _wrong_value())
    unknown_tag = st.builds(lambda name, doc: HEADER + msgspec.msgpack.encode(
        {**doc, "type": name}), st.text(max_size=16), st.dictionaries(
        st.text(max_size=8), _wrong_value(), max_size=4))
    versions = st.builds(lambda v, body: MAGIC + bytes([v]) + body,
                         st.integers(0, 255).filter(lambda v: v != HEADER[4]),
                         encoded.map(lambda b: b[len(HEADER):]))
    foreign = [st.one_of([struct_strategy(t) for t in c.types]).map(c.encode) for c in others]
    garbage = st.one_of(st.binary(max_size=256), st.binary(max_size=32).map(lambda b: HEADER + b))
    return st.one_of(encoded, mutated, wrong_field, unknown_tag, versions, garbage, *foreign)


def json_bodies(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """HTTP request bodies: ``valid`` with keys dropped, added or given wrong values,
    other JSON documents, and bytes that are not JSON at all."""
    import json

    def edit(drop: list[int], add: dict[str, Any], change: list[tuple[int, Any]]) -> bytes:
        doc = dict(valid)
        keys = sorted(doc)
        for i in drop:
            doc.pop(keys[i % len(keys)], None)
        for i, value in change:
            doc[keys[i % len(keys)]] = value
        doc.update(add)
        return json.dumps(doc, default=repr).encode()

    json_value = st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                  st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=32)),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                      max_size=4),
        max_leaves=10)
    edited = st.builds(edit, st.lists(st.integers(0, 32), max_size=3),
                       st.dictionaries(st.sampled_from(
                           ["kv_transfer_params", "stream", "n", "logprobs", "prompt",
                            "max_tokens", "do_virtual", "extra", "stream_options"]), json_value,
                           max_size=3),
                       st.lists(st.tuples(st.integers(0, 32), json_value), max_size=3))
    other_json = json_value.map(lambda v: json.dumps(v).encode())
    junk = st.binary(max_size=512)
    return st.one_of(edited, edited, other_json, junk)


# ---------------------------------------------------------------- the listening sockets
def listening_codecs() -> dict[str, Any]:
    """The codec of every socket an engine listens on, by the name its probes use."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import CODEC, LAYERWISE_CODEC
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.lookup import LOOKUP_CODEC
    from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.protocol import (
        make_codec,
    )

    return {"p2p_side_channel": CODEC, "layerwise_side_channel": LAYERWISE_CODEC,
            "pool_lookup": LOOKUP_CODEC, "offload_metadata": make_codec()}


def listening_multi_config(engine_id: str, *, lease_ttl_s: float) -> dict[str, Any]:
    """A ``MultiConnector`` config with every listening connector in one engine (P's side
    channel with ``lease_ttl_s``, D's layerwise side channel, the pool's lookup server, the
    offload metadata server)."""
    from vllm_ascend.distributed.kv_transfer.core.net import free_port

    return {"kv_connector": "MultiConnector", "kv_role": "kv_both", "engine_id": engine_id,
            "kv_connector_extra_config": {"connectors": [
                {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer",
                 "kv_port": free_port(),
                 "kv_connector_extra_config": {"lease_ttl_s": lease_ttl_s}},
                {"kv_connector": "MooncakeLayerwiseConnector", "kv_role": "kv_consumer",
                 "kv_port": free_port(), "kv_connector_extra_config": {}},
                {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"backend": "local", "local_pool_size": "64MB"}},
                {"kv_connector": "CPUOffloadingConnector", "kv_role": "kv_both",
                 "kv_connector_extra_config": {"cpu_swap_space": "64MB"}},
            ]}}
