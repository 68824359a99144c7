# SPDX-License-Identifier: Apache-2.0
"""``bench router`` without engines: the scaled workload, the best achievable hit rate, the
counter deltas read from ``/metrics``, the policy order, and ``--no-engines`` writing its
JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.bench import router as br


def test_load_trace_keeps_order_and_cuts_prompts(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": i, "hash_ids": ids}) for i, ids in
                               enumerate([[0, 1, 2, 3], [0, 4], [], [0, 1, 2, 5, 6]])) + "\n")
    assert br.load_trace(trace, 3, 3) == [[0, 1, 2], [0, 4], [0, 1, 2]]
    assert br.load_trace(trace, 10, 8) == [[0, 1, 2, 3], [0, 4], [0, 1, 2, 5, 6]]


def test_scale_maps_each_hash_id_to_one_fixed_block() -> None:
    prompts = br.scale([[7, 8], [7, 9], [8]], block=4, vocab=50, seed=1)
    assert [len(p) for p in prompts] == [8, 8, 4]
    assert prompts[0][:4] == prompts[1][:4]  # a shared hash id, a shared prefix
    assert prompts[0][4:] != prompts[1][4:]
    assert prompts[2] == prompts[0][4:]  # the same block wherever it appears
    assert all(3 <= t < 50 for p in prompts for t in p)
    assert br.scale([[7, 8]], 4, 50, seed=1) == prompts[:1]  # deterministic


def test_best_achievable_counts_prefix_chains_like_vllm() -> None:
    # request 2 shares 2 blocks; request 3 repeats request 1 whole, but vLLM computes its
    # last token, so 3 of its 4 blocks hit; request 4 holds block 1 behind another first
    # block: a different chain, no hit.
    hashes = [[0, 1, 2, 3], [0, 1, 5], [0, 1, 2, 3], [9, 1]]
    best = br.best_achievable(hashes, block=16)
    assert best["query_tokens"] == 16 * (4 + 3 + 4 + 2)
    assert best["hit_tokens"] == 16 * (0 + 2 + 3 + 0)
    assert best["rate"] == pytest.approx(5 / 13)
    assert br.best_achievable([], 16)["rate"] is None


METRICS_P = """# HELP vllm:prefix_cache_queries_total Prefix cache queries
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
"""


def test_prefix_counts_and_hit_rate_from_deltas() -> None:
    before = br.prefix_counts([METRICS_P, METRICS_P.replace("640.0", "10.0").replace(
        "96.0", "0.0")])
    assert before == {"hits": 96.0, "queries": 650.0}
    after = {"hits": 96.0 + 32.0, "queries": 650.0 + 128.0}
    assert br.hit_rate(before, after) == {"hit_tokens": 32.0, "query_tokens": 128.0,
                                          "hit_rate": 0.25}
    assert br.hit_rate(before, before)["hit_rate"] is None


def test_prefill_time_per_p() -> None:
    text = ('vllm:request_prefill_time_seconds_sum{engine="0"} 1.5\n'
            'vllm:request_prefill_time_seconds_count{engine="0"} 10.0\n'
            'vllm:request_prefill_time_seconds_bucket{engine="0",le="1.0"} 9.0\n')
    before = br.prefill_time([text, ""])
    assert before == [(1.5, 10.0), (0.0, 0.0)]
    after = [(2.5, 14.0), (0.0, 0.0)]
    assert br.prefill_delta(before, after) == {"p_prefill_s": 1.0,
                                               "p_prefill_mean_ms": [250.0, None]}


def test_decisions_by_role_policy_reason() -> None:
    text = ("# TYPE vllm_ascend_pd_proxy_routing_decisions_total counter\n"
            'vllm_ascend_pd_proxy_routing_decisions_total{policy="kv_aware",reason="prefix",'
            'role="prefill"} 5.0\n'
            'vllm_ascend_pd_proxy_routing_decisions_total{policy="kv_aware",reason="no_hit",'
            'role="prefill"} 2.0\n'
            'vllm_ascend_pd_proxy_routing_decisions_created{policy="kv_aware"} 1.0\n')
    assert br.decisions(text) == {"prefill/kv_aware/prefix": 5.0,
                                  "prefill/kv_aware/no_hit": 2.0}


def test_ttft_summary_and_order() -> None:
    s = br.ttft_summary([0.1, 0.2, 0.3, 0.4])
    assert s["ttft_mean_ms"] == pytest.approx(250.0)
    assert s["ttft_p50_ms"] == pytest.approx(250.0)
    assert s["ttft_p99_ms"] == pytest.approx(397.0)
    assert br.ttft_summary([])["ttft_mean_ms"] is None
    assert br.order(0) == list(br.POLICIES) and br.order(1) == list(reversed(br.POLICIES))


def test_synthetic_workload_shares_prefixes() -> None:
    hashes = br.synthetic_trace(50, 8)
    assert len(hashes) == 50 and all(0 < len(h) <= 8 for h in hashes)
    assert br.best_achievable(hashes, 16)["rate"] > 0.3


def test_no_engines_writes_workload_and_best(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    br.add_parser(parser.add_subparsers())
    args = parser.parse_args(["router", "--no-engines", "--quick", "--out", str(tmp_path),
                              "--trace", str(tmp_path / "missing.jsonl")])
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "router.json").read_text())
    assert doc["benchmark"] == "router" and doc["status"] == "not run" and doc["runs"] == []
    assert doc["workload"]["source"].startswith("synthetic")
    assert doc["workload"]["requests"] == br.QUICK_REQUESTS
    assert 0 < doc["best_achievable"]["rate"] < 1


def test_every_request_and_counter_of_each_round_goes_to_the_ledger(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.bench import ledger

    def fake_rounds(cfg: br.RouterConfig, steps: object) -> tuple[list[dict[str, object]], None]:
        rows: list[dict[str, object]] = []
        for r in range(cfg.rounds):
            for i, policy in enumerate(br.order(r)):
                rows.append({"round": r + 1, "policy": policy, "hit_tokens": 10.0 * i,
                             "query_tokens": 100.0, "ttfts_s": [0.1 + r, 0.2 + r],
                             "completed": 2, "failed": 0})
        # a policy whose proxy did not start in round 2: a round without samples
        rows[-1] = {"round": 2, "policy": rows[-1]["policy"], "completed": 0, "failed": 2}
        return rows, None

    monkeypatch.setattr(br, "run_rounds", fake_rounds)
    monkeypatch.setattr("vllm_ascend.distributed.kv_transfer.bench.client.model."
                        "make_served_model", lambda path, spec: path)
    parser = argparse.ArgumentParser()
    br.add_parser(parser.add_subparsers())
    args = parser.parse_args(["router", "--quick", "--rounds", "2", "--out", str(tmp_path),
                              "--trace", str(tmp_path / "missing.jsonl"),
                              "--ledger", str(tmp_path / "ledger")])
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "router.json").read_text())
    assert all("ttfts_s" not in r for r in doc["runs"])  # the samples live in the ledger
    (entry,) = ledger.read_entries(tmp_path / "ledger", "router")
    last = br.order(1)[-1]
    for policy in br.POLICIES:
        (ttft,) = ledger.entry_samples(entry, policy=policy, what="ttfts_s")
        (hits,) = ledger.entry_samples(entry, policy=policy, what="hit_tokens")
        assert ttft["rounds"][0] == [0.1, 0.2] and len(hits["rounds"]) == 2
        assert ttft["rounds"][1] == ([] if policy == last else [1.1, 1.2])


def test_policies_name_ours_and_vllm_routers() -> None:
    assert br.parse_policies("kv_aware, vllm-router:round_robin,kv_aware") == (
        "kv_aware", "vllm-router:round_robin")
    assert br.order(1, ("a", "b", "c")) == ["c", "b", "a"]
    for bad in ("best", "vllm-router:least_loaded", " , "):
        with pytest.raises(ValueError, match="unknown policies"):
            br.parse_policies(bad)


def test_a_bad_policy_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    br.add_parser(parser.add_subparsers())
    args = parser.parse_args(["router", "--no-engines", "--quick", "--out", str(tmp_path),
                              "--policies", "kv_aware,vllm-router:least_loaded"])
    assert args.func(args) == 2
    assert "unknown policies ['vllm-router:least_loaded']" in capsys.readouterr().err
    assert not (tmp_path / "router.json").exists()


def test_vllm_router_is_started_with_each_ps_events(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """What vllm-router is given: both P, the D, and for kv_aware each P's PUB endpoint."""
    from vllm_ascend.distributed.kv_transfer.bench.fleet import routers

    started: list[list[str]] = []
    monkeypatch.setattr(routers.Router, "start",
                        lambda self, timeout=0.0: started.append(self.cmd) or self)
    monkeypatch.setattr(routers, "vllm_router_binary", lambda: "/bin/vllm-router")

    class Eng:
        def __init__(self, port: int) -> None:
            self.url = f"http://127.0.0.1:{port}"

    engines = [Eng(1), Eng(2), Eng(3)]
    events = ["tcp://127.0.0.1:11,tcp://127.0.0.1:12", "tcp://127.0.0.1:21,tcp://127.0.0.1:22"]
    br.start_proxy("vllm-router:kv_aware", engines, events, None, tmp_path)  # type: ignore[arg-type]
    cmd = started[-1]
    assert cmd[0] == "/bin/vllm-router" and "--vllm-pd-disaggregation" in cmd
    assert cmd[cmd.index("--policy") + 1] == "kv_aware"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--prefill"] == [e.url for e in engines[:2]]
    assert cmd[cmd.index("--decode") + 1] == engines[2].url
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--pd-kv-events"] == [
        "http://127.0.0.1:1=tcp://127.0.0.1:11", "http://127.0.0.1:2=tcp://127.0.0.1:21"]


def test_send_all_streams_every_prompt_on_kept_connections() -> None:
    """The driver's requests: every prompt's TTFT, a failure counted (not raised), and each
    sending thread's requests on one kept-alive connection (not one per request)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    peers: list[tuple[str, int]] = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_a: object) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            peers.append(self.client_address)
            if body["prompt"] == [0]:
                out, code = b'{"error": "bad prompt"}', 500
            else:
                assert body["stream"] is True and body["max_tokens"] == 2
                chunk = json.dumps({"choices": [{"text": "x"}]})
                out, code = f"data: {chunk}\n\ndata: {chunk}\n\ndata: [DONE]\n\n".encode(), 200
            self.send_response(code)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        prompts = [[1, 2, 3]] * 11 + [[0]]
        ttfts, errors = br.send_all(base, "m", prompts, output_len=2, concurrency=2)
    finally:
        server.shutdown()
        server.server_close()
    assert len(ttfts) == 11 and all(0 < t < 10 for t in ttfts)
    assert len(errors) == 1 and "HTTP 500" in errors[0]
    assert len(peers) == 12 and len(set(peers)) <= 2  # one connection per sending thread
