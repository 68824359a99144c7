# SPDX-License-Identifier: Apache-2.0
"""``kv_transfer_params`` of the pull connector, parsed and checked.

Keys and meaning are those of vLLM-Ascend's ``MooncakeConnectorV1`` (see
DESIGN.md §3). P returns them from ``request_finished``; the proxy hands
them to D unchanged. Anything malformed is a :class:`KVParamsError` naming
the key and the value, and fails that one request only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .errors import KVParamsError
from .rank_hosts import MULTI_NODES_KEY, multi_nodes_mapping, parse_rank_hosts

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
    #: P's capability for this request (``remote_claim_token``); ``""`` from a P that
    #: issues none
    token: str = ""
    #: where each P rank listens (``remote_multi_nodes_meta_mapping``); a rank it does not
    #: name is at ``host``
    rank_hosts: dict[int, str] = field(default_factory=dict)
    #: P's engine start (``remote_instance``, :func:`engine_instance`; ``""``: not told)
    instance: str = ""
    #: P's ``time.time()`` when it began holding the blocks (``remote_held_at``), and how
    #: long it keeps them at least from then, D's ``Done`` or not (``remote_hold_s``; 0:
    #: no such promise): D's read window (:mod:`.pull.contract`, the read window)
    held_at: float = 0.0
    hold_s: float = 0.0
    #: P's MAC over the request's identity and window (``remote_window_tag``,
    #: :func:`~.pull.contract.window_tag`): params changed on the way are claimed
    window_tag: str = ""
    #: under vLLM's hybrid KV cache manager, each KV cache group's run in ``block_ids``:
    #: ``(first position held, blocks held)`` (``remote_block_groups``, :mod:`.pull.groups`);
    #: empty: one group, ``block_ids`` is the whole prompt's
    block_groups: tuple[tuple[int, int], ...] = ()

    def endpoint_key(self) -> tuple[str, int]:
        """``(host, base side-channel port)`` of the P instance."""
        return (self.host, self.port)

    def host_of(self, p_rank: int) -> str:
        """Where P rank ``p_rank``'s side channel listens."""
        return self.rank_hosts.get(p_rank, self.host)


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


def _float(params: Mapping[str, Any], key: str, *, maximum: float) -> float:
    value = params.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            0.0 <= value <= maximum):
        raise KVParamsError(f"kv_transfer_params: {key!r} must be a number in [0, {maximum:g}], "
                            f"got {value!r} ({type(value).__name__})")
    return float(value)


def engine_instance(vllm_config: Any, engine_id: str) -> str:
    """This start of the engine: its ``engine_id`` and vLLM's ``instance_id`` (set when
    the config is made, shared by the scheduler and the workers), ``""`` when the config
    has none. A P restarted at the same address has another."""
    instance = getattr(vllm_config, "instance_id", "")
    return f"{engine_id}/{instance}" if isinstance(instance, str) and instance else ""


def _prompt_blocks(params: Mapping[str, Any], prompt_len: int, block_size: int
                   ) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """``remote_block_ids``: distinct non-negative ints, exactly the prompt's blocks; or, with
    ``remote_block_groups`` (several KV cache groups), every group's run of them.

    Raises:
        KVParamsError: naming the key and what is wrong with it.
    """
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list):
        raise KVParamsError(f"kv_transfer_params: 'remote_block_ids' must be a list of block "
                            f"ids, got {blocks!r} ({type(blocks).__name__})")
    for b in blocks:
        if isinstance(b, bool) or not isinstance(b, int) or b < 0 or b >= 1 << 40:
            raise KVParamsError(f"kv_transfer_params: 'remote_block_ids' holds {b!r}; block ids "
                                "are non-negative integers")
    needed = math.ceil(prompt_len / block_size)
    # a P with a sliding window computes all but the prompt's last token (D computes it)
    groups = _block_groups(params, num_blocks=len(blocks),
                           prompt_blocks={needed, math.ceil((prompt_len - 1) / block_size)})
    if not groups and len(blocks) != needed:
        raise KVParamsError(
            f"kv_transfer_params: 'remote_block_ids' has {len(blocks)} blocks but the "
            f"{prompt_len}-token prompt needs {needed} (block size {block_size})")
    if len(set(blocks)) != len(blocks):
        raise KVParamsError("kv_transfer_params: 'remote_block_ids' repeats a block id")
    return blocks, groups


