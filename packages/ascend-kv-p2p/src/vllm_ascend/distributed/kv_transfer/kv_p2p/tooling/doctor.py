# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv doctor`` checks of the P/D connectors.

Entry points ``vllm_ascend_kv.doctor`` ``MooncakeConnectorV1`` and
``MooncakeLayerwiseConnector`` name :func:`check`: the section is validated,
the Mooncake transfer engine must import, a stalled transfer must end before
the lease and the deadline, a producer's ``kv_port`` must be free, and a producer on CPU
whose OpenMP threads are not pinned gets the advice on their spinning.
"""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger(__name__)


def check(doctor: Any, connector: str, extra: Any, where: str, cfg: dict[str, Any]) -> None:
    """The checks of one P/D connector (a ``vllm_ascend_kv.doctor`` entry point).

    Args:
        doctor: the running ``Doctor`` of ``core.tooling.doctor``.
        connector: ``kv_connector`` of the checked config.
        extra: its ``kv_connector_extra_config``.
        where: where ``extra`` sits in the config (for messages).
        cfg: the whole ``--kv-transfer-config``.
    """
    from vllm_ascend.distributed.kv_transfer.core.tooling.doctor import kv_port

    section = doctor.validate_section(connector, extra, where)
    if section is None:
        return
    doctor.check_platform(needs_mooncake=True)
    check_stall_bound(doctor, section)
    if cfg.get("kv_role") in ("kv_producer", "kv_both"):
        port = kv_port(cfg)
        if port is not None:  # an invalid kv_port is reported by core's top-level check
            doctor.check_port_free(port)
        check_openmp_spin(doctor)


def check_stall_bound(doctor: Any, section: Any) -> None:
    """A transfer stalled by the network stays in flight up to Mooncake's TCP progress
    timeout: it must end before a P/D deadline and well before a lease runs out."""
    from vllm_ascend.distributed.kv_transfer.core.transfer_engine import (
        DEFAULT_TCP_PROGRESS_TIMEOUT_S,
        TCP_PROGRESS_TIMEOUT_ENV,
    )

    raw = os.environ.get(TCP_PROGRESS_TIMEOUT_ENV, str(DEFAULT_TCP_PROGRESS_TIMEOUT_S))
    try:
        bound = int(raw)
    except ValueError:
        doctor.warn(TCP_PROGRESS_TIMEOUT_ENV, f"{raw!r} is not an integer; Mooncake then uses "
                    "its own 30 s", f"set {TCP_PROGRESS_TIMEOUT_ENV} to whole seconds")
        return
    lease, deadline = section.lease_ttl_s, section.load_timeout_s
    if bound >= deadline or bound + 0.5 >= lease * 0.8:
        doctor.warn(TCP_PROGRESS_TIMEOUT_ENV,
                    f"{bound} s lets a stalled transfer outlive load_timeout_s={deadline} or "
                    f"most of lease_ttl_s={lease}",
                    f"lower {TCP_PROGRESS_TIMEOUT_ENV} (default here "
                    f"{DEFAULT_TCP_PROGRESS_TIMEOUT_S}) or raise the lease and deadline")
    else:
        doctor.ok(TCP_PROGRESS_TIMEOUT_ENV, f"{bound} s, below the lease and the deadline")


def check_openmp_spin(doctor: Any, environ: Any = None) -> None:
    """On CPU, a P whose OpenMP threads are not pinned apart: GNU libgomp's threads spin after
    each parallel region (``GOMP_SPINCOUNT``), and a D on the same cores computes its first
    token after the KV slower (7-9 ms a request at the median on 2 cores, measured). Pinned,
    or with the threads passive, nothing to say but ok; on an NPU or GPU, not checked."""
    from vllm_ascend.distributed.kv_transfer.core.device import detect_device_kind
    from vllm_ascend.distributed.kv_transfer.core.tooling.cpu_binding import (
        OMP_BIND_ENV,
        bound_cpus,
    )

    env = os.environ if environ is None else environ
    try:
        if detect_device_kind() != "cpu":
            return
    except ValueError:  # reported by the platform check
        return
    what = "OpenMP threads (P on CPU)"
    passive = (env.get("GOMP_SPINCOUNT", "").strip() == "0"
               or env.get("OMP_WAIT_POLICY", "").strip().lower() == "passive")
    bind = env.get(OMP_BIND_ENV, "auto").strip() or "auto"
    try:
        pinned = bound_cpus(bind) is not None
    except ValueError:
        doctor.warn(what, f"{OMP_BIND_ENV}={bind!r} is neither auto, nobind nor a CPU list "
                    "(one per rank, |-separated)",
                    f"set {OMP_BIND_ENV} to the cores of this P, e.g. 0-3")
        return
    if passive:
        doctor.ok(what, "passive after a parallel region (GOMP_SPINCOUNT=0 or "
                  "OMP_WAIT_POLICY=passive)")
    elif pinned:
        doctor.ok(what, f"pinned ({OMP_BIND_ENV}={bind}): give D's engine other cores")
    else:
        doctor.warn(what, f"{OMP_BIND_ENV}={bind} does not pin this P apart from a D on the "
                    "same host (unless taskset gives each cores of its own), and its threads "
                    "spin after each parallel region: a D sharing "
                    "these cores computed its first token after the KV 7-9 ms slower at the "
                    "median (2 cores, measured)",
                    f"pin P and D to cores of their own ({OMP_BIND_ENV}=<cpus>, or taskset), "
                    "or set GOMP_SPINCOUNT=0 in P's environment (docs/quickstart-pd.md, "
                    "\"P and D on one host\")")
