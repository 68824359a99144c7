# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv doctor`` checks of the KV pool.

Entry points ``vllm_ascend_kv.doctor`` ``AscendStoreConnector`` and
``MooncakeConnectorStoreV1`` (its deprecated alias, same section) name
:func:`check`: the section is validated, then the
backend: ``memcache`` needs ``memcache_hybrid``; ``mooncake`` needs the
transfer engine, a Store config (inline, ``--mooncake-config`` or
``MOONCAKE_CONFIG_PATH``), a reachable master and metadata server.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

#: The config section of the pool (the alias has none of its own).
SECTION = "AscendStoreConnector"


def check(doctor: Any, connector: str, extra: Any, where: str, cfg: dict[str, Any]) -> None:
    """The checks of the pool connector (a ``vllm_ascend_kv.doctor`` entry point).

    Args:
        doctor: the running ``Doctor`` of ``core.tooling.doctor``.
        connector: ``kv_connector`` of the checked config.
        extra: its ``kv_connector_extra_config``.
        where: where ``extra`` sits in the config (for messages).
        cfg: the whole ``--kv-transfer-config``.
    """
    section = doctor.validate_section(connector, extra, where, section=SECTION)
    if section is None:
        return
    doctor.check_platform(needs_mooncake=getattr(section, "backend", None) == "mooncake")
    check_backend(doctor, section)



def check_backend(doctor: Any, section: Any) -> None:
    """What the pool's backend needs installed and reachable."""
    from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError

    from ..config import MOONCAKE_CONFIG_ENV, MooncakeStoreConfig

    backend = getattr(section, "backend", "local")
    if backend == "memcache":
        if importlib.util.find_spec("memcache_hybrid") is None:
            doctor.fail("Memcache backend", "memcache_hybrid is not installed",
                        "pip install 'ascend-kv-pool[memcache]'")
        else:
            doctor.ok("Memcache backend", "memcache_hybrid importable")
        return
    if backend != "mooncake":
        doctor.ok("pool backend", f"{backend} (embedded, nothing to reach)")
        return
    store = getattr(section, "mooncake", None)
    try:
        if store is None:
            path = doctor.mooncake_config or os.environ.get(MOONCAKE_CONFIG_ENV)
            if not path:
                raise ConfigError(f"no Mooncake Store config: give --mooncake-config, set "
                                  f"{MOONCAKE_CONFIG_ENV}, or put it inline under 'mooncake'")
            store = MooncakeStoreConfig.from_file(path)
    except ConfigError as exc:
        doctor.fail("Mooncake Store config", str(exc), f"see `vllm-ascend-kv config {SECTION}` "
                    "(keys under 'mooncake')")
        return
    doctor.check_mooncake_store(store)