def check_runs(runs: Sequence[tuple[int, int]], *, num_blocks: int,
               prompt_blocks: set[int]) -> None:
    """D's check of P's ``remote_block_groups``: no run goes past the prompt's blocks (a state
    group counts blocks of its own size: D's pairing checks each position) and the runs add
    up to ``remote_block_ids``.

    Raises:
        ValueError: naming what does not add up.
    """
    total = 0
    for g, (first, count) in enumerate(runs):
        if first < 0 or count < 0 or first + count > max(prompt_blocks):
            raise ValueError(f"group {g}'s run [{first}, {count}] goes past the prompt's "
                             f"{max(prompt_blocks)} blocks")
        total += count
    if total != num_blocks:
        raise ValueError(f"the groups' runs cover {total} blocks but remote_block_ids has "
                         f"{num_blocks}")


def _block_groups(params: Mapping[str, Any], *, num_blocks: int, prompt_blocks: set[int]
                  ) -> tuple[tuple[int, int], ...]:
    raw = params.get("remote_block_groups")
    if raw is None:
        return ()
    if (not isinstance(raw, list) or not 1 < len(raw) <= 64
            or not all(isinstance(r, list) and len(r) == 2 for r in raw)
            or not all(isinstance(v, int) and not isinstance(v, bool) for r in raw for v in r)):
        raise KVParamsError("kv_transfer_params: 'remote_block_groups' must be a list of 2 to "
                            f"64 [first position, count] pairs, got {raw!r}"[:300])
    runs = tuple((int(r[0]), int(r[1])) for r in raw)
    try:
        check_runs(runs, num_blocks=num_blocks, prompt_blocks=prompt_blocks)
    except ValueError as exc:
        raise KVParamsError(f"kv_transfer_params: 'remote_block_groups': {exc}") from None
    return runs


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
    blocks, groups = _prompt_blocks(params, prompt_len, block_size)
    tp = params.get("remote_tp_size", params.get("remote_ptp_size", 1))
    token = params.get("remote_claim_token", "")
    if not isinstance(token, str) or len(token) > 256:
        raise KVParamsError(f"kv_transfer_params: 'remote_claim_token' must be a string of at "
                            f"most 256 characters, got a {type(token).__name__}")
    tp_size = _int({"remote_tp_size": tp}, "remote_tp_size", minimum=1, maximum=4096)
    instance, tag = params.get("remote_instance", ""), params.get("remote_window_tag", "")
    for key, value in (("remote_instance", instance), ("remote_window_tag", tag)):
        if not isinstance(value, str) or len(value) > 256:
            raise KVParamsError(f"kv_transfer_params: {key!r} must be a string of at most 256 "
                                f"characters, got a {type(value).__name__}")
    return RemotePrefill(
        engine_id=_str(params, "remote_engine_id"),
        host=_str(params, "remote_host"),
        port=_int(params, "remote_port", minimum=1, maximum=65535),
        request_id=_str(params, "remote_request_id"),
        block_ids=list(blocks),
        tp_size=tp_size,
        pcp_size=_int(params, "remote_pcp_size", default=1, minimum=1, maximum=1),
        dcp_size=_int(params, "remote_dcp_size", default=1, minimum=1, maximum=1),
        token=token,
        rank_hosts=parse_rank_hosts(params, tp_size=tp_size),
        instance=instance,
        held_at=_float(params, "remote_held_at", maximum=1e11),
        hold_s=_float(params, "remote_hold_s", maximum=3600.0),
        window_tag=tag,
        block_groups=groups,
    )


def params_for_decode(*, block_ids: list[int], engine_id: str, host: str, port: int,
                      request_id: str, tp_size: int, last_token_id: int | None,
                      num_prompt_blocks: int, claim_token: str = "",
                      rank_hosts: Mapping[int, str] | None = None,
                      window: Mapping[str, Any] | None = None,
                      block_groups: Sequence[tuple[int, int]] = ()) -> dict[str, Any]:
    """The ``kv_transfer_params`` P returns for D (upstream keys, plus ``remote_tp_size`` and
    ``remote_claim_token``, the request's capability, when P issued one, and the keys of
    its read window, ``window``: :func:`~.pull.contract.stamp`).

    ``remote_multi_nodes_meta_mapping`` names every rank's host (``rank_hosts``, as the
    workers published them); without them, rank 0 at ``host`` (upstream's one entry).
    ``remote_block_groups`` (several KV cache groups only): each group's run in
    ``remote_block_ids`` (:mod:`.pull.groups`)."""
    out: dict[str, Any] = {
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
        MULTI_NODES_KEY: multi_nodes_mapping(rank_hosts or {0: host}, engine_id),
    }
    if claim_token:
        out["remote_claim_token"] = claim_token
    if len(block_groups) > 1:
        out["remote_block_groups"] = [[int(a), int(b)] for a, b in block_groups]
    out.update(window or {})
    return out


