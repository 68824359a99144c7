# SPDX-License-Identifier: Apache-2.0
"""Typed configuration of every connector's ``kv_connector_extra_config``.

The machinery (:class:`ConfigSection`, :func:`option`, :func:`parse_size`) lives
in ``base`` and ``sizes``; each connector family has its own module (``p2p``,
``pool``, ``offload``) so that packages can be read and changed independently.
"""

from __future__ import annotations

from .base import ConfigSection, OptionDoc, option
from .sizes import format_size, parse_size

__all__ = ["ConfigSection", "OptionDoc", "format_size", "option", "parse_size"]
