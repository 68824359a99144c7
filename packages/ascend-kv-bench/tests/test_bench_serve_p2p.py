# SPDX-License-Identifier: Apache-2.0
"""``bench serve``'s layerwise P/D flow (``kv_p2p.tooling.serve``) on stand-in engines: D
first, its post to the metaserver, P with what D posted, D's time after P."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.bench.serve import p2p as p2p_serve
from vllm_ascend.distributed.kv_transfer.bench.serve.compare import PD_REQUEST


def _post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


class _D:
    """D's engine: posts its blocks (as the layerwise scheduler does), then answers once P
    has prefilled, 30 ms after P's end."""

    def __init__(self, p: _P, post: bool = True) -> None:
        self.p, self.post = p, post
        self.asked: list[Any] = []

    def generate(self, prompts: list[list[int]], *, kv_params: list[dict[str, Any]],
                 **_: Any) -> dict[str, Any]:
        kv = kv_params[0]
        self.asked.append(kv)
        if self.post:
            body = {"request_id": kv["request_id"], "remote_block_ids": [3, 4],
                    "do_remote_decode": True}
            assert _post(kv["metaserver"], json.dumps(body).encode()) == 200
        if not self.p.done.wait(5):
            raise TimeoutError("P never prefilled")
        return {"seconds": 0.5, "ended_at": self.p.ended_at + 0.03, "external_tokens": 2,
                "kv_wait_s": [0.45],
                "outputs": [{"tokens": [7], "finish_reason": "length"}]}


class _P:
    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.done = threading.Event()
        self.ended_at = 0.0

    def call(self, op: str, **_: Any) -> Any:
        self.calls.append(op)
        return True

    def generate(self, prompts: list[list[int]], *, kv_params: list[dict[str, Any]],
                 **_: Any) -> dict[str, Any]:
        self.calls.append(("generate", kv_params[0]))
        self.ended_at = time.time()
        self.done.set()
        return {"seconds": 0.2, "ended_at": self.ended_at, "outputs": [{"tokens": [7]}]}


def test_d_first_p_with_what_d_posted_and_d_timed_after_p() -> None:
    meta = p2p_serve.Metaserver()
    try:
        p = _P()
        d = _D(p)
        pout, dout, after = p2p_serve.layerwise_sample(meta)(p, d, [1, 2, 3], "pinned-1-0-0")
        (kv,) = d.asked
        assert kv["do_remote_prefill"] is True and kv["metaserver"] == meta.url
        assert kv["request_id"].startswith("lw-pinned-1-0-0-")
        # P's prefix cache was reset first (P computes, and pushes as it goes), then P got
        # D's post as its kv_transfer_params
        assert p.calls[0] == "reset_prefix_cache"
        assert p.calls[1] == ("generate", {"request_id": kv["request_id"],
                                           "remote_block_ids": [3, 4],
                                           "do_remote_decode": True})
        assert after == pytest.approx(0.03)
        assert 0.03 <= dout["pd_total_s"] < 5
        assert dout["kv_wait_s"] is None  # D's scheduler waited through P's prefill
        assert pout["seconds"] == 0.2 and meta.posts == {}  # each post taken once
        # a post that is not a JSON object with a request_id is refused, and nothing kept
        assert _post(meta.url, b"not json") == 400
        assert _post(meta.url, b'{"no_id": 1}') == 400
        assert meta.posts == {}
    finally:
        meta.close()


def test_a_d_that_never_posts_fails_the_sample_and_p_is_not_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p2p_serve, "LAYERWISE_WAIT_S", 0.3)
    meta = p2p_serve.Metaserver()
    try:
        p = _P()
        d = _D(p, post=False)
        p.done.set()  # let D's thread end
        with pytest.raises(RuntimeError, match="D posted no blocks for lw-k-"):
            p2p_serve.layerwise_sample(meta)(p, d, [1], "k")
        assert p.calls == ["reset_prefix_cache"]
    finally:
        meta.close()


def test_the_layerwise_scenario_is_declared_with_its_comparisons() -> None:
    (pull, tcp, lw) = p2p_serve.scenarios()
    assert (pull.name, tcp.name, lw.name) == ("pd/ours", "pd/ours-tcp", "pd/ours-layerwise")
    assert lw.family == "pd" and lw.who == "ours" and not lw.quick
    peers = {(c.peer, c.metric): c for c in lw.comparisons}
    assert set(peers) == {("pd/vllm-nixl", p2p_serve.TTFT), ("pd/vllm-mooncake", p2p_serve.TTFT),
                          ("pd/ours", p2p_serve.TTFT), ("pd/ours", PD_REQUEST)}
    # against vLLM's connectors the overheads get the report's P/D goal (<= 0.8); against
    # our own pull, a plain comparison, and P's prefill and the whole request beside it
    assert peers["pd/vllm-mooncake", p2p_serve.TTFT].overhead_goal is None
    own = peers["pd/ours", p2p_serve.TTFT].overhead_goal
    assert own is not None and own.at_most is None and own.at_least is None
    assert peers["pd/ours", PD_REQUEST].goal is None


def test_the_pull_over_tcp_is_declared_as_a_reference_of_the_same_host_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    (pull, tcp, _lw) = p2p_serve.scenarios()
    assert tcp.family == "pd" and tcp.who == "ours" and not tcp.quick
    # over TCP against the peer whose bytes take the same transport, with no goal
    (over_tcp,) = tcp.comparisons
    assert over_tcp.peer == "pd/vllm-mooncake" and over_tcp.metric == p2p_serve.TTFT
    assert over_tcp.goal is None and over_tcp.overhead_goal is not None
    assert over_tcp.overhead_goal.at_most is None and over_tcp.overhead_goal.at_least is None
    # P's prefill and the whole request against both peers (their P computes too)
    assert {c.peer for c in pull.comparisons if c.metric == PD_REQUEST} == {
        "pd/vllm-nixl", "pd/vllm-mooncake"}
    ref = next(c for c in pull.comparisons if c.peer == "pd/ours-tcp")
    assert ref.metric == p2p_serve.TTFT and ref.goal is None
    assert ref.overhead_goal is not None and ref.overhead_goal.at_most is None
    # both engines start with same-host reads off
    seen: dict[str, Any] = {}

    def run_pd(run: Any, name: str, p_kv: Any, d_kv: Any, params: Any, **kw: Any) -> Any:
        seen.update(name=name, **kw)
        return {}

    monkeypatch.setattr(p2p_serve, "run_pd", run_pd)
    p2p_serve.sc_pd_ours_tcp(object())  # type: ignore[arg-type]
    off = {"VLLM_ASCEND_KV_LOCAL_READS": "0"}
    assert seen == {"name": "pd/ours-tcp", "p_env": off, "d_env": off, "fresh_p": True}