# ---------------------------------------------------------------------------------------------
# MooncakeLayerwiseConnector (prefill pushes layer by layer)
#
# D receives ``{"do_remote_prefill": true, "metaserver": URL, "request_id": ID, "do_virtual":
# bool}`` from the proxy, allocates blocks and posts :func:`params_for_prefill` to the
# metaserver; the proxy hands that dict to P as its ``kv_transfer_params``.
# ---------------------------------------------------------------------------------------------


def wants_virtual(params: Any) -> bool:
    """True when a request asks for a virtual push (``do_virtual: true``).

    ``None`` params, a missing key, ``None`` or ``False`` all mean an ordinary request
    (upstream once raised on ``None`` params here).

    Raises:
        KVParamsError: ``do_virtual`` is present but not a boolean (``"false"`` would
            otherwise be taken for true).
    """
    if not isinstance(params, Mapping):
        return False
    value = params.get("do_virtual")
    if value is None or value is False:
        return False
    if value is True:
        return True
    raise KVParamsError(f"kv_transfer_params: 'do_virtual' must be true or false, got {value!r} "
                        f"({type(value).__name__})")


def metaserver_url(params: Mapping[str, Any]) -> str:
    """The proxy's metaserver URL of a layerwise request.

    Raises:
        KVParamsError: missing, not a string, or not an ``http(s)://`` URL.
    """
    from urllib.parse import urlsplit

    url = params.get("metaserver")
    if not isinstance(url, str) or not url:
        raise KVParamsError(f"kv_transfer_params: 'metaserver' must be the proxy's metaserver "
                            f"URL, got {url!r} ({type(url).__name__})")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise KVParamsError(f"kv_transfer_params: 'metaserver' must be an http:// or https:// "
                            f"URL, got {url!r}")
    return url


@dataclass(frozen=True)
class PushTarget:
    """P's view of the D instance a request's KV is pushed to."""

    engine_id: str
    host: str
    #: D's base side-channel port (worker ports follow :func:`.protocol.worker_port`)
    port: int
    #: D's request id (the key of D's pending load; P echoes it in every message)
    request_id: str
    #: D's blocks for the whole prompt, in token order
    block_ids: list[int]
    #: tokens D already holds (its own prefix-cache hit); P pushes from there on
    cached_tokens: int
    tp_size: int
    #: D's capability for this request (``remote_push_token``); ``""`` from a D that issued
    #: none (an older D)
    token: str = ""
    #: D ranks that live on another host than ``host`` (``remote_multi_nodes_meta_mapping``)
    rank_hosts: dict[int, str] = field(default_factory=dict)
    #: several KV cache groups (vLLM's hybrid KV cache manager): each group's run of D's
    #: blocks in ``block_ids``, ``(first position, count)`` (``remote_block_groups``); empty:
    #: one group, ``block_ids`` are the whole prompt's
    block_groups: tuple[tuple[int, int], ...] = ()

    def host_of(self, d_rank: int) -> str:
        """Where D rank ``d_rank``'s side channel listens."""
        return self.rank_hosts.get(d_rank, self.host)

    def d_block(self, group: int, position: int) -> int | None:
        """D's block at ``position`` of KV cache group ``group`` (``None``: D keeps none
        there: a window's block it freed, or past what it loads)."""
        if not self.block_groups:
            return self.block_ids[position] if 0 <= position < len(self.block_ids) else None
        offset = sum(count for _, count in self.block_groups[:group])
        first, count = self.block_groups[group]
        if not first <= position < first + count:
            return None
        return self.block_ids[offset + position - first]

    def pushed(self, first_position: int) -> list[tuple[int, int, int]]:
        """``(group, position, D's block)`` of every block P writes from ``first_position``
        (where D's own prefix hit ends): :func:`push_order`."""
        return push_order(self.block_ids, self.block_groups, first_position)


def push_order(block_ids: Sequence[int], block_groups: Sequence[tuple[int, int]],
               first_position: int) -> list[tuple[int, int, int]]:
    """``(group, position, block)`` of the blocks a layerwise push writes, in the order
    ``PushBegin`` names them and D waits in them: of one group, ``block_ids`` from
    ``first_position`` on; of several, each group's run (``block_groups``) from there.

    Args:
        block_ids: D's blocks (``remote_block_ids``).
        block_groups: each group's ``(first position, count)`` in them (empty: one group).
        first_position: the first block position P writes.
    """
    if not block_groups:
        return [(0, pos, int(block_ids[pos])) for pos in range(first_position, len(block_ids))]
    out: list[tuple[int, int, int]] = []
    offset = 0
    for g, (first, count) in enumerate(block_groups):
        for pos in range(max(first, first_position), first + count):
            out.append((g, pos, int(block_ids[offset + pos - first])))
        offset += count
    return out


