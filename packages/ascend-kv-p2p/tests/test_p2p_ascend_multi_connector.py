# SPDX-License-Identifier: Apache-2.0
"""``AscendMultiConnector`` with fake children: layerwise children get the real blocks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer import ascend_multi_connector as amc
from vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_layerwise_connector import (
    MooncakeLayerwiseConnector,
)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, int]] = []

    def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None:
        self.calls.append((request.request_id, blocks, n))


class FakeLayerwise(MooncakeLayerwiseConnector):
    def __init__(self) -> None:  # no vLLM config needed: only the scheduler call is exercised
        self.calls: list[tuple[str, Any, int]] = []

    def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None:
        self.calls.append((request.request_id, blocks, n))


class MooncakeLayerwiseConnector_(Recorder):
    pass


# vLLM-Ascend's wheel has its own class of this name at the same path
UpstreamLayerwise = type("MooncakeLayerwiseConnector", (Recorder,), {})


def _multi(children: list[Any], chosen: dict[str, int]) -> amc.AscendMultiConnector:
    multi = object.__new__(amc.AscendMultiConnector)  # children are set by hand
    multi._connectors = children
    multi._requests_to_connector = chosen
    return multi


@pytest.mark.parametrize("chosen", [0, None])
def test_layerwise_children_get_real_blocks_and_count(chosen: int | None) -> None:
    pool, layerwise, other, upstream = Recorder(), FakeLayerwise(), Recorder(), UpstreamLayerwise()
    multi = _multi([pool, layerwise, other, upstream],
                   {} if chosen is None else {"r1": chosen})
    blocks = SimpleNamespace(name="real blocks")
    multi.update_state_after_alloc(SimpleNamespace(request_id="r1"), blocks, 32)
    assert layerwise.calls == [("r1", blocks, 32)]
    assert upstream.calls == [("r1", blocks, 32)]
    assert other.calls == [("r1", blocks, 0)]
    assert pool.calls == [("r1", blocks, 32 if chosen == 0 else 0)]


def test_is_layerwise_connector() -> None:
    assert amc.is_layerwise_connector(FakeLayerwise())
    assert amc.is_layerwise_connector(UpstreamLayerwise())
    assert not amc.is_layerwise_connector(MooncakeLayerwiseConnector_())
    assert not amc.is_layerwise_connector(Recorder())


def test_registered_under_its_own_name_never_over_vllms() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from vllm_ascend.distributed.kv_transfer import kv_p2p

    kv_p2p.register()
    kv_p2p.register()
    assert KVConnectorFactory._registry["AscendMultiConnector"]() is amc.AscendMultiConnector
    assert KVConnectorFactory._registry["MultiConnector"]() is MultiConnector
    assert issubclass(amc.AscendMultiConnector, MultiConnector)
