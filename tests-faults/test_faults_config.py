# SPDX-License-Identifier: Apache-2.0
"""Malformed ``kv_connector_extra_config`` through a real engine start.

An engine given a bad extra config must refuse to start with a message naming the key,
the bad value and the connector, not crash later or run with a silently changed value.
(Every key's parsing is unit-tested in ascend-kv-core; this is the path through vLLM.)
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any

import pytest

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


#: connector -> (module, how it finds its config class, the ``source`` it passes)
CONNECTORS = {
    "MooncakeConnectorV1": (
        "vllm_ascend.distributed.kv_transfer.kv_p2p.pull.connector",
        "MooncakeConnector.config_class", "kv_connector_extra_config of MooncakeConnector"),
    "MooncakeLayerwiseConnector": (
        "vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.connector",
        "MooncakeLayerwiseConnector.config_class",
        "kv_connector_extra_config of MooncakeLayerwiseConnector"),
    "AscendStoreConnector": (
        "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_connector",
        "AscendStoreConfig", "AscendStoreConnector kv_connector_extra_config"),
    "CPUOffloadingConnector": (
        "vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_connector",
        "CPUOffloadConfig", "kv_connector_extra_config of CPUOffloadingConnector"),
}

#: connector, out-of-range or wrongly typed extra config, the key the error must name
BAD_VALUES: list[tuple[str, dict[str, Any], str]] = [
    ("MooncakeConnectorV1", {"lease_ttl_s": -1}, "lease_ttl_s"),
    ("MooncakeConnectorV1", {"load_timeout_s": -30}, "load_timeout_s"),
    ("MooncakeConnectorV1", {"num_recv_workers": 0}, "num_recv_workers"),
    ("MooncakeConnectorV1", {"handshake_timeout_s": "fast"}, "handshake_timeout_s"),
    # JSON's NaN passed every range check (a lease that never lapsed): fixed
    ("MooncakeConnectorV1", {"lease_ttl_s": float("nan")}, "lease_ttl_s"),
    ("MooncakeLayerwiseConnector", {"load_timeout_s": float("inf")}, "load_timeout_s"),
    ("MooncakeLayerwiseConnector", {"save_wait_s": "NaN"}, "save_wait_s"),
    ("MooncakeLayerwiseConnector", {"lease_ttl_s": 0}, "lease_ttl_s"),
    ("MooncakeLayerwiseConnector", {"metaserver_retries": -1}, "metaserver_retries"),
    ("MooncakeLayerwiseConnector", {"metaserver_timeout_s": -5}, "metaserver_timeout_s"),
    ("MooncakeLayerwiseConnector", {"load_timeout_s": [8]}, "load_timeout_s"),
    ("MooncakeLayerwiseConnector", {"decode": {"tp_size": -2}}, "tp_size"),
    ("AscendStoreConnector", {"lookup_rpc_port": -1}, "lookup_rpc_port"),
    ("AscendStoreConnector", {"prefill_pp_size": 0}, "prefill_pp_size"),
    ("CPUOffloadingConnector", {"cpu_swap_space_gb": -1}, "cpu_swap_space_gb"),
    ("CPUOffloadingConnector", {"swap_in_threshold": -3}, "swap_in_threshold"),
    ("CPUOffloadingConnector", {"rpc_timeout_s": -1}, "rpc_timeout_s"),
]


def _config_of(connector: str) -> tuple[Any, str]:
    module, attr, source = CONNECTORS[connector]
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj, source


@pytest.mark.parametrize(("connector", "extra", "key"), BAD_VALUES,
                         ids=[f"{c}-{k}-{list(e.values())[0]!r}" for c, e, k in BAD_VALUES])
def test_negative_and_mistyped_values_are_refused(connector: str, extra: dict[str, Any],
                                                  key: str) -> None:
    """The parse each connector runs in its constructor (the engine starts above go through
    it; an engine start per case would cost the session ~15 s each): a negative, zero or mistyped value raises a ConfigError naming the connector, the
    key and the value, never a silently clamped or default value."""
    from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError

    cls, source = _config_of(connector)
    with pytest.raises(ConfigError) as info:
        cls.from_dict(extra, source=source)
    message = str(info.value)
    value = extra.get(key, next(iter(extra.values())))
    if isinstance(value, dict):
        value = value[key]
    assert key in message and connector.replace("V1", "") in message, message
    assert repr(value) in message or str(value) in message, message


@pytest.mark.parametrize("connector", list(CONNECTORS))
def test_unknown_keys_are_named_with_a_suggestion(connector: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """An unknown key (a typo) does not stop the engine (vLLM shares one extra config
    between connectors) but is logged at start with the key, the connector and the closest
    accepted key; ``vllm-ascend-kv doctor`` reports it as an error (``strict``)."""
    from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError

    cls, source = _config_of(connector)
    typo = {"MooncakeConnectorV1": "lease_tll_s", "MooncakeLayerwiseConnector": "save_wait",
            "AscendStoreConnector": "lookup_rpc_prot",
            "CPUOffloadingConnector": "swap_in_treshold"}[connector]
    with caplog.at_level(logging.WARNING):
        cls.from_dict({typo: 1, "made_up": {"x": 1}}, source=source)
    text = caplog.text
    assert repr(typo) in text and "'made_up'" in text and source in text, text
    assert "did you mean" in text, text
    with pytest.raises(ConfigError, match=typo):
        cls.from_dict({typo: 1}, source=source, strict=True)
