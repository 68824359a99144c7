# SPDX-License-Identifier: Apache-2.0
"""``bench serve``'s engine processes: one that cannot start, and a quick run on real engines.

Both checks run in child processes (real vLLM engines) and take most of this session's time,
so they start when this module is collected and run on a free core while the tests before
them do; each test then asserts on what its check produced.
"""

from __future__ import annotations

import atexit
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from ascend_kv_testing.procs import call_in_background, start_in_background
from ascend_kv_testing.requires import require
from vllm_ascend.distributed.kv_transfer.bench.serve import child as serve_child

_TMP = Path(tempfile.mkdtemp(prefix="core-serve-engines-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)
CLI = "vllm_ascend.distributed.kv_transfer.core.tooling.cli"


def _start_without_model(where: Path) -> serve_child.EngineError | None:
    """The engine error of a start without a model (``None``: the engine started)."""
    try:
        engine = serve_child.EngineChild({"model": str(where / "no-such-model"),
                                 "skip_tokenizer_init": True},
                                log=where / "engine.log", timeout=240)
    except serve_child.EngineError as exc:
        return exc
    engine.kill()
    return None


_NO_MODEL = call_in_background(_start_without_model, _TMP / "no-model")
#: ``vllm-ascend-kv bench serve`` (quick) on two real engines: no connector, ExampleConnector
_SERVE_OUT = _TMP / "serve" / "out"
_SERVE = start_in_background(
    [sys.executable, "-m", CLI, "bench", "serve", "--quick", "--only", "pool/vllm-example",
     "--out", str(_SERVE_OUT), "--model-dir", str(_TMP / "serve" / "model"),
     "--throughput-tokens", "2"], timeout=540)


@pytest.mark.vllm
def test_engine_that_cannot_start_reports_its_error() -> None:
    require("vllm")
    error = _NO_MODEL.result(timeout=300)
    assert isinstance(error, serve_child.EngineError), "an engine started without a model"
    assert "no-such-model" in str(error) or "Error" in str(error)


@pytest.mark.vllm
@pytest.mark.slow
def test_serve_example_connector_against_the_baseline() -> None:
    """Two real engines: no connector, and vLLM's ExampleConnector (which misses k*block+1)."""
    require("vllm")
    require("transformers", why="to make the model")
    proc = _SERVE.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = _SERVE_OUT
    doc = json.loads((out / "serve.json").read_text())
    assert doc["benchmark"] == "serve"
    sc = doc["scenarios"]
    assert sc["baseline"]["status"] == "ok" and sc["pool/vllm-example"]["status"] == "ok"
    assert "pd/ours" not in sc and sc["peer/LMCacheConnectorV1"]["status"] == "unsupported"
    ex = doc["summary"]["pool/vllm-example"]
    assert ex["tokens_equal"] is True
    assert ex["missed"] == [doc["config"]["lengths"][1]]  # k*block + 1
    cached = {int(k): v for k, v in ex["cached"].items()}
    full, plus_one, half = doc["config"]["lengths"]
    assert cached[full] > 0 and cached[half] > 0 and cached[plus_one] == 0
    assert doc["summary"]["baseline"]["throughput_over_baseline"] == 1.0
    # every engine served a first request and batch before its first round, reported apart
    for name in ("baseline", "pool/vllm-example"):
        warm = sc[name]["warm_up"]
        assert warm["tokens"] == max(doc["config"]["lengths"])
        assert warm["first_request_s"] > 0 and warm["first_batch_s"] > 0
    assert "warm-up: a first request of" in proc.stdout + proc.stderr
    assert doc["config"]["engine_malloc"]["MALLOC_MMAP_MAX_"] == "0"
    assert "pool/vllm-example" in proc.stdout
    assert (out / "serve-logs" / "baseline.log").exists()
