# SPDX-License-Identifier: Apache-2.0
"""``doctor``'s provenance check: who provides each ``vllm_ascend.distributed`` module.

Beside vLLM-Ascend both distributions ship some of the same files, upstream's
module paths (``docs/deployment-ascend.md``). This check names the distribution
whose copy each module holds (:mod:`.provenance` reads the RECORD hashes),
warns when an upstream path of ours holds vLLM-Ascend's copy (the connector
names stay ours; imports of that path get its code), and fails when a file of
ours is gone or ours are shadowed by a ``vllm_ascend`` from another site
directory.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from . import provenance

logger = logging.getLogger(__name__)

WHAT = "vllm_ascend.distributed"


def check(doctor: Any) -> None:
    """Report providers through ``doctor.ok``, each problem through ``doctor.warn``/``fail``."""
    try:
        inv = provenance.inventory()
        found = provenance.problems(inv)
    except Exception as exc:  # a broken RECORD must not hide the other checks
        logger.debug("provenance scan failed", exc_info=True)
        doctor.warn(WHAT, f"cannot tell who provides the modules: {exc}")
        return
    by_provider: dict[str, list[str]] = defaultdict(list)
    shared = 0
    for e in inv.files:
        if len(e.listed_by) > 1:
            shared += 1
        if e.exists:
            by_provider[e.provider or "no RECORD matches"].append(e.module)
    prefix = WHAT + "."
    for provider in sorted(by_provider):
        modules = sorted(m.removeprefix(prefix) for m in by_provider[provider])
        doctor.ok(f"{WHAT} modules from {provider}",
                  f"{len(modules)}: {', '.join(modules)}")
    if shared:
        doctor.ok(f"{WHAT} files shipped by two distributions",
                  f"{shared} (upstream's module paths; {', '.join(sorted(inv.foreign))} "
                  f"is installed too)")
    for problem in found:
        report = doctor.fail if problem.fatal else doctor.warn
        report(f"{WHAT} provider ({problem.module})", problem.detail, problem.fix)
