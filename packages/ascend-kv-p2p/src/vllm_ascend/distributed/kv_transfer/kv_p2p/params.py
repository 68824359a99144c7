# SPDX-License-Identifier: Apache-2.0
"""``kv_transfer_params`` of the pull connector, parsed and checked.

Keys and meaning are those of vLLM-Ascend's ``MooncakeConnectorV1`` (see
DESIGN.md §3). P returns them from ``request_finished``; the proxy hands
them to D unchanged. Anything malformed is a :class:`KVParamsError` naming
the key and the value, and fails that one request only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import KVParamsError

#: Keys P writes for D (``request_finished``); D reads the same.
REMOTE_KEYS = ("remote_block_ids", "remote_engine_id", "remote_host", "remote_port",
               "remote_request_id")


@dataclass(frozen=True)
class RemotePrefill:
    """What D needs to pull one request's KV from P."""

    engine_id: str
    host: str
    port: int
    request_id: str
    block_ids: list[int]
    tp_size: int
    pcp_size: int
    dcp_size: int

    def endpoint_key(self) -> tuple[str, int]:
        """``(host, base side-channel port)`` of the P instance."""
        return (self.host, self.port)


def wants_remote_prefill(params: Any) -> bool:
    """True when a request asks D to load its prompt's KV from P."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_prefill"))


def wants_remote_decode(params: Any) -> bool:
    """True when P should hold a request's KV for a D instance."""
    return isinstance(params, Mapping) and bool(params.get("do_remote_decode"))


def _int(params: Mapping[str, Any], key: str, *, default: int | None = None,
         minimum: int = 0, maximum: int | None = None) -> int:
    value = params.get(key, default)
    if value is None:
        raise KVParamsError(f"kv_transfer_params: {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVParamsError(f"kv_transfer_params: {key!r} must be an integer, got {value!r} "
                            f"({type(value).__name__})")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"[{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise KVParamsError(f"kv_transfer_params: {key!r} must be {bound}, got {value}")
    return value


def _str(params: Mapping[str, Any], key: str) -> str:
    value = params.get(key)
    if value is None:
        raise KVParamsError(f"kv_transfer_params: {key!r} is missing")
    if not isinstance(value, str) or not value:
        raise KVParamsError(f"kv_transfer_params: {key!r} must be a non-empty string, got "
                            f"{value!r} ({type(value).__name__})")
    return value


def parse_remote_prefill(params: Any, *, prompt_len: int, block_size: int) -> RemotePrefill:
    """Check D-side ``kv_transfer_params`` against the request's prompt.

    Args:
        params: the request's ``kv_transfer_params``.
        prompt_len: tokens in the prompt.
        block_size: tokens per block (equal on P and D; the handshake checks it).

    Raises:
        KVParamsError: a key is missing or of the wrong type, a block id is negative or
            not an int, or the block list does not have exactly the blocks the prompt needs.
    """
    if not isinstance(params, Mapping):
        raise KVParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list):
        raise KVParamsError(f"kv_transfer_params: 'remote_block_ids' must be a list of block "
                            f"ids, got {blocks!r} ({type(blocks).__name__})")
    for b in blocks:
        if isinstance(b, bool) or not isinstance(b, int) or b < 0 or b >= 1 << 40:
            raise KVParamsError(f"kv_transfer_params: 'remote_block_ids' holds {b!r}; block ids "
                                "are non-negative integers")
    needed = math.ceil(prompt_len / block_size)
    if len(blocks) != needed:
        raise KVParamsError(
            f"kv_transfer_params: 'remote_block_ids' has {len(blocks)} blocks but the "
            f"{prompt_len}-token prompt needs {needed} (block size {block_size})")
    if len(set(blocks)) != len(blocks):
        raise KVParamsError("kv_transfer_params: 'remote_block_ids' repeats a block id")
    tp = params.get("remote_tp_size", params.get("remote_ptp_size", 1))
    return RemotePrefill(
        engine_id=_str(params, "remote_engine_id"),
        host=_str(params, "remote_host"),
        port=_int(params, "remote_port", minimum=1, maximum=65535),
        request_id=_str(params, "remote_request_id"),
        block_ids=list(blocks),
        tp_size=_int({"remote_tp_size": tp}, "remote_tp_size", minimum=1, maximum=4096),
        pcp_size=_int(params, "remote_pcp_size", default=1, minimum=1, maximum=1),
        dcp_size=_int(params, "remote_dcp_size", default=1, minimum=1, maximum=1),
    )


def params_for_decode(*, block_ids: list[int], engine_id: str, host: str, port: int,
                      request_id: str, tp_size: int, last_token_id: int | None,
                      num_prompt_blocks: int) -> dict[str, Any]:
    """The ``kv_transfer_params`` P returns for D (upstream keys, plus ``remote_tp_size``)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": request_id,
        "remote_tp_size": tp_size,
        "remote_ptp_size": tp_size,
        "remote_pcp_size": 1,
        "remote_dcp_size": 1,
        "last_token_id": last_token_id,
        "num_prompt_blocks": num_prompt_blocks,
        "remote_multi_nodes_meta_mapping": {"0": {"host": host, "engine_id": engine_id}},
    }
