# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.kv_p2p.errors import KVParamsError
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import (
    params_for_decode,
    parse_remote_prefill,
    wants_remote_decode,
    wants_remote_prefill,
)

GOOD = params_for_decode(block_ids=[4, 9, 2], engine_id="p0", host="127.0.0.1", port=20000,
                         request_id="req-1", tp_size=2, last_token_id=17, num_prompt_blocks=3)


def test_roundtrip_of_what_p_returns() -> None:
    r = parse_remote_prefill(GOOD, prompt_len=70, block_size=32)
    assert (r.engine_id, r.host, r.port, r.request_id, r.block_ids, r.tp_size) == (
        "p0", "127.0.0.1", 20000, "req-1", [4, 9, 2], 2)
    assert wants_remote_prefill(GOOD) and not wants_remote_decode(GOOD)
    assert not wants_remote_prefill(None) and not wants_remote_prefill({})
    assert not wants_remote_prefill("do_remote_prefill")
    # upstream spelling of the TP size
    legacy = {k: v for k, v in GOOD.items() if k != "remote_tp_size"}
    assert parse_remote_prefill(legacy, prompt_len=70, block_size=32).tp_size == 2


@pytest.mark.parametrize(("change", "needle"), [
    ({"remote_block_ids": None}, "'remote_block_ids' must be a list"),
    ({"remote_block_ids": "1,2,3"}, "'remote_block_ids' must be a list"),
    ({"remote_block_ids": [1, -2, 3]}, "holds -2"),
    ({"remote_block_ids": [1, 2.5, 3]}, "holds 2.5"),
    ({"remote_block_ids": [1, True, 3]}, "holds True"),
    ({"remote_block_ids": [1, 2, 3, 4]}, "has 4 blocks but the 70-token prompt needs 3"),
    ({"remote_block_ids": [1, 2]}, "has 2 blocks but the 70-token prompt needs 3"),
    ({"remote_block_ids": [1, 1, 2]}, "repeats a block id"),
    ({"remote_block_ids": [1, 2, 1 << 50]}, "holds"),
    ({"remote_engine_id": None}, "'remote_engine_id' is missing"),
    ({"remote_engine_id": 5}, "'remote_engine_id' must be a non-empty string, got 5"),
    ({"remote_host": ""}, "'remote_host' must be a non-empty string"),
    ({"remote_port": "20000"}, "'remote_port' must be an integer, got '20000'"),
    ({"remote_port": 70000}, "'remote_port' must be [1, 65535], got 70000"),
    ({"remote_request_id": ["x"]}, "'remote_request_id' must be a non-empty string"),
    ({"remote_tp_size": 0}, "'remote_tp_size' must be [1, 4096], got 0"),
    ({"remote_pcp_size": 2}, "'remote_pcp_size' must be [1, 1], got 2"),
])
def test_malformed_params_name_key_and_value(change: dict[str, Any], needle: str) -> None:
    bad = {**GOOD, **change}
    with pytest.raises(KVParamsError) as info:
        parse_remote_prefill(bad, prompt_len=70, block_size=32)
    assert needle in str(info.value)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(), c,
                                                                               max_size=4),
                           max_leaves=10)


@given(st.dictionaries(st.sampled_from(list(GOOD)), json_values, max_size=6),
       st.integers(0, 4000))
def test_any_mutation_is_accepted_or_a_kvparamserror(mut: dict[str, Any], prompt_len: int) -> None:
    params = copy.deepcopy(GOOD)
    params.update(mut)
    try:
        r = parse_remote_prefill(params, prompt_len=prompt_len, block_size=32)
    except KVParamsError:
        return
    assert len(r.block_ids) == -(-prompt_len // 32)
    assert all(isinstance(b, int) and b >= 0 for b in r.block_ids)
