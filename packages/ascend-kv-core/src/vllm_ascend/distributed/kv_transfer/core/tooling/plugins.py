# SPDX-License-Identifier: Apache-2.0
"""The entry-point groups through which packages plug into ``vllm-ascend-kv``.

Core names no connector package: each package declares what it brings in its
``pyproject.toml``, and core finds it here.

``vllm_ascend_kv.config``
    name: a connector (its ``kv_connector``); value: its config section class
    (``from_dict``/``describe``). ``vllm-ascend-kv config`` lists them; the doctor
    validates ``kv_connector_extra_config`` with it.
``vllm_ascend_kv.doctor``
    name: a connector; value: a :class:`DoctorCheck`, called by ``vllm-ascend-kv
    doctor`` for that connector (it validates the section and adds the package's
    own checks).
``vllm_ascend_kv.bench``
    value: ``add_parser(subparsers)`` adding a ``vllm-ascend-kv bench <name>`` (the
    ascend-kv-bench distribution declares every benchmark of the project).
``vllm_ascend_kv.cli``
    value: ``add_commands(subparsers)`` adding top-level subcommands.
``vllm_ascend_kv.serve``
    value: a callable returning the package's ``bench serve`` scenarios
    (``vllm_ascend.distributed.kv_transfer.bench.serve.spec.Scenario``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterable
from importlib import metadata
from typing import Any, Protocol

logger = logging.getLogger(__name__)

#: Prefix of every entry-point group of the project.
GROUP_PREFIX = "vllm_ascend_kv."
CONFIG_GROUP = "vllm_ascend_kv.config"
DOCTOR_GROUP = "vllm_ascend_kv.doctor"
BENCH_GROUP = "vllm_ascend_kv.bench"
CLI_GROUP = "vllm_ascend_kv.cli"
SERVE_GROUP = "vllm_ascend_kv.serve"
#: The distribution of this package, always listed first by ``vllm-ascend-kv version``.
CORE_DIST = "ascend-kv-core"
#: Where every package of the project puts its modules.
NAMESPACE_DIR = "vllm_ascend/distributed/"


class DoctorCheck(Protocol):
    """What a ``vllm_ascend_kv.doctor`` entry point names.

    Called once per connector of the checked config, after core's generic
    checks of that connector's package. It validates ``extra`` (usually with
    :meth:`~.doctor.Doctor.validate_section`) and reports through ``doctor``'s
    :meth:`~.doctor.Doctor.ok` / ``warn`` / ``fail``.
    """

    def __call__(self, doctor: Any, connector: str, extra: Any, where: str,
                 cfg: dict[str, Any]) -> None: ...


def load(path: str) -> Any:
    """The object ``module:attribute`` names (an entry point's value)."""
    module, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split(".") if attr else ():
        obj = getattr(obj, part)
    return obj


def entry_points(group: str) -> list[metadata.EntryPoint]:
    """The entry points of ``group``, sorted by name, one per name."""
    seen: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=group):
        seen.setdefault(ep.name, ep)
    return [seen[name] for name in sorted(seen)]


def config_sections() -> dict[str, str]:
    """Connector name -> ``module:Class`` of its config section, of every installed package."""
    return {ep.name: ep.value for ep in entry_points(CONFIG_GROUP)}


def provider(connector: str) -> metadata.EntryPoint | None:
    """The entry point that makes ``connector`` known (doctor first, else config), if any."""
    for group in (DOCTOR_GROUP, CONFIG_GROUP):
        for ep in entry_points(group):
            if ep.name == connector:
                return ep
    return None


def known_connectors() -> list[str]:
    """Every connector an installed package declares (doctor or config entry point)."""
    return sorted({ep.name for g in (DOCTOR_GROUP, CONFIG_GROUP) for ep in entry_points(g)})


def dist_name(ep: metadata.EntryPoint) -> str | None:
    """The distribution that declares ``ep`` (``None`` when unknown)."""
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else None


def _requirement_names(dist: metadata.Distribution) -> Iterable[str]:
    for req in dist.requires or ():
        name = req
        for sep in "[<>=!~; (":
            name = name.split(sep, 1)[0]
        yield name.strip().lower()


def _is_ours(dist: metadata.Distribution) -> bool:
    if any(ep.group.startswith(GROUP_PREFIX) for ep in dist.entry_points):
        return True
    if CORE_DIST in _requirement_names(dist):
        return True
    return any(str(f).startswith(NAMESPACE_DIR) for f in (dist.files or ()))


def installed_distributions() -> dict[str, str]:
    """Name -> version of every installed distribution of the project, core first.

    A distribution counts when it declares a ``vllm_ascend_kv.*`` entry point,
    requires ascend-kv-core, or ships modules under ``vllm_ascend/distributed/``
    (so the meta-package and a vLLM-Ascend wheel beside us show too); no list of
    names is kept anywhere.
    """
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name or name in found:
            continue
        try:
            if _is_ours(dist):
                found[name] = dist.version
        except Exception as exc:  # a broken RECORD of one distribution must not hide the rest
            logger.debug("cannot inspect %s: %s", name, exc)
    core = {CORE_DIST: found.pop(CORE_DIST)} if CORE_DIST in found else {}
    return {**core, **dict(sorted(found.items()))}
