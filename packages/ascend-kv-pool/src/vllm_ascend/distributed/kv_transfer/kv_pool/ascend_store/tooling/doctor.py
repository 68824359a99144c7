# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv doctor`` checks of the KV pool.

Entry points ``vllm_ascend_kv.doctor`` ``AscendStoreConnector`` and
``MooncakeConnectorStoreV1`` (its deprecated alias, same section) name
:func:`check`: the section is validated, then the
backend: ``memcache`` needs ``memcache_hybrid``; ``mooncake`` needs the
transfer engine, a Store config (inline, ``--mooncake-config`` or
``MOONCAKE_CONFIG_PATH``), a reachable master and metadata server; ``local`` needs the
host memory it will hold.
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


def check_local_memory(doctor: Any, section: Any) -> None:
    """Whether this host has the memory the ``local`` backend will hold, in every worker
    process of the instance on this host (``doctor.workers_on_host``, from the parallel
    sizes given to ``doctor``; each worker keeps a pool of ``local_pool_size``): all of it
    at start-up with ``local_pool_prefault`` (a worker refuses to start when its pool is
    more than the memory then available, so the workers that start last would be
    refused), else as the pools fill."""
    from vllm_ascend.distributed.kv_transfer.core.device import available_host_memory

    from ..backend.local_memory import prefault_bytes

    size = getattr(section, "local_pool_size", None)
    free = available_host_memory()
    if size is None or free is None:
        return
    workers = max(1, int(getattr(doctor, "workers_on_host", 1)))
    mib, free_mib = size >> 20, free >> 20
    each = "" if workers == 1 else f"{workers} workers x "
    per = ("per worker process; give the instance's parallel sizes (-tp, -pp, -dpl) to "
           "count its workers" if workers == 1 else f"{workers} worker processes on this host")
    if getattr(section, "local_pool_prefault", False):
        touched = prefault_bytes(size)
        if touched * workers > free:
            doctor.fail("local pool memory", f"local_pool_prefault touches {each}{mib} MiB (+"
                        f"{(touched - size) >> 20} MiB) at start-up; {free_mib} MiB available: "
                        f"{'the worker refuses' if workers == 1 else 'the last workers refuse'}"
                        " to start", "lower local_pool_size (it is per worker), or turn "
                        "local_pool_prefault off")
        else:
            doctor.ok("local pool memory", f"{each}{mib} MiB touched at start-up, {free_mib} "
                      f"MiB available ({per})")
    elif size * workers > free:
        doctor.warn("local pool memory", f"local_pool_size {each}{mib} MiB is more than the "
                    f"{free_mib} MiB available; the pools grow to it as they fill",
                    "lower local_pool_size (it is per worker)")
    else:
        doctor.ok("local pool memory", f"up to {each}{mib} MiB as it fills, {free_mib} MiB "
                  f"available ({per})")


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
        if backend == "local":
            check_local_memory(doctor, section)
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
