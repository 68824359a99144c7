# SPDX-License-Identifier: Apache-2.0
"""SchedulerHooksMixin: vLLM's four scheduler-side hooks reach the scheduler half unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from ascend_kv_testing.requires import require
from vllm_ascend.distributed.kv_transfer.core.vllm_roles import SchedulerHooksMixin


class _Half:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        self.calls.append(("matched", (request, num_computed_tokens)))
        return 48, True

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self.calls.append(("alloc", (request, blocks, num_external_tokens)))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self.calls.append(("meta", (scheduler_output,)))
        return {"built_from": scheduler_output}

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self.calls.append(("finished", (request, block_ids)))
        return True, {"remote_block_ids": block_ids}


class _Shell(SchedulerHooksMixin):
    def __init__(self, half: _Half | None) -> None:
        self.connector_scheduler = half


def test_each_hook_hands_its_arguments_over_and_returns_the_halfs_answer() -> None:
    half = _Half()
    shell = _Shell(half)
    assert shell.get_num_new_matched_tokens("req", 16) == (48, True)
    assert shell.update_state_after_alloc("req", "blocks", 32) is None
    assert shell.build_connector_meta("out") == {"built_from": "out"}
    assert shell.request_finished("req", [3, 4]) == (True, {"remote_block_ids": [3, 4]})
    assert half.calls == [("matched", ("req", 16)), ("alloc", ("req", "blocks", 32)),
                          ("meta", ("out",)), ("finished", ("req", [3, 4]))]


def test_a_scheduler_hook_on_the_worker_side_names_the_connector() -> None:
    with pytest.raises(AssertionError, match="_Shell: scheduler-side method called on a worker connector"):
        _Shell(None).build_connector_meta("out")


def test_listed_before_vllms_base_its_hooks_are_the_ones_vllm_calls() -> None:
    require("vllm", why="KVConnectorBase_V1 is vLLM's")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    hooks = ("get_num_new_matched_tokens", "update_state_after_alloc",
             "build_connector_meta", "request_finished")
    # three are abstract in vLLM's base; request_finished has a default the mixin overrides
    assert {h for h in hooks if h in KVConnectorBase_V1.__abstractmethods__} == set(hooks[:3])

    class Connector(SchedulerHooksMixin, KVConnectorBase_V1):  # type: ignore[misc]
        pass

    assert not set(hooks) & Connector.__abstractmethods__
    for hook in hooks:
        assert getattr(Connector, hook) is getattr(SchedulerHooksMixin, hook), hook
