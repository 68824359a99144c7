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


@dataclass(frozen=True)
class _Inner(ConfigSection):
    a: int = option(1, doc="a")
    b: float = option(0.5, doc="b")


@dataclass(frozen=True)
class _Outer(ConfigSection):
    plain: _Inner = option(default_factory=_Inner, doc="class defaults")
    tuned: _Inner = option(default_factory=lambda: _Inner(a=7, b=2.5), doc="its own defaults")


def test_a_nested_section_takes_the_defaults_of_its_field() -> None:
    """One section type under two keys: the keys left out take each field's own default,
    in what is parsed and in what the reference shows."""
    s = _Outer.from_dict({"plain": {"b": 9.0}, "tuned": {"b": 9.0}})
    assert s.plain == _Inner(a=1, b=9.0)
    assert s.tuned == _Inner(a=7, b=9.0)
    assert _Outer.from_dict({}).tuned == _Inner(a=7, b=2.5)
    docs = {d.key: d.default for d in _Outer.describe()}
    assert docs["plain.a"] == "1" and docs["tuned.a"] == "7" and docs["tuned.b"] == "2.5"
    with pytest.raises(ConfigError, match=r"tuned: a: expected an integer"):
        _Outer.from_dict({"tuned": {"a": "x"}})
