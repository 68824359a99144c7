# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import os
import pickle

import msgspec
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.core.errors import WireFormatError
from vllm_ascend.distributed.kv_transfer.core.wire import (
    HEADER,
    Ack,
    Codec,
    ErrorReply,
    Message,
)


class Hello(Message):
    engine_id: str
    block_ids: list[int]
    ratio: float = 1.0


class Bye(Message):
    reason: str = ""


CODEC: Codec[Message] = Codec([Hello, Bye], max_size=1 << 16)


def test_roundtrip_all_types() -> None:
    for msg in (Hello(engine_id="p0", block_ids=[1, 2, 3]), Bye(), Ack(),
                ErrorReply(code="x", message="y")):
        assert CODEC.decode(CODEC.encode(msg)) == msg


@given(st.binary(max_size=4096))
def test_random_bytes_are_a_typed_error(data: bytes) -> None:
    assume(data[:4] != HEADER[:4])  # behind the magic: the next test and the version test
    with pytest.raises(WireFormatError, match="not a vllm-ascend-kv message"):
        CODEC.decode(data)


@given(st.binary(max_size=512))
def test_random_payload_behind_valid_header_is_a_typed_error(data: bytes) -> None:
    try:
        msg = CODEC.decode(HEADER + data)
    except WireFormatError:
        return
    assert isinstance(msg, CODEC.types)


def test_wrong_field_types_and_unknown_tags_are_rejected() -> None:
    raw = msgspec.msgpack.encode({"type": "Hello", "engine_id": 5, "block_ids": "no"})
    with pytest.raises(WireFormatError, match="malformed"):
        CODEC.decode(HEADER + raw)
    raw = msgspec.msgpack.encode({"type": "Evil", "x": 1})
    with pytest.raises(WireFormatError):
        CODEC.decode(HEADER + raw)


class _Boom:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch /tmp/vakv-pickle-pwned",))


def test_pickle_payload_is_never_executed(tmp_path: object) -> None:
    marker = "/tmp/vakv-pickle-pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    payload = pickle.dumps(_Boom())
    for data in (payload, HEADER + payload):
        with pytest.raises(WireFormatError):
            CODEC.decode(data)
    assert not os.path.exists(marker)


def test_size_limit_and_version() -> None:
    big = Hello(engine_id="x" * (1 << 17), block_ids=[])
    with pytest.raises(WireFormatError, match="over the"):
        CODEC.encode(big)
    with pytest.raises(WireFormatError, match="over the"):
        CODEC.decode(b"VAKV\x01" + b"\0" * (1 << 16))
    ok = CODEC.encode(Bye())
    with pytest.raises(WireFormatError, match="version 9"):
        CODEC.decode(ok[:4] + b"\x09" + ok[5:])
    with pytest.raises(WireFormatError, match="not part of this protocol"):
        Codec([Bye]).encode(Hello(engine_id="", block_ids=[]))
