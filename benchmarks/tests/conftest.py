# SPDX-License-Identifier: Apache-2.0
"""The report renderer, loaded once for every test here.

``benchmarks/render.py`` is a script, not a package: it is loaded from its file as module
``bench_render`` (registered in ``sys.modules`` before it runs, as its dataclasses look their
module up; its sections import as ``bench_sections``). The tests take it from there:
``render = sys.modules["bench_render"]``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from ascend_kv_testing.requires import require

require("matplotlib", dist="matplotlib", why="the renderer draws with matplotlib")

if "bench_render" not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        "bench_render", Path(__file__).resolve().parents[1] / "render.py")
    assert _spec is not None and _spec.loader is not None
    _render = importlib.util.module_from_spec(_spec)
    sys.modules["bench_render"] = _render
    _spec.loader.exec_module(_render)
