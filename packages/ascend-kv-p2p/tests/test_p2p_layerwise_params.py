# SPDX-License-Identifier: Apache-2.0
"""kv_transfer_params of the layerwise connector: virtual flag, metaserver URL, what D posts."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.kv_p2p.errors import KVParamsError
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import (
    metaserver_url,
    params_for_prefill,
    parse_push_endpoint,
    parse_push_target,
    wants_virtual,
)

BS = 32


def posted(n_blocks: int = 3, **change: Any) -> dict[str, Any]:
    p = params_for_prefill(proxy_request_id="proxy-1", block_ids=list(range(5, 5 + n_blocks)),
                           block_size=BS, engine_id="d0", host="127.0.0.1", port=21000,
                           request_id="d-req", tp_size=2, cached_tokens=0)
    p.update(change)
    return p


@pytest.mark.parametrize(("params", "virtual"), [
    (None, False), ({}, False), ({"do_virtual": None}, False), ({"do_virtual": False}, False),
    ({"do_remote_prefill": True}, False), ({"do_virtual": True}, True), ("x", False),
    ([("do_virtual", True)], False),
])
def test_virtual_flag(params: Any, virtual: bool) -> None:
    assert wants_virtual(params) is virtual


@pytest.mark.parametrize("value", ["true", "false", 1, 0, [], {}])
def test_virtual_flag_must_be_a_boolean(value: Any) -> None:
    with pytest.raises(KVParamsError, match="'do_virtual' must be true or false"):
        wants_virtual({"do_virtual": value})


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000/v1/metaserver",
                                 "https://proxy.example:443/v1/metaserver"])
def test_metaserver_url_ok(url: str) -> None:
    assert metaserver_url({"metaserver": url}) == url


@pytest.mark.parametrize("url", [None, "", 5, "127.0.0.1:8000/v1/metaserver", "ftp://x/y",
                                 "http:///nohost"])
def test_metaserver_url_bad(url: Any) -> None:
    with pytest.raises(KVParamsError, match="'metaserver'"):
        metaserver_url({"metaserver": url})


def test_what_d_posts_is_what_p_parses() -> None:
    p = posted(remote_cached_tokens=BS)
    assert p["do_remote_decode"] is True and p["do_remote_prefill"] is False
    t = parse_push_target(p, prompt_len=70, block_size=BS)
    assert (t.engine_id, t.host, t.port, t.request_id, t.block_ids, t.cached_tokens,
            t.tp_size) == ("d0", "127.0.0.1", 21000, "d-req", [5, 6, 7], BS, 2)
    assert parse_push_endpoint(p) == ("127.0.0.1", 21000, "d-req", 2, "d0")


@pytest.mark.parametrize(("change", "needle"), [
    ({"remote_block_ids": [1, 2]}, "has 2 blocks but the 70-token prompt needs 3"),
    ({"remote_block_ids": [1, 1, 2]}, "repeats a block id"),
    ({"remote_block_ids": [1, -1, 2]}, "holds -1"),
    ({"remote_block_ids": "1,2,3"}, "must be a list"),
    ({"remote_block_size": 16}, "'remote_block_size' is 16"),
    ({"remote_cached_tokens": 40}, "not a multiple of the block size"),
    ({"remote_cached_tokens": 96}, "'remote_cached_tokens' must be [0, 69]"),
    ({"remote_cached_tokens": -32}, "'remote_cached_tokens' must be"),
    ({"remote_port": "21000"}, "'remote_port' must be an integer"),
    ({"remote_host": ""}, "'remote_host' must be a non-empty string"),
    ({"remote_request_id": None}, "'remote_request_id' is missing"),
    ({"remote_engine_id": 3}, "'remote_engine_id' must be a non-empty string"),
    ({"remote_pcp_size": 2}, "'remote_pcp_size' must be [1, 1]"),
])
def test_bad_pushes_are_refused_with_the_key_and_value(change: dict[str, Any],
                                                       needle: str) -> None:
    with pytest.raises(KVParamsError) as err:
        parse_push_target(posted(**change), prompt_len=70, block_size=BS)
    assert needle in str(err.value)


@given(n_tokens=st.integers(1, 4000), cached_blocks=st.integers(0, 200),
       ids=st.lists(st.integers(0, 1 << 39), min_size=1, max_size=200, unique=True))
def test_roundtrip_for_any_prompt(n_tokens: int, cached_blocks: int, ids: list[int]) -> None:
    needed = -(-n_tokens // BS)
    blocks = (ids * (needed // len(ids) + 1))[:needed]
    if len(set(blocks)) != len(blocks):
        blocks = list(range(needed))
    cached = min(cached_blocks, (n_tokens - 1) // BS) * BS
    p = params_for_prefill(proxy_request_id="x", block_ids=blocks, block_size=BS,
                           engine_id="d", host="h", port=1, request_id="r", tp_size=1,
                           cached_tokens=cached)
    t = parse_push_target(p, prompt_len=n_tokens, block_size=BS)
    assert t.block_ids == blocks and t.cached_tokens == cached


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda kids: st.lists(kids, max_size=4)
                    | st.dictionaries(st.text(max_size=4), kids, max_size=4), max_leaves=10)


#: posted key -> the PushTarget field it becomes
TARGET_FIELDS = {"remote_engine_id": "engine_id", "remote_host": "host", "remote_port": "port",
                 "remote_request_id": "request_id", "remote_block_ids": "block_ids",
                 "remote_cached_tokens": "cached_tokens", "remote_tp_size": "tp_size"}


@given(key=st.sampled_from(sorted(posted())), value=JSON)
def test_any_bad_value_is_a_params_error_never_a_crash(key: str, value: Any) -> None:
    """Whatever a client or a broken D puts in any key: parsed, or a KVParamsError naming it."""
    base = parse_push_target(posted(), prompt_len=70, block_size=BS)
    try:
        got = parse_push_target(posted(**{key: value}), prompt_len=70, block_size=BS)
    except KVParamsError as err:
        assert repr(key) in str(err), (key, value, str(err))
    else:  # accepted: the target holds exactly what was posted
        field = TARGET_FIELDS.get(key)
        assert got == (dataclasses.replace(base, **{field: value}) if field else base)
    if value is None or isinstance(value, bool):
        assert wants_virtual({"do_virtual": value}) is (value is True)
    else:
        with pytest.raises(KVParamsError, match="'do_virtual' must be true or false"):
            wants_virtual({"do_virtual": value})
    try:
        url = metaserver_url({"metaserver": value})
    except KVParamsError as err:
        assert "'metaserver' must be" in str(err), (value, str(err))
    else:
        assert url == value and url.startswith(("http://", "https://"))
