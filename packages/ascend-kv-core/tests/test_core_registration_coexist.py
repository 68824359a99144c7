# SPDX-License-Identifier: Apache-2.0
"""Registration beside vLLM-Ascend: both register functions, in both orders, never raise.

vLLM-Ascend's ``kv_transfer.register_connector`` is played by a function that
does what the real one does (no check, pops the names it overrides); the real
wheel is exercised in ``tests-ascend/`` (nox session ``ascend-coexist``).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from vllm_ascend.distributed.kv_transfer.core import registration
from vllm_ascend.distributed.kv_transfer.core.registration import (
    loader_target,
    register_connectors,
)

OURS = [("CoexistTestConnA", "coexist_test_ours", "A"),
        ("CoexistTestConnB", "coexist_test_ours", "B")]


def _their_register_connector() -> None:
    """What vLLM-Ascend's kv_transfer.register_connector does (shape only)."""
    if "CoexistTestMulti" in KVConnectorFactory._registry:
        KVConnectorFactory._registry.pop("CoexistTestMulti")
    KVConnectorFactory.register_connector("CoexistTestMulti", "vllm_ascend.theirs.multi", "M")
    KVConnectorFactory.register_connector("CoexistTestConnA", "vllm_ascend.theirs.a", "A")
    KVConnectorFactory.register_connector("CoexistTestOnlyTheirs", "vllm_ascend.theirs.c", "C")


@pytest.fixture
def vllm_ascend_present(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    module = importlib.import_module(registration.VLLM_ASCEND_KV_TRANSFER)
    monkeypatch.setattr(module, "register_connector", _their_register_connector, raising=False)
    names = [n for n, _, _ in OURS] + ["CoexistTestMulti", "CoexistTestOnlyTheirs"]
    for name in names:
        KVConnectorFactory._registry.pop(name, None)
        registration._our_loaders.pop(name, None)
        registration._ours.pop(name, None)
    yield module
    for name in names:
        KVConnectorFactory._registry.pop(name, None)
        registration._our_loaders.pop(name, None)
        registration._ours.pop(name, None)


def _theirs(module: Any) -> None:
    # vllm_ascend.register_connector imports it at call time, so it gets the wrapper.
    module.register_connector()


def _targets() -> dict[str, tuple[str, str] | None]:
    return {n: loader_target(KVConnectorFactory._registry[n])
            for n in ("CoexistTestConnA", "CoexistTestConnB", "CoexistTestMulti",
                      "CoexistTestOnlyTheirs")}


EXPECTED = {
    "CoexistTestConnA": ("coexist_test_ours", "A"),
    "CoexistTestConnB": ("coexist_test_ours", "B"),
    "CoexistTestMulti": ("vllm_ascend.theirs.multi", "M"),
    "CoexistTestOnlyTheirs": ("vllm_ascend.theirs.c", "C"),
}


def test_ours_then_theirs(vllm_ascend_present: Any) -> None:
    assert register_connectors(OURS) == ["CoexistTestConnA", "CoexistTestConnB"]
    _theirs(vllm_ascend_present)  # the unwrapped one would raise: "already registered"
    assert _targets() == EXPECTED
    _theirs(vllm_ascend_present)  # plugins may load twice: still no error
    assert register_connectors(OURS) == []
    assert _targets() == EXPECTED


def test_theirs_then_ours(vllm_ascend_present: Any) -> None:
    _theirs(vllm_ascend_present)
    assert loader_target(KVConnectorFactory._registry["CoexistTestConnA"]) == (
        "vllm_ascend.theirs.a", "A")
    assert register_connectors(OURS) == ["CoexistTestConnA", "CoexistTestConnB"]
    assert _targets() == EXPECTED
    _theirs(vllm_ascend_present)  # wrapped by now
    assert _targets() == EXPECTED


def test_their_pop_of_a_name_we_own_is_undone(vllm_ascend_present: Any) -> None:
    ours = [("CoexistTestMulti", "coexist_test_ours", "Multi")]
    OURS.extend(ours)
    try:
        register_connectors(OURS)
        _theirs(vllm_ascend_present)
        assert loader_target(KVConnectorFactory._registry["CoexistTestMulti"]) == (
            "coexist_test_ours", "Multi")
    finally:
        del OURS[-1]


def test_a_name_vllm_owns_is_never_taken_over(vllm_ascend_present: Any) -> None:
    before = KVConnectorFactory._registry["MooncakeConnector"]
    assert register_connectors([("MooncakeConnector", "coexist_test_ours", "X")]) == []
    assert KVConnectorFactory._registry["MooncakeConnector"] is before


def test_the_factory_is_strict_again_after_their_call(vllm_ascend_present: Any) -> None:
    register_connectors(OURS)
    _theirs(vllm_ascend_present)
    with pytest.raises(ValueError, match="already registered"):
        KVConnectorFactory.register_connector("CoexistTestConnA", "x", "y")


def test_without_vllm_ascend_nothing_is_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module(registration.VLLM_ASCEND_KV_TRANSFER)
    monkeypatch.delattr(module, "register_connector", raising=False)
    assert registration.tolerate_vllm_ascend() is False
