#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The namespace guard.

1. No package has an ``__init__.py`` at a namespace level in its sources.
2. No built wheel ships one (wheels are built into a temporary folder).
3. The namespace stays open: with every package's ``src`` on the path plus a
   foreign folder holding ``vllm_ascend/distributed/foreign_probe.py``, the
   foreign module and each package's top module import side by side.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from nslib import NAMESPACE_INITS, ROOT, packages, shipped_paths


def check_sources() -> list[str]:
    errors = []
    for dist, pkg in packages().items():
        for ns_init in NAMESPACE_INITS:
            if (pkg / "src" / ns_init).exists():
                errors.append(f"{dist}: src/{ns_init} turns a namespace into a regular package "
                              "and hides the sibling packages")
    return errors


def check_wheels(out: Path) -> list[str]:
    errors = []
    for pkg in packages().values():
        subprocess.run(["uv", "build", "--wheel", "--quiet", "--out-dir", str(out), str(pkg)],
                       check=True)
    for wheel in sorted(out.glob("*.whl")):
        names = set(zipfile.ZipFile(wheel).namelist())
        for ns_init in NAMESPACE_INITS:
            if ns_init in names:
                errors.append(f"{wheel.name} ships {ns_init}")
    return errors


def check_foreign_module(tmp: Path) -> list[str]:
    foreign = tmp / "foreign" / "vllm_ascend" / "distributed"
    foreign.mkdir(parents=True)
    (foreign / "foreign_probe.py").write_text("VALUE = 42\n")
    paths = [str(tmp / "foreign")] + [str(p / "src") for p in packages().values()
                                      if (p / "src").exists()]
    mods = []
    # plain modules at a namespace level (e.g. kv_transfer/ascend_multi_connector.py) need vLLM
    # or a third-party engine to execute: they must resolve through the namespace, not run
    files = []
    for pkg in packages().values():
        for rel in shipped_paths(pkg):
            if rel.endswith(("__about__.py", "/")):
                continue
            mod = rel.removesuffix(".py").replace("/", ".")
            if rel.endswith(".py"):
                files.append(mod)
            else:
                about = (pkg / "src" / rel / "__about__.py").exists()
                mods.append(mod + ".__about__" if about else mod)
    code = ("import importlib, importlib.util, sys\n"
            "import vllm_ascend.distributed.foreign_probe as f\n"
            "assert f.VALUE == 42\n"
            f"for m in {mods!r}:\n"
            "    importlib.import_module(m)\n"
            f"for m in {files!r}:\n"
            "    assert importlib.util.find_spec(m) is not None, m\n"
            f"print('foreign module and', {len(mods) + len(files)}, "
            "'package modules resolve together')\n")
    env = {"PYTHONPATH": ":".join(paths), "PATH": "/usr/bin:/bin", "HOME": "/tmp"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return [f"foreign module check failed:\n{proc.stderr.strip()}"]
    print(proc.stdout.strip())
    return []


def main() -> int:
    errors = check_sources()
    with tempfile.TemporaryDirectory() as tmp:
        errors += check_wheels(Path(tmp) / "wheels")
        errors += check_foreign_module(Path(tmp))
    for e in errors:
        print(f"namespace-check: {e}", file=sys.stderr)
    if not errors:
        print(f"namespace-check: no namespace-level __init__.py in {len(packages())} packages "
              f"(sources and wheels) under {ROOT.name}/packages")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
