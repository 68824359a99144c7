# SPDX-License-Identifier: Apache-2.0
"""Byte sizes written as ints or as strings like ``"1.5GB"``.

The rule (kept from vLLM-Ascend's Mooncake Store config): an ``int`` is a
number of bytes; a string is ``<number><unit>`` with ``unit`` one of
``gb``, ``mb``, ``kb``, ``b`` (1024-based, case-insensitive, spaces around
allowed, no unit meaning bytes). Anything else is a :class:`ConfigError`
naming the value.
"""

from __future__ import annotations

import math
import re

from ..errors import ConfigError

_UNITS = {"b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(gb|mb|kb|b)?\s*$")


def parse_size(value: object, *, key: str = "size", source: str = "config") -> int:
    """Parse a byte size.

    Args:
        value: an ``int`` (bytes), an integral ``float``, or a string such as
            ``"512MB"``, ``"1.5 gb"``, ``"4096"``.
        key: the configuration key, for the error message.
        source: where the value came from, for the error message.

    Returns:
        The size in bytes.

    Raises:
        ConfigError: if the value is negative, not a number, or has an unknown unit.
    """
    where = f"{source}: {key}"
    accepted = "an int number of bytes or a string like '512MB', '1.5GB', '64kb', '4096'"
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected {accepted}, got {value!r} (bool)",
                          key=key, value=value, source=source)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{where}: a size cannot be negative, got {value}",
                              key=key, value=value, source=source)
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or value != int(value):
            raise ConfigError(f"{where}: expected {accepted}, got {value!r}",
                              key=key, value=value, source=source)
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value.lower())
        if not match:
            raise ConfigError(f"{where}: cannot parse {value!r} as a size; expected {accepted}",
                              key=key, value=value, source=source)
        number, unit = match.group(1), match.group(2) or "b"
        try:
            result = int(float(number) * _UNITS[unit])
        except (ValueError, OverflowError) as exc:
            raise ConfigError(f"{where}: cannot parse {value!r} as a size: {exc}",
                              key=key, value=value, source=source) from exc
        return result
    raise ConfigError(f"{where}: expected {accepted}, got {value!r} ({type(value).__name__})",
                      key=key, value=value, source=source)


def format_size(num_bytes: int) -> str:
    """Render a byte count the way :func:`parse_size` reads it back (``"1.5GB"``)."""
    for unit, mult in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if num_bytes >= mult:
            text = f"{num_bytes / mult:.2f}".rstrip("0").rstrip(".")
            return f"{text}{unit}"
    return f"{num_bytes}B"
