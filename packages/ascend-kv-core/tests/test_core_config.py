# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.core.config import (
    ConfigSection,
    format_size,
    option,
    parse_size,
)
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError


@pytest.mark.parametrize(("text", "expected"), [
    ("1GB", 1 << 30), ("1gb", 1 << 30), (" 1.5 GB ", 3 << 29), ("512MB", 512 << 20),
    ("64kb", 64 << 10), ("4096", 4096), ("10b", 10), ("0", 0), (".5mb", 1 << 19),
    (1024, 1024), (2.0, 2),
])
def test_parse_size_accepts(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "1 TB", "1.2.3GB", "-1GB", "one", "1e3", True, -5,
                                 1.5, None, [1], float("nan")])
def test_parse_size_rejects_with_the_value_in_the_message(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(bad, key="global_segment_size", source="mooncake.json")
    msg = str(info.value)
    assert "global_segment_size" in msg and "mooncake.json" in msg
    assert repr(bad) in msg or str(bad) in msg


@given(st.integers(min_value=0, max_value=1 << 45))
def test_format_then_parse_is_close(n: int) -> None:
    # format_size rounds to two decimals; reading it back lands within 1 %.
    back = parse_size(format_size(n))
    assert abs(back - n) <= max(n * 0.01, 0)


@dataclass(frozen=True)
class _Section(ConfigSection):
    size: int = option("1GB", doc="a size", size=True)
    port: int = option(0, doc="a port", deprecated_aliases=("old_port",), minimum=0, maximum=65535)
    name: str = option(doc="required name")


def test_sizes_aliases_required(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        s = _Section.from_dict({"size": "2 MB", "old_port": 5, "name": "x"})
    assert s.size == 2 << 20 and s.port == 5 and "deprecated" in caplog.text
    with pytest.raises(ConfigError, match="required key 'name' is missing"):
        _Section.from_dict({})
    with pytest.raises(ConfigError, match="must be <= 65535"):
        _Section.from_dict({"name": "x", "port": 70000})
    docs = {d.key: d for d in _Section.describe()}
    assert docs["size"].default == "1GB" and docs["name"].default == "(required)"
    assert docs["port"].deprecated_aliases == ("old_port",)


def test_non_mapping_section_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        _Section.from_dict(["name"])  # type: ignore[arg-type]
