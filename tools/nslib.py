# SPDX-License-Identifier: Apache-2.0
"""Facts about the shared namespace, used by the check scripts."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Namespace levels: never an __init__.py here, in any package or wheel.
NAMESPACE_DIRS = (
    "vllm_ascend",
    "vllm_ascend/distributed",
    "vllm_ascend/distributed/kv_transfer",
    "vllm_ascend/distributed/kv_transfer/kv_pool",
)
NAMESPACE_INITS = tuple(f"{d}/__init__.py" for d in NAMESPACE_DIRS)


def packages() -> dict[str, Path]:
    """dist name -> package folder."""
    out = {}
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        name = tomllib.loads(pyproject.read_text())["project"]["name"]
        out[name] = pyproject.parent
    return out


def is_tool(pkg_dir: Path) -> bool:
    """Whether a package is a tool (``[tool.vllm-ascend-distributed] role = "tool"``:
    ascend-kv-bench), which no runtime package and not the meta-package brings."""
    data = tomllib.loads((pkg_dir / "pyproject.toml").read_text())
    return data.get("tool", {}).get("vllm-ascend-distributed", {}).get("role") == "tool"


def shipped_paths(pkg_dir: Path) -> list[str]:
    """Paths (relative to src/) a package's wheel must hold, from its only-include."""
    data = tomllib.loads((pkg_dir / "pyproject.toml").read_text())
    wheel = data["tool"]["hatch"]["build"]["targets"]["wheel"]
    return [p.removeprefix("src/") for p in wheel.get("only-include", [])]