def push_token(params: Any) -> str:
    """``remote_push_token`` of a layerwise request's params (``""`` when absent).

    Raises:
        KVParamsError: it is not a string of at most 256 characters.
    """
    token = params.get("remote_push_token", "") if isinstance(params, Mapping) else ""
    if not isinstance(token, str) or len(token) > 256:
        raise KVParamsError(f"kv_transfer_params: 'remote_push_token' must be a string of at "
                            f"most 256 characters, got a {type(token).__name__}")
    return token


class PushEndpoint(NamedTuple):
    """Where D waits for a layerwise push: enough to tell D that it failed."""

    host: str
    port: int
    request_id: str
    tp_size: int
    #: D's engine id (``remote_engine_id``; ``""`` where the params lack it): with a key,
    #: frames to D's side channel are bound to it
    engine_id: str = ""


def parse_push_endpoint(params: Any) -> PushEndpoint:
    """D's :class:`PushEndpoint` from a layerwise request's params.

    Raises:
        KVParamsError: a key is missing or of the wrong type.
    """
    if not isinstance(params, Mapping):
        raise KVParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    engine_id = params.get("remote_engine_id")
    return PushEndpoint(
        _str(params, "remote_host"), _int(params, "remote_port", minimum=1, maximum=65535),
        _str(params, "remote_request_id"),
        _int(params, "remote_tp_size", default=1, minimum=1, maximum=4096),
        engine_id if isinstance(engine_id, str) else "")


def parse_push_target(params: Any, *, prompt_len: int, block_size: int) -> PushTarget:
    """Check the P-side ``kv_transfer_params`` of a layerwise request (what D posted).

    Args:
        params: the request's ``kv_transfer_params``.
        prompt_len: tokens in the prompt.
        block_size: tokens per block on P (D's must be equal; the handshake checks it too).

    Raises:
        KVParamsError: a key is missing or of the wrong type, the block list does not cover
            exactly the prompt, or ``remote_cached_tokens`` is not a block-aligned count
            below the prompt length.
    """
    host, port, request_id, tp_size, _engine = parse_push_endpoint(params)
    blocks, groups = _prompt_blocks(params, prompt_len, block_size)
    remote_bs = params.get("remote_block_size", block_size)
    if remote_bs != block_size:
        raise KVParamsError(f"kv_transfer_params: 'remote_block_size' is {remote_bs!r} but this "
                            f"instance uses block size {block_size}")
    cached = _int(params, "remote_cached_tokens", default=0, minimum=0,
                  maximum=max(prompt_len - 1, 0))
    if cached % block_size:
        raise KVParamsError(f"kv_transfer_params: 'remote_cached_tokens' {cached} is not a "
                            f"multiple of the block size {block_size}")
    _int(params, "remote_pcp_size", default=1, minimum=1, maximum=1)
    _int(params, "remote_dcp_size", default=1, minimum=1, maximum=1)
    return PushTarget(engine_id=_str(params, "remote_engine_id"), host=host, port=port,
                      request_id=request_id, block_ids=list(blocks), cached_tokens=cached,
                      tp_size=tp_size, token=push_token(params),
                      rank_hosts=parse_rank_hosts(params, tp_size=tp_size),
                      block_groups=groups)


def params_for_prefill(*, proxy_request_id: str, block_ids: list[int], block_size: int,
                       engine_id: str, host: str, port: int, request_id: str, tp_size: int,
                       cached_tokens: int, push_token: str = "",
                       rank_hosts: Mapping[int, str] | None = None,
                       block_groups: Sequence[tuple[int, int]] = ()) -> dict[str, Any]:
    """What D posts to the metaserver; the proxy hands it to P as ``kv_transfer_params``.

    The keys are upstream's, plus ``remote_request_id`` (D's own request id, which P echoes
    so that D never has to guess it from the proxy's) and ``remote_push_token`` (the
    request's capability: P presents it with every ``PushBegin`` and ``PushDone``).
    """
    out: dict[str, Any] = {
        "request_id": proxy_request_id,
        "token_ids": [],
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": block_ids,
        "remote_block_size": block_size,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": request_id,
        "remote_tp_size": tp_size,
        "remote_pcp_size": 1,
        "remote_dcp_size": 1,
        "remote_cached_tokens": cached_tokens,
    }
    if push_token:
        out["remote_push_token"] = push_token
    if rank_hosts:
        out[MULTI_NODES_KEY] = multi_nodes_mapping(rank_hosts, engine_id)
    if len(block_groups) > 1:
        out["remote_block_groups"] = [[int(a), int(b)] for a, b in block_groups]
    return out
