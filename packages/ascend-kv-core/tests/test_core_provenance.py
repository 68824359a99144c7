# SPDX-License-Identifier: Apache-2.0
"""core.provenance on a fake site directory: two distributions sharing upstream's paths.

"ascend-kv-demo" stands for a package of ours (an ``__about__.py``, no
``vllm_ascend/__init__.py``); "vllm-ascend" for the platform wheel (the regular
``vllm_ascend`` package). The real wheel is exercised by ``tests-ascend/``.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.core.tooling import doctor_provenance, provenance

D = "vllm_ascend/distributed/kv_transfer/demo/"
OURS = {f"{D}__init__.py": "# ours\n", f"{D}__about__.py": "__version__ = '1'\n",
        f"{D}impl.py": "X = 1\n", f"{D}upstream_path.py": "from .impl import X\n"}
THEIRS = {"vllm_ascend/__init__.py": "", f"{D}__init__.py": "",
          f"{D}upstream_path.py": "X = 2  # theirs\n", f"{D}their_only.py": "Y = 1\n"}


def _hash(text: str) -> str:
    digest = hashlib.sha256(text.encode()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _install(site: Path, name: str, files: dict[str, str]) -> None:
    """Write ``files`` (the last install wins) and a dist-info with their RECORD."""
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    (info / "RECORD").write_text("".join(f"{rel},{_hash(text)},{len(text)}\n"
                                         for rel, text in files.items()))


def _by_module(problems: list[provenance.Problem]) -> dict[str, provenance.Problem]:
    return {p.module.rsplit(".", 1)[-1]: p for p in problems}


def test_ours_and_theirs_are_told_apart_without_a_list(tmp_path: Path) -> None:
    _install(tmp_path, "vllm-ascend", THEIRS)
    _install(tmp_path, "ascend-kv-demo", OURS)  # ours last
    inv = provenance.inventory([str(tmp_path)])
    assert inv.ours == {"ascend-kv-demo"} and inv.foreign == {"vllm-ascend"}
    by_path = {e.path: e for e in inv.files}
    assert by_path[f"{D}upstream_path.py"].provider == "ascend-kv-demo"
    assert set(by_path[f"{D}upstream_path.py"].listed_by) == {"ascend-kv-demo", "vllm-ascend"}
    assert by_path[f"{D}their_only.py"].provider == "vllm-ascend"
    assert [p for p in provenance.problems(inv) if p.module != "vllm_ascend"] == []


def test_their_copy_in_an_upstream_path_is_an_error(tmp_path: Path) -> None:
    _install(tmp_path, "ascend-kv-demo", OURS)
    _install(tmp_path, "vllm-ascend", THEIRS)  # theirs last: their copies in the shared files
    inv = provenance.inventory([str(tmp_path)])
    found = _by_module([p for p in provenance.problems(inv) if p.module != "vllm_ascend"])
    assert set(found) == {"demo", "upstream_path"}  # demo: the package's __init__.py
    problem = found["upstream_path"]
    assert problem.fatal and "holds vLLM-Ascend's copy, not ascend-kv-demo's" in problem.detail
    assert problem.fix.endswith("pip install --force-reinstall --no-deps ascend-kv-demo")
    assert next(e for e in inv.files if e.path == f"{D}impl.py").provider == "ascend-kv-demo"


def test_a_file_of_ours_removed_by_their_uninstall_is_an_error(tmp_path: Path) -> None:
    _install(tmp_path, "vllm-ascend", THEIRS)
    _install(tmp_path, "ascend-kv-demo", OURS)
    (tmp_path / D / "upstream_path.py").unlink()
    (tmp_path / D / "impl.py").unlink()
    found = _by_module(provenance.problems(provenance.inventory([str(tmp_path)])))
    assert found["upstream_path"].fatal
    assert "is gone (removed by an uninstall of vllm-ascend)" in found["upstream_path"].detail
    assert found["impl"].fatal and "is gone (deleted)" in found["impl"].detail


class _Doctor:
    def __init__(self) -> None:
        self.checks: list[tuple[str, str, str]] = []

    def ok(self, what: str, detail: str = "") -> None:
        self.checks.append(("ok", what, detail))

    def warn(self, what: str, detail: str, fix: str = "") -> None:
        self.checks.append(("warn", what, detail))

    def fail(self, what: str, detail: str, fix: str = "") -> None:
        self.checks.append(("fail", what, detail))


def test_doctor_fails_on_their_copy_and_on_a_gone_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(tmp_path, "ascend-kv-demo", OURS)
    _install(tmp_path, "vllm-ascend", THEIRS)
    (tmp_path / D / "impl.py").unlink()
    real = provenance.inventory

    def inventory(path: Any = None) -> provenance.Inventory:
        return real([str(tmp_path)])

    monkeypatch.setattr(provenance, "inventory", inventory)
    doctor = _Doctor()
    doctor_provenance.check(doctor)
    status = {what.rsplit(".", 1)[-1].rstrip(")"): s for s, what, _ in doctor.checks
              if "provider (" in what}
    assert status["upstream_path"] == "fail" and status["impl"] == "fail", doctor.checks
    oks = {what: detail for s, what, detail in doctor.checks if s == "ok"}
    assert "kv_transfer.demo.their_only" in oks["vllm_ascend.distributed modules from vllm-ascend"]
