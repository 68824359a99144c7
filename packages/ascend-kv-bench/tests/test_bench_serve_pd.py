# SPDX-License-Identifier: Apache-2.0
"""``bench serve``'s P/D flow (``serve_pd.pd_flow``) on stand-in engines: with ``fresh_p``
P's prefix cache is reset before each of its requests, and each row says how much P found
cached, so a repeat that hit P's own cache is never compared as a prefill."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.bench.serve.compare import computed_by_p
from vllm_ascend.distributed.kv_transfer.bench.serve.pd import pd_flow


class _Engine:
    """An engine with a prefix cache of whole prompts: a prompt seen since the last reset
    is a hit (every token but the last cached, 0.01 s), else computed (1.0 s)."""

    def __init__(self, *, kv_out: dict[str, Any] | None = None) -> None:
        self.seen: set[tuple[int, ...]] = set()
        self.ops: list[str] = []
        self.kv_out = kv_out

    def call(self, op: str, **_: Any) -> Any:
        self.ops.append(op)
        if op == "reset_prefix_cache":
            self.seen.clear()
        return True

    def generate(self, prompts: list[list[int]], *, kv_params: Any = None,
                 **_: Any) -> dict[str, Any]:
        self.ops.append("generate")
        key = tuple(prompts[0])
        hit = key in self.seen
        self.seen.add(key)
        return {"seconds": 0.01 if hit else 1.0, "ended_at": 0.0,
                "outputs": [{"tokens": [7], "cached": len(key) - 1 if hit else 0,
                             "finish_reason": "length", "kv_transfer_params": self.kv_out}]}


def _run() -> Any:
    return SimpleNamespace(warmup=[9] * 4, pd_prompts=[[1] * 8], round=1, binding=None,
                           cfg=SimpleNamespace(repeats=3, block_size=4),
                           steps=SimpleNamespace(note=lambda _msg: None))


def _params(_key: str) -> tuple[dict[str, Any], Any]:
    return {"do_remote_decode": True}, lambda p_out: dict(p_out or {})


@pytest.mark.parametrize("fresh", [False, True])
def test_p_computes_every_repeat_only_with_fresh_p(fresh: bool) -> None:
    p, d = _Engine(kv_out={"do_remote_prefill": True}), _Engine()
    rows = pd_flow(_run(), p, d, "pd/x", _params, fresh_p=fresh)["prompts"]
    (row,) = rows
    if fresh:
        # a reset right before each P request (the warm-up's and the 3 repeats')
        assert p.ops == ["reset_prefix_cache", "generate"] * 4
        assert row["p_cached_samples"] == [0, 0, 0]
        assert computed_by_p(row) == (1.0, pytest.approx(1.0 + 1.0))
    else:
        assert "reset_prefix_cache" not in p.ops
        # the first repeat computed; the two after it hit P's own cache
        assert row["p_cached_samples"] == [0, 7, 7]
        assert computed_by_p(row)[0] == 1.0
    assert len(row["pd_total_samples"]) == 3


@pytest.mark.parametrize("scenario", ["sc_pd_vllm_mooncake", "sc_pd_nixl"])
def test_the_peers_p_computes_every_prompt_as_ours_does(
        monkeypatch: pytest.MonkeyPatch, scenario: str) -> None:
    from vllm_ascend.distributed.kv_transfer.bench.serve import builtin as serve_peers

    seen: dict[str, Any] = {}

    def run_pd(_run: Any, name: str, *_a: Any, **kw: Any) -> dict[str, Any]:
        seen.update(name=name, fresh_p=kw.get("fresh_p"))
        return {}

    monkeypatch.setattr(serve_peers, "run_pd", run_pd)
    run = SimpleNamespace(memo={}, binding="pinned", cfg=SimpleNamespace(nixl_python=None))
    getattr(serve_peers, scenario)(run)
    assert seen["name"].startswith("pd/vllm-") and seen["fresh_p"] is True
