# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.config import (
    DEFAULT_SWAP_SPACE_BYTES,
    CPUOffloadConfig,
)


def test_defaults() -> None:
    cfg = CPUOffloadConfig.from_dict(None)
    assert cfg.swap_space_bytes == DEFAULT_SWAP_SPACE_BYTES
    assert cfg.swap_in_threshold == 0
    assert cfg.save_decode_blocks and cfg.preallocate
    assert cfg.metadata_endpoint is None


@pytest.mark.parametrize(("data", "expected"), [
    ({"cpu_swap_space_gb": 2}, 2 << 30),
    ({"cpu_swap_space_gb": "0.5"}, 1 << 29),
    ({"cpu_swap_space_gb": 0.25}, 1 << 28),
    ({"cpu_swap_space": "512MB"}, 512 << 20),
    ({"cpu_swap_space": " 1.5 gb "}, 3 << 29),
    ({"cpu_swap_space": 4096}, 4096),
])
def test_swap_space_forms(data: dict[str, object], expected: int) -> None:
    assert CPUOffloadConfig.from_dict(data).swap_space_bytes == expected


@given(st.integers(min_value=1, max_value=1 << 44))
def test_size_string_and_bytes_agree(n: int) -> None:
    assert CPUOffloadConfig.from_dict({"cpu_swap_space": f"{n}b"}).swap_space_bytes == n
    assert CPUOffloadConfig.from_dict({"cpu_swap_space": n}).swap_space_bytes == n


@pytest.mark.parametrize(("data", "needle"), [
    ({"cpu_swap_space_gb": 1, "cpu_swap_space": "1GB"}, "not both"),
    ({"cpu_swap_space_gb": 0}, "must be positive, got 0"),
    ({"cpu_swap_space_gb": -1}, "must be >= 0.0, got -1.0"),
    ({"cpu_swap_space_gb": "lots"}, "cpu_swap_space_gb: expected a number, got 'lots'"),
    ({"cpu_swap_space_gb": float("inf")}, "must be finite"),
    ({"cpu_swap_space": "12 parsecs"}, "cannot parse '12 parsecs' as a size"),
    ({"cpu_swap_space": 0}, "must be positive, got 0"),
    ({"swap_in_threshold": -5}, "swap_in_threshold: must be >= 0, got -5"),
    ({"swap_in_threshold": "many"}, "swap_in_threshold: expected an integer, got 'many'"),
    ({"rpc_timeout_s": 0}, "rpc_timeout_s: must be >= 0.01"),
    ({"save_decode_blocks": "perhaps"}, "expected a bool"),
])
def test_bad_values_name_key_and_value(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        CPUOffloadConfig.from_dict(data, source="extra")
    assert needle in str(info.value)
    assert str(info.value).startswith("extra")


def test_unknown_key_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError, match="did you mean 'swap_in_threshold'"):
        CPUOffloadConfig.from_dict({"swap_in_treshold": 3}, strict=True)


def test_describe_lists_every_key() -> None:
    keys = {d.key for d in CPUOffloadConfig.describe()}
    assert {"cpu_swap_space_gb", "cpu_swap_space", "swap_in_threshold", "save_timeout_s",
            "metadata_endpoint"} <= keys
    docs = {d.key: d for d in CPUOffloadConfig.describe()}
    assert docs["cpu_swap_space"].type.startswith("size")
