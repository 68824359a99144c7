#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Generate (or, with --check, verify) the meta-package's exact pins.

The pins of ``packages/vllm-ascend-distributed/pyproject.toml`` must equal the
``__about__.py`` versions of the six runtime packages; a release that forgets one would
install a mismatched set. A tool (``[tool.vllm-ascend-distributed] role = "tool"``:
ascend-kv-bench) is not pinned: the meta-package does not install it.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
META = ROOT / "packages" / "vllm-ascend-distributed" / "pyproject.toml"
BEGIN = "# BEGIN GENERATED PINS"
END = "# END GENERATED PINS"


def package_versions() -> dict[str, str]:
    """Return ``{dist name: version}`` for every package but the meta-package and the tools."""
    out: dict[str, str] = {}
    for pyproject in sorted((ROOT / "packages").glob("*/pyproject.toml")):
        if pyproject == META:
            continue
        data = tomllib.loads(pyproject.read_text())
        if data.get("tool", {}).get("vllm-ascend-distributed", {}).get("role") == "tool":
            continue
        about = pyproject.parent / data["tool"]["hatch"]["version"]["path"]
        match = re.search(r'__version__\s*=\s*"([^"]+)"', about.read_text())
        if not match:
            raise SystemExit(f"{about}: no __version__ found")
        out[data["project"]["name"]] = match.group(1)
    return out


def render(versions: dict[str, str]) -> str:
    lines = [f"{BEGIN} (tools/sync_meta_pins.py; checked by `nox -s build`)", "dependencies = ["]
    lines += [f'    "{name}=={ver}",' for name, ver in sorted(versions.items())]
    lines += ["]", END]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the pins drifted")
    args = parser.parse_args()
    text = META.read_text()
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + render(package_versions()) + text[stop:]
    if args.check:
        if new != text:
            print(f"{META}: meta-package pins differ from the __about__.py versions; "
                  "run tools/sync_meta_pins.py", file=sys.stderr)
            return 1
        print("meta-package pins match the package versions")
        return 0
    META.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
