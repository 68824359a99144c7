# SPDX-License-Identifier: Apache-2.0
"""Upstream's module path of ``MooncakeBackend``; it lives in :mod:`.mooncake_store`.

vLLM-Ascend's wheel ships a file at this path too; installed after ours, its
copy replaces this one, and the pool keeps using :mod:`.mooncake_store`.
"""

from __future__ import annotations

from .mooncake_store import (
    MOONCAKE_ERRORS,
    RC_INVALID_PARAMS,
    UNAVAILABLE_RCS,
    MooncakeBackend,
    _convert_to_bytes,
    _parse_global_segment_size,
    _probe_master,
    describe_mooncake_rc,
)

__all__ = ["MOONCAKE_ERRORS", "RC_INVALID_PARAMS", "UNAVAILABLE_RCS", "MooncakeBackend",
           "_convert_to_bytes", "_parse_global_segment_size", "_probe_master",
           "describe_mooncake_rc"]
