# SPDX-License-Identifier: Apache-2.0
"""The control-plane wire format: versioned, size-limited msgspec messages.

Every control message that crosses a socket is a :class:`Message` subclass
(a tagged ``msgspec.Struct``) encoded as MessagePack behind a 5-byte header
(``b"VAKV"`` and a version byte). A :class:`Codec` knows the set of message
types one endpoint accepts; anything else (wrong magic, newer version,
oversize, garbage, a field of the wrong type, a pickle) is a
:class:`~vllm_ascend.distributed.kv_transfer.core.errors.WireFormatError`,
never an exception from deep inside a decoder and never code execution:
nothing here unpickles.
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from typing import Any, Generic, TypeVar

import msgspec

from .auth import AUTH_MAGIC
from .errors import WireFormatError

MAGIC = b"VAKV"
WIRE_VERSION = 1
HEADER = MAGIC + bytes([WIRE_VERSION])
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20


class Message(msgspec.Struct, tag=True, kw_only=True):
    """Base of every control message; the tag is the class name."""


class Ack(Message):
    """Positive answer with no payload."""


class ErrorReply(Message):
    """Negative answer: ``code`` is machine-readable, ``message`` for humans."""

    code: str
    message: str


class Ping(Message):
    """Liveness probe; answered with :class:`Pong`."""


class Pong(Message):
    """Answer to :class:`Ping`."""

    name: str = ""


M = TypeVar("M", bound=Message)

#: Replies every endpoint may send whatever its protocol.
COMMON_TYPES: tuple[type[Message], ...] = (Ack, ErrorReply, Ping, Pong)


class Codec(Generic[M]):
    """Encoder/decoder for one protocol (a fixed set of message types).

    Args:
        types: the message classes this endpoint accepts; :data:`COMMON_TYPES`
            are always added.
        max_size: largest encoded message accepted or produced, in bytes.
    """

    def __init__(self, types: Iterable[type[Message]],
                 *, max_size: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        all_types = tuple(dict.fromkeys((*types, *COMMON_TYPES)))
        self.types = all_types
        self.max_size = max_size
        union: Any = typing.Union[all_types]  # noqa: UP007
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(union)

    def encode(self, msg: Message) -> bytes:
        """Encode ``msg``; raises :class:`WireFormatError` if it is too large or unknown."""
        if not isinstance(msg, self.types):
            raise WireFormatError(f"message type {type(msg).__name__} is not part of this "
                                  f"protocol ({', '.join(t.__name__ for t in self.types)})")
        payload = HEADER + self._encoder.encode(msg)
        if len(payload) > self.max_size:
            raise WireFormatError(f"{type(msg).__name__} is {len(payload)} bytes, over the "
                                  f"{self.max_size}-byte limit")
        return payload

    def decode(self, data: bytes | bytearray | memoryview) -> M:
        """Decode bytes received from a peer.

        Raises:
            WireFormatError: the bytes are not a valid message of this protocol.
        """
        view = memoryview(data)
        if len(view) > self.max_size:
            raise WireFormatError(f"message of {len(view)} bytes is over the "
                                  f"{self.max_size}-byte limit")
        if bytes(view[:4]) == AUTH_MAGIC:
            raise WireFormatError("not a vllm-ascend-kv message this side can read: an "
                                  "authenticated frame (deployment-key envelope), but this "
                                  "side has no key configured")
        if len(view) < len(HEADER) or bytes(view[:4]) != MAGIC:
            head = bytes(view[:8])
            raise WireFormatError(f"not a vllm-ascend-kv message (starts with {head!r})")
        version = view[4]
        if version != WIRE_VERSION:
            raise WireFormatError(f"wire version {version} is not supported "
                                  f"(this side speaks version {WIRE_VERSION})")
        try:
            return typing.cast(M, self._decoder.decode(view[len(HEADER):]))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireFormatError(f"malformed message: {exc}") from exc
