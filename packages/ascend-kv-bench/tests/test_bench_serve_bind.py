# SPDX-License-Identifier: Apache-2.0
"""``bench serve``'s engines keep to the CPUs ``VLLM_CPU_OMP_THREADS_BIND`` lists: vLLM
applies it only to the workers of its multiprocess executor, not to an engine in the
calling process (``serve.child.bind_in_process``; what a value pins is core's
``tooling.cpu_binding``, tested in ascend-kv-core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_ascend.distributed.kv_transfer.bench.serve.child import bind_in_process

_PROBE = """
import json, os, sys
from vllm_ascend.distributed.kv_transfer.bench.serve.child import bind_in_process
cpus = bind_in_process()
print(json.dumps({"cpus": cpus, "affinity": sorted(os.sched_getaffinity(0)),
                  "omp": os.environ.get("OMP_NUM_THREADS"),
                  "places": os.environ.get("OMP_PLACES"),
                  "torch_loaded": "torch" in sys.modules}))
"""


def _probe(bind: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_listed_cpu_pins_the_process_and_its_openmp_threads() -> None:
    cpu = max(os.sched_getaffinity(0))
    got = _probe(str(cpu))
    assert got["cpus"] == [cpu] and got["affinity"] == [cpu]
    assert got["omp"] == "1" and got["places"] == f"{{{cpu}}}"
    # the binding comes before torch loads: libgomp reads OMP_* once, when it loads
    assert got["torch_loaded"] is False
    # one list per rank: an engine in the calling process takes the first
    assert _probe(f"{cpu}|{cpu}")["affinity"] == [cpu]


@pytest.mark.parametrize("bind", [None, "auto", "nobind"])
def test_auto_and_nobind_leave_the_process_as_it_is(bind: str | None) -> None:
    got = _probe(bind)
    assert got["cpus"] is None and got["omp"] is None
    assert got["affinity"] == sorted(os.sched_getaffinity(0))


def test_an_env_mapping_is_updated_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, list[int]]] = []
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append((pid, cpus)))
    env = {"VLLM_CPU_OMP_THREADS_BIND": "2-3"}
    assert bind_in_process(env) == [2, 3]
    assert calls == [(0, [2, 3])]
    assert env["OMP_NUM_THREADS"] == "2" and env["OMP_PLACES"] == "{2,3}"
    assert env["OMP_PROC_BIND"] == "true"
