#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Check built wheels: each ships exactly its own paths, no namespace-level __init__.py.

Usage: ``check_wheels.py DIST_DIR``.
"""

from __future__ import annotations

import sys
import tomllib
import zipfile
from pathlib import Path

from nslib import NAMESPACE_INITS, packages, shipped_paths


def main() -> int:
    dist_dir = Path(sys.argv[1])
    errors: list[str] = []
    for dist, pkg in packages().items():
        norm = dist.replace("-", "_")
        wheels = sorted(dist_dir.glob(f"{norm}-*.whl"))
        sdists = sorted(dist_dir.glob(f"{norm}-*.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            errors.append(f"{dist}: expected one wheel and one sdist in {dist_dir}, found "
                          f"{[w.name for w in wheels]} {[s.name for s in sdists]}")
            continue
        allowed = shipped_paths(pkg)
        names = [n for n in zipfile.ZipFile(wheels[0]).namelist() if ".dist-info/" not in n]
        for name in names:
            if name in NAMESPACE_INITS:
                errors.append(f"{wheels[0].name}: ships namespace-level {name}")
            if not any(name == a or name.startswith(a.rstrip("/") + "/") for a in allowed):
                errors.append(f"{wheels[0].name}: ships {name}, outside its paths {allowed}")
        for a in allowed:
            if not any(n == a or n.startswith(a + "/") for n in names):
                errors.append(f"{wheels[0].name}: does not ship {a}")
        meta = zipfile.ZipFile(wheels[0]).read(
            next(n for n in zipfile.ZipFile(wheels[0]).namelist() if n.endswith("METADATA")))
        data = tomllib.loads((pkg / "pyproject.toml").read_text())
        for dep in data["project"].get("dependencies", []):
            if dep.split("[")[0].split(">")[0].split("=")[0].split("<")[0] not in meta.decode():
                errors.append(f"{wheels[0].name}: METADATA lacks dependency {dep}")
        print(f"{wheels[0].name}: {len(names)} files under {', '.join(allowed) or '(nothing)'}")
    for e in errors:
        print(f"check-wheels: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
