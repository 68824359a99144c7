# SPDX-License-Identifier: Apache-2.0
"""Section of ``bench auth``: control-plane round trips with and without the deployment key."""

from __future__ import annotations

import logging
from typing import Any

from ._common import Images, Section, fmt, md_table, num

logger = logging.getLogger(__name__)


def section_auth(d: dict[str, Any], images: Images) -> str:
    """Body of the section."""
    del images
    return (f"{d.get('description', '')}. Keyed / unkeyed messages per second: "
            f"{fmt(num(d.get('ratio')))}; the key adds {fmt(num(d.get('added_p50_us')))} us "
            f"to the median round trip; sealing and opening one frame takes "
            f"{fmt(num(d.get('envelope_us')))} us.\n\n"
            + md_table(d.get("results", []), ["mode", "msgs_per_s", "p50_us", "p99_us"],
                       ["deployment key", "messages/s", "p50 us", "p99 us"]))


SECTION = Section("Control plane with and without the deployment key (`bench auth`)",
                  "issue 19", 80, section_auth)
