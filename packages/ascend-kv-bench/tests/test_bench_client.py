# SPDX-License-Identifier: Apache-2.0
"""``bench client`` without engines: the command lines it builds (vLLM's own client parser
accepts them), the summary of vLLM's result JSON, failures recorded rather than raised, and
the tokenizer whose random prompts keep their lengths."""

from __future__ import annotations

import json
import random
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.procs import group_states
from ascend_kv_testing.requires import require
from vllm_ascend.distributed.kv_transfer.bench.client import command as bc
from vllm_ascend.distributed.kv_transfer.bench.client import deploy, procs
from vllm_ascend.distributed.kv_transfer.bench.client import model as bm

#: The shape of ``vllm bench serve --save-result`` (vLLM 0.32) with
#: ``--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99``.
RESULT: dict[str, Any] = {
    "date": "20261201-170000", "backend": "vllm", "num_prompts": 4, "max_concurrency": 4,
    "duration": 2.0, "completed": 3, "failed": 1, "total_input_tokens": 3000,
    "total_output_tokens": 96, "request_throughput": 1.5, "output_throughput": 48.0,
    "total_token_throughput": 1548.0,
    "mean_ttft_ms": 120.0, "median_ttft_ms": 110.0, "std_ttft_ms": 5.0, "p50_ttft_ms": 111.0,
    "p99_ttft_ms": 190.0, "mean_tpot_ms": 20.0, "median_tpot_ms": 19.0, "p50_tpot_ms": 19.5,
    "p99_tpot_ms": 30.0, "mean_itl_ms": 21.0, "p50_itl_ms": 18.0, "p99_itl_ms": 40.0,
    "mean_e2el_ms": 800.0, "p50_e2el_ms": 790.0, "p99_e2el_ms": 900.0,
    "errors": ["", "", "", "Traceback ...\naiohttp.ClientResponseError: 500"],
}


def test_summarize_reads_vllm_result() -> None:
    row = procs.summarize(RESULT)
    assert row["completed"] == 3 and row["failed"] == 1
    assert row["output_tok_per_s"] == 48.0 and row["duration_s"] == 2.0
    assert (row["ttft_mean_ms"], row["ttft_p50_ms"], row["ttft_p99_ms"]) == (120.0, 111.0, 190.0)
    assert (row["tpot_mean_ms"], row["tpot_p50_ms"], row["tpot_p99_ms"]) == (20.0, 19.5, 30.0)
    assert row["e2el_p99_ms"] == 900.0
    assert row["errors"] == ["Traceback ...\naiohttp.ClientResponseError: 500"]


def test_summarize_falls_back_to_median_and_keeps_missing_as_none() -> None:
    doc = {k: v for k, v in RESULT.items() if not k.startswith("p50_")}
    doc.pop("errors")
    doc["failed"] = 0
    row = procs.summarize(doc)
    assert row["ttft_p50_ms"] == 110.0 and row["tpot_p50_ms"] == 19.0
    assert row["itl_p50_ms"] is None  # no median_itl_ms either
    assert "errors" not in row and row["failed"] == 0


def test_failed_row_counts_every_request() -> None:
    row = procs.failed_row(32, "x" * 5000)
    assert row["failed"] == 32 and row["completed"] == 0 and len(row["errors"][0]) == 1500


def test_table_rows_one_per_target_and_concurrency() -> None:
    results = {
        "plain": {"status": "ok", "runs": [
            {"concurrency": 4, **procs.summarize(RESULT)}, {"concurrency": 8, **procs.summarize(RESULT)}]},
        "pd-vllm-mooncake": {"status": "not run", "reason": deploy.VLLM_PEERS_MISSING},
    }
    rows = bc.table_rows(results)
    assert [(r["target"], r["conc"]) for r in rows] == [("plain", 4), ("plain", 8),
                                                        ("pd-vllm-mooncake", "-")]
    assert rows[0]["ttft_p50_ms"] == 111.0 and rows[0]["out_tok_s"] == 48.0
    assert rows[2]["status"] == "not run"


def test_targets() -> None:
    ts = {t.name: t for t in bc.targets()}
    assert list(ts) == ["plain", "pd-pull", "pd-layerwise", "pd-pull-2p2d", "pd-vllm-mooncake",
                        "pd-vllm-nixl"]
    assert ts["plain"].kv is None and ts["plain"].proxy_mode is None
    assert ts["pd-pull"].kv["kv_connector"] == "MooncakeConnectorV1"  # type: ignore[index]
    assert ts["pd-pull"].proxy_mode == "pull"
    assert ts["pd-layerwise"].kv["kv_connector"] == "MooncakeLayerwiseConnector"  # type: ignore[index]
    assert ts["pd-layerwise"].proxy_mode == "layerwise"
    peer = ts["pd-vllm-mooncake"]
    assert peer.peer and peer.proxy_mode is None
    assert peer.kv == {"kv_connector": "MooncakeConnector",
                       "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}
    # P sends with 2 threads (as bench serve runs it on 2 cores); D's config is the target's
    p_kv = deploy.kv_config(peer, "kv_producer", "e-p", 1)
    assert p_kv["kv_connector_extra_config"] == {"mooncake_protocol": "tcp", "num_workers": 2}
    assert p_kv["engine_id"] == "e-p" and "num_workers" not in str(
        deploy.kv_config(peer, "kv_consumer", "e-d", 2))
    assert peer.kv["kv_connector_extra_config"] == {"mooncake_protocol": "tcp"}  # unchanged
    assert {t.name: t.peer for t in ts.values() if t.peer} == {"pd-vllm-mooncake": "mooncake",
                                                               "pd-vllm-nixl": "nixl"}
    # vLLM's NixlConnector: one role at both ends, behind our proxy's pull mode renewing no
    # lease (its side channel speaks NIXL's own messages, not our lease frames)
    nixl = ts["pd-vllm-nixl"]
    assert nixl.proxy_mode == "pull" and nixl.proxy_args == ("--lease-renew-interval", "0")
    for role in ("kv_producer", "kv_consumer"):
        kv = deploy.kv_config(nixl, role, "e-n", 3, {"inline_reads": True})
        assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_port": 3,
                      "engine_id": "e-n"}
    assert ts["pd-pull-2p2d"].instances == 2 and ts["pd-pull-2p2d"].kv == ts["pd-pull"].kv
    kv = deploy.kv_config(ts["pd-pull"], "kv_consumer", "e-d", 5555)
    assert kv["kv_role"] == "kv_consumer" and kv["kv_port"] == 5555 and kv["engine_id"] == "e-d"
    assert kv["kv_load_failure_policy"] == "fail"


def test_pull_config_reaches_our_pull_engines_only() -> None:
    """``--pull-config``: checked as the connector checks it, merged into the extra config
    of ``MooncakeConnectorV1``'s P and D (both P/D pull targets), never a peer's."""
    extra = bc.pull_config('{"inline_reads": true, "num_recv_workers": 2}')
    assert extra == {"inline_reads": True, "num_recv_workers": 2}
    assert bc.pull_config("  ") is None
    ts = {t.name: t for t in bc.targets()}
    for name in ("pd-pull", "pd-pull-2p2d"):
        for role in ("kv_producer", "kv_consumer"):
            kv = deploy.kv_config(ts[name], role, "e", 1, extra)
            assert kv["kv_connector_extra_config"] == {"load_timeout_s": 60, **extra}
    assert ts["pd-pull"].kv["kv_connector_extra_config"] == {  # type: ignore[index]
        "load_timeout_s": 60}  # the target itself unchanged
    for name in ("pd-layerwise", "pd-vllm-mooncake", "pd-vllm-nixl"):
        cfg = deploy.kv_config(ts[name], "kv_consumer", "e", 1, extra).get(
            "kv_connector_extra_config", {})
        assert "inline_reads" not in cfg
    for bad, why in (('{"inline_reads": "yes please"}', "inline_reads"),
                     ('{"no_such_key": 1}', "no_such_key"), ("[1]", "JSON object"),
                     ("{not json", "--pull-config")):
        with pytest.raises(SystemExit, match=why):
            bc.pull_config(bad)


def test_server_cmd_pins_and_carries_the_kv_config() -> None:
    kv = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer"}
    cmd = deploy.server_cmd("/py", "/m", 8100, block_size=128, max_model_len=1160, max_num_seqs=8,
                        kv=kv, cores=bc.P_CORES)
    assert cmd[:4] == ["taskset", "-c", "0", "/py"]
    assert cmd[4:6] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) == kv
    for flag, value in (("--model", "/m"), ("--port", "8100"), ("--block-size", "128"),
                        ("--max-model-len", "1160"), ("--max-num-seqs", "8")):
        assert cmd[cmd.index(flag) + 1] == value
    plain = deploy.server_cmd("/py", "/m", 1, block_size=32, max_model_len=64, max_num_seqs=4)
    assert plain[0] == "/py" and "--kv-transfer-config" not in plain
    assert deploy.engine_env("1")["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert deploy.engine_env("0-1")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"


def test_proxy_cmd() -> None:
    cmd = deploy.proxy_cmd("/py", "layerwise", "http://p", "http://d", 9000)
    assert cmd[:3] == ["/py", "-m", deploy.PROXY_MODULE]
    assert deploy.proxy_cmd("/py", "pull", "http://p", "http://d", 9000, ("--x", "1"))[-2:] == [
        "--x", "1"]
    for flag, value in (("--mode", "layerwise"), ("--prefill", "http://p"),
                        ("--decode", "http://d"), ("--port", "9000")):
        assert cmd[cmd.index(flag) + 1] == value


def _client_args(tmp_path: Path) -> list[str]:
    return procs.client_cmd("/py", "http://127.0.0.1:9000", "/m", num_prompts=32, concurrency=8,
                         input_len=1000, output_len=32, seed=101, result_dir=tmp_path,
                         result_file="r.json")


def test_client_cmd_is_accepted_by_vllms_own_parser(tmp_path: Path) -> None:
    cmd = _client_args(tmp_path)
    assert cmd[:3] == ["/py", "-m", procs.__name__]
    serve = require("vllm.benchmarks.serve")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(cmd[3:])
    assert (args.dataset_name, args.random_input_len, args.random_output_len) == (
        "random", 1000, 32)
    assert (args.num_prompts, args.max_concurrency, args.seed) == (32, 8, 101)
    assert args.base_url == "http://127.0.0.1:9000" and args.endpoint == "/v1/completions"
    assert args.backend == "vllm" and args.ignore_eos and args.save_result
    assert args.result_dir == str(tmp_path) and args.result_filename == "r.json"
    assert args.percentile_metrics == "ttft,tpot,itl,e2el"
    assert args.metric_percentiles == "50,99"


def _fake_python(tmp_path: Path, body: str) -> str:
    """An interpreter stand-in running ``body`` with the client's arguments in ``argv``."""
    script = tmp_path / "fakepy"
    script.write_text(f"#!{sys.executable}\nimport json, sys\nargv = sys.argv\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_run_client_summarizes_the_saved_result(tmp_path: Path) -> None:
    py = _fake_python(tmp_path, (
        "d = argv[argv.index('--result-dir') + 1]\n"
        "f = argv[argv.index('--result-filename') + 1]\n"
        f"open(d + '/' + f, 'w').write(json.dumps({RESULT!r}))"))
    row = procs.run_client(py, "http://x", "/m", num_prompts=4, concurrency=4, input_len=10,
                        output_len=2, seed=1, work=tmp_path, timeout=60)
    assert row["completed"] == 3 and row["ttft_p99_ms"] == 190.0


def test_run_client_records_a_crash_as_failed_requests(tmp_path: Path) -> None:
    py = _fake_python(tmp_path, "print('ValueError: Initial test run failed'); sys.exit(1)")
    row = procs.run_client(py, "http://x", "/m", num_prompts=4, concurrency=4, input_len=10,
                        output_len=2, seed=1, work=tmp_path, timeout=60)
    assert row["failed"] == 4 and row["completed"] == 0
    assert "exited with 1" in row["errors"][0] and "Initial test run failed" in row["errors"][0]


def _child(tmp_path: Path) -> procs.ClientProcess:
    """A ClientProcess whose child serves runs with a stand-in of vLLM's client: it writes
    the result (with its own pid as the TTFT p99), crashes on ``--seed 13``, hangs on 14."""
    code = (
        "import json, os, sys, time\n"
        "from vllm_ascend.distributed.kv_transfer.bench.client import procs\n"
        "def main(argv):\n"
        "    seed = argv[argv.index('--seed') + 1]\n"
        "    print('client run', seed)\n"
        "    if seed == '13':\n"
        "        raise ValueError('Initial test run failed')\n"
        "    if seed == '14':\n"
        "        time.sleep(60)\n"
        "    d = argv[argv.index('--result-dir') + 1]\n"
        "    f = argv[argv.index('--result-filename') + 1]\n"
        f"    result = dict({RESULT!r}, p99_ttft_ms=float(os.getpid()))\n"
        "    open(d + '/' + f, 'w').write(json.dumps(result))\n"
        "    return 0\n"
        "sys.exit(procs.serve_runs(main))\n")
    return procs.ClientProcess(sys.executable, cmd=[sys.executable, "-c", code])


def test_one_client_process_serves_every_run(tmp_path: Path) -> None:
    """vLLM imported once: the runs go to one child, each its own log and result; a run
    that fails is a failed row and the child serves the next; one past its timeout costs
    the child, and the next run gets a new one."""
    client = _child(tmp_path)

    def run(seed: int, timeout: float = 60) -> dict[str, Any]:
        return procs.run_client("/unused", "http://x", "/m", num_prompts=4, concurrency=4,
                                input_len=10, output_len=2, seed=seed, work=tmp_path,
                                timeout=timeout, client=client)

    try:
        first, second = run(1), run(2)
        assert first["completed"] == 3 and second["completed"] == 3
        assert first["ttft_p99_ms"] == second["ttft_p99_ms"]  # the same child's pid
        assert client.started == 1
        assert "client run 1" in (tmp_path / "client-c4-s1.log").read_text()
        assert "client run 2" in (tmp_path / "client-c4-s2.log").read_text()
        crashed = run(13)
        assert crashed["failed"] == 4 and "exited with 1" in crashed["errors"][0]
        assert "Initial test run failed" in crashed["errors"][0]
        assert run(3)["ttft_p99_ms"] == first["ttft_p99_ms"] and client.started == 1
        hung = run(14, timeout=2)
        assert hung["failed"] == 4 and "ran past 2s" in hung["errors"][0]
        after = run(4)
        assert after["completed"] == 3 and after["ttft_p99_ms"] != first["ttft_p99_ms"]
        assert client.started == 2
    finally:
        client.close()
    assert client.proc is None


def test_run_target_not_run_needs_no_engine(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.bench.benchutil import Steps

    cfg = bc.ClientConfig(model="/m", vocab=1024, num_prompts=4, concurrency=(4,),
                          input_len=10, output_len=2, block_size=32, out=tmp_path)
    # a peers' directory without the harness: vLLM's MooncakeConnector target is not run
    monkeypatch.setenv("VLLM_ASCEND_KV_BENCH_PEERS", str(tmp_path))
    assert deploy.peers_dir() is None
    target = next(t for t in bc.targets() if t.peer)
    entry = bc.run_target(target, cfg, Steps(1, "t"), tmp_path)
    assert entry["status"] == "not run" and entry["reason"] == deploy.VLLM_PEERS_MISSING
    assert cfg.max_model_len == 10 + 2 + 32


def test_peers_dir_needs_the_patch_and_the_proxy(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.bench.serve.needs import PATCH_MODULE

    monkeypatch.setenv("VLLM_ASCEND_KV_BENCH_PEERS", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / f"{PATCH_MODULE}.py").write_text("")
    assert deploy.peers_dir() is None  # the patch without the proxy
    (tmp_path / deploy.PEER_PROXY).write_text("")
    assert deploy.peers_dir() == str(tmp_path.resolve())
    monkeypatch.delenv("VLLM_ASCEND_KV_BENCH_PEERS")  # by default, the shipped ones
    assert deploy.peers_dir() == str(deploy.PEERS_DIR.resolve())


def test_peer_env_loads_the_cpu_patch_in_every_python_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    peers = tmp_path / "peers"
    peers.mkdir()
    (peers / "vllm_mooncake_cpu_patch.py").write_text(
        "import os, sys\nsys.stdout.write(f'patched {os.getpid()}\\n'); sys.stdout.flush()\n")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = procs.peer_env(str(peers), tmp_path / "site")
    assert env["PYTHONPATH"].split(":") == [str(tmp_path / "site"), str(peers), "/elsewhere"]
    # a child process, and a process it spawns (as vLLM's CPU engine core is), both run the
    # patch before their own code
    script = tmp_path / "main.py"
    script.write_text(
        "import multiprocessing as mp, os, sys\n"
        "def show():\n"
        "    sys.stdout.write(f'child {os.getpid()}\\n'); sys.stdout.flush()\n"
        "if __name__ == '__main__':\n"
        "    sys.stdout.write(f'parent {os.getpid()}\\n'); sys.stdout.flush()\n"
        "    p = mp.get_context('spawn').Process(target=show)\n"
        "    p.start(); p.join()\n")
    out = subprocess.run([sys.executable, str(script)], env={**procs.os.environ, **env},
                         capture_output=True, text=True, timeout=60, check=True).stdout
    said = [line.split() for line in out.splitlines()]
    patched = {pid for what, pid in said if what == "patched"}
    ran = {what: pid for what, pid in said if what in ("parent", "child")}
    assert set(ran) == {"parent", "child"} and ran["parent"] != ran["child"]
    assert set(ran.values()) <= patched


@pytest.mark.parametrize("vocab", [1024, 8192])
def test_word_tokenizer_keeps_random_prompt_lengths(tmp_path: Path, vocab: int) -> None:
    require("tokenizers", dist="tokenizers", why="write_tokenizer builds it with tokenizers")
    from transformers import AutoTokenizer

    bm.write_tokenizer(tmp_path, vocab)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == vocab and tok.num_special_tokens_to_add() == 0
    assert sorted(tok.all_special_ids) == [0, 1, 2]
    rng = random.Random(0)
    ids = [rng.randrange(3, vocab) for _ in range(1000)]
    text = tok.decode(ids)
    assert tok.encode(text, add_special_tokens=False) == ids
    # vLLM's API server refuses a prompt over 5 characters a token of max_model_len
    assert len(text) < 4 * len(ids)


def test_words_are_unique_and_short() -> None:
    words = [bm.word(i) for i in range(3, 200_000)]
    assert len(set(words)) == len(words) and max(map(len, words)) == 3
    assert bm.word(0) == "0" and bm.word(61) == "Z" and bm.word(62) == "10"


def test_an_older_tokenizer_is_replaced(tmp_path: Path) -> None:
    require("tokenizers", dist="tokenizers", why="write_tokenizer builds it with tokenizers")
    (tmp_path / "tokenizer.json").write_text("{}")  # no stamp: written by an older version
    bm.write_tokenizer(tmp_path, 64)
    assert (tmp_path / bm.TOKENIZER_STAMP).read_text() == "base62 64"
    assert "tokenizer.json" in {p.name for p in tmp_path.iterdir()}
    assert json.loads((tmp_path / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"


def test_scrape_and_transfer_delta(monkeypatch: pytest.MonkeyPatch) -> None:
    text = ('# HELP x\nvllm:ascend_kv_p2p_requests_loaded_total{engine="0"} 3.0\n'
            'vllm:ascend_kv_p2p_requests_loaded_total{engine="1"} 2.0\n'
            'vllm:ascend_kv_p2p_requests_loaded_totalx 100.0\n'
            'vllm:ascend_kv_p2p_failures_total 0.0\n'
            'vllm:ascend_kv_p2p_window_reads_total 4.0\n'
            'vllm:ascend_kv_p2p_inline_reads_total 3.0\n')
    assert procs.scrape(text, procs.LOADED) == 5.0 and procs.scrape(text, procs.FAILURES) == 0
    pages = {"http://d/metrics": text.encode(), "http://x/status": b'{"fallbacks": 1}',
             "http://d2/metrics": b"vllm:ascend_kv_p2p_requests_loaded_total 4.0\n"}
    monkeypatch.setattr(procs, "_get", lambda url: pages[url])
    assert procs.transfer_counts(["http://d"], "http://x") == {
        "kv_loaded": 5.0, "kv_failures": 0.0, "proxy_fallbacks": 1.0, "kv_tokens": 0.0,
        "window_reads": 4.0, "inline_reads": 3.0}
    delta = procs.transfer_delta({"kv_loaded": 1.0, "kv_failures": 0.0, "proxy_fallbacks": 1.0,
                                  "kv_tokens": 0.0, "window_reads": 1.0, "inline_reads": 1.0},
                                 ["http://d"], "http://x", expect=4, timeout=0)
    assert delta == {"kv_loaded": 4.0, "kv_failures": 0.0, "proxy_fallbacks": 0.0,
                     "kv_tokens": 0.0, "window_reads": 3.0, "inline_reads": 2.0}
    # several D's: their counters add up
    assert procs.transfer_counts(["http://d", "http://d2"], "http://x")["kv_loaded"] == 9.0


def test_tokens_loaded_by_any_connector_from_vllms_own_counter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's D with its own MooncakeConnector: none of our counters, vLLM's by source
    text = ('vllm:prompt_tokens_by_source_total{engine="0",model_name="m",'
            'source="local_compute"} 8.0\n'
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",'
            'source="external_kv_transfer"} 7992.0\n'
            'vllm:prompt_tokens_by_source_created{engine="0",model_name="m",'
            'source="external_kv_transfer"} 1.7e9\n')
    assert procs.scrape(text, procs.BY_SOURCE, procs.EXTERNAL) == 7992.0
    assert procs.scrape(text, procs.BY_SOURCE) == 8000.0
    assert not procs.has_series(text, procs.LOADED) and procs.has_series(text, procs.BY_SOURCE)
    monkeypatch.setattr(procs, "_get", lambda url: text.encode() if url.endswith("/metrics")
                        else b'{"fallbacks": 0}')
    counts = procs.transfer_counts(["http://d"], "http://x")
    assert counts == {"kv_tokens": 7992.0, "proxy_fallbacks": 0.0}  # no kv_loaded to show
    # nothing to wait for without our counter: the first reading is the delta
    assert procs.transfer_delta({"kv_tokens": 992.0, "proxy_fallbacks": 0.0}, ["http://d"],
                                "http://x", expect=8, timeout=60) == {
        "kv_tokens": 7000.0, "proxy_fallbacks": 0.0}


def test_held_after_waits_for_the_ps_to_free_and_served_reads_the_proxy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    held = {"http://p0": [2.0, 1.0, 0.0], "http://p1": [0.0]}

    def get(url: str) -> bytes:
        if url == "http://x/status":
            return json.dumps({"prefill": [{"url": "http://p0", "served": 5}],
                               "decode": [{"url": "http://d0", "served": 4}]}).encode()
        values = held[url.removesuffix("/metrics")]
        value = values.pop(0) if len(values) > 1 else values[0]
        return f"{procs.HELD}{{engine=\"0\"}} {value}\n".encode()

    monkeypatch.setattr(procs, "_get", get)
    monkeypatch.setattr(procs.time, "sleep", lambda _s: None)
    assert procs.held_after(["http://p0", "http://p1"], timeout=5) == 0
    held["http://p0"] = [3.0]  # never freed: the count once the wait is over
    assert procs.held_after(["http://p0"], timeout=0) == 3.0
    assert procs.served("http://x") == {"http://p0": 5, "http://d0": 4}


def test_dataset_args_and_the_proxy_in_front_of_several_instances() -> None:
    assert bc.dataset_args("random", 1000, 32, 128) == ()
    args = bc.dataset_args("prefix_repetition", 1000, 32, 128)
    opt = dict(zip(args[::2], args[1::2], strict=True))
    assert opt["--dataset-name"] == "prefix_repetition"
    # whole blocks of shared prefix, the prompt's length in all
    assert int(opt["--prefix-repetition-prefix-len"]) == 640
    assert int(opt["--prefix-repetition-prefix-len"]) \
        + int(opt["--prefix-repetition-suffix-len"]) == 1000
    assert opt["--prefix-repetition-output-len"] == "32"
    with pytest.raises(ValueError, match="unknown dataset"):
        bc.dataset_args("sharegpt", 1000, 32, 128)
    cmd = deploy.proxy_cmd("/py", "pull", ["http://p0", "http://p1"], ["http://d0", "http://d1"],
                       9000)
    pairs = list(zip(cmd, cmd[1:], strict=False))
    assert [v for k, v in pairs if k == "--prefill"] == ["http://p0", "http://p1"]
    assert [v for k, v in pairs if k == "--decode"] == ["http://d0", "http://d1"]
    fleet = next(t for t in bc.targets() if t.instances > 1)
    assert fleet.concurrency == (8, 16) and fleet.datasets == ("random", "prefix_repetition")


def test_select_and_pinning(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [t.name for t in bc.select("")] == [t.name for t in bc.targets()]
    assert [t.name for t in bc.select("pd-layerwise, plain")] == ["plain", "pd-layerwise"]
    with pytest.raises(SystemExit, match="unknown target"):
        bc.select("plain,nope")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in deploy.engine_env(None)
    monkeypatch.setattr(bc.os, "sched_getaffinity", lambda _pid: {0}, raising=False)
    assert bc.can_pin() is False  # one core only: nothing is pinned


# ---------------------------------------------------------------- alternating rounds
def test_rounds_alternate_with_the_same_prompts_and_compare(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.bench.benchutil import Steps
    from vllm_ascend.distributed.kv_transfer.bench.client import rounds as rr

    calls: list[tuple[str, int, int]] = []
    stopped: list[str] = []
    servers: dict[str, Any] = {}

    class Srv:
        def __init__(self, name: str) -> None:
            self.name, self.paused = name, False
            servers[name] = self

        def pause(self) -> None:
            self.paused = True

        def resume(self) -> None:
            self.paused = False

        def stop(self) -> None:
            stopped.append(self.name)

    def start(target: Any, cfg: Any, logs: Path) -> Any:
        return deploy.Deployment(f"http://{target.name}", [Srv(target.name)], ["p"], ["d"],
                                 ours=not target.peer)

    def one_run(dep: Any, cfg: Any, conc: int, *, seed: int, **_: Any) -> dict[str, Any]:
        name = dep.url.removeprefix("http://")
        # the pair measured runs; every other pair is paused meanwhile
        assert {n: s.paused for n, s in servers.items()} == {n: n != name for n in servers}
        calls.append((name, conc, seed))
        r = sum(1 for c in calls if c[0] == name and c[1] == conc) - 1
        ours = name == "pd-pull"
        # ours: TTFT 100 ms a run (one round with a failed request); theirs 200 ms
        return {"failed": 1 if (ours and r == 2 and conc == 4) else 0,
                "ttft_p50_ms": 100.0 if ours else 200.0, "ttft_mean_ms": 1.0,
                "tpot_p50_ms": 10.0, "output_tok_per_s": 50.0 if ours else 25.0}

    # vLLM's MooncakeConnector can run, its NixlConnector cannot (no nixl here)
    monkeypatch.setattr(rr, "peer_missing",
                        lambda t, cfg: "no nixl" if t.peer == "nixl" else None)
    monkeypatch.setattr(rr, "start_target", start)
    monkeypatch.setattr(rr, "one_run", one_run)
    monkeypatch.setattr(rr, "warm_up", lambda *a, **k: None)
    monkeypatch.setattr(rr, "SETTLE_S", 0.0)
    cfg = bc.ClientConfig(model="/m", vocab=64, num_prompts=4, concurrency=(4, 8),
                          input_len=10, output_len=2, block_size=32, out=tmp_path)
    entry = rr.run_rounds(cfg, Steps(1, "t"), tmp_path, rounds=4)
    # ours first in even rounds, the peer first in odd ones; one seed per round and
    # concurrency, the same for both pairs, never reused
    assert [c[0] for c in calls[:4]] == ["pd-pull", "pd-vllm-mooncake"] * 2
    assert [c[0] for c in calls[4:8]] == ["pd-vllm-mooncake", "pd-pull"] * 2
    seeds = {}
    for name, conc, seed in calls:
        seeds.setdefault((conc, seed), set()).add(name)
    pair = ("pd-pull", "pd-vllm-mooncake")
    assert len(calls) == 16 and all(v == set(pair) for v in seeds.values())
    assert sorted(stopped) == sorted(pair)
    assert entry["pair"] == list(pair) and entry["not_run"] == {"pd-vllm-nixl": "no nixl"}
    assert all(s.paused for s in servers.values())  # paused after their last run
    assert entry["status"] == "failed requests" and entry["failed"] == {
        "pd-pull": 1, "pd-vllm-mooncake": 0}
    by = {(c["concurrency"], c["metric"]): c for c in entry["comparisons"]}
    ttft4 = by[(4, "ttft_p50_ms")]
    assert ttft4["ratio"] == 0.5 and ttft4["rounds"] == 3  # the failed run left out
    assert by[(8, "ttft_p50_ms")]["rounds"] == 4
    tput = by[(8, "output_tok_per_s")]
    assert tput["ratio"] == 2.0 and tput["higher_is_better"] is True
    assert tput["low"] == tput["high"] == 2.0 and tput["min"] == tput["max"] == 2.0


def test_rounds_not_run_without_the_peers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.bench.benchutil import Steps
    from vllm_ascend.distributed.kv_transfer.bench.client import rounds as rr

    monkeypatch.setenv("VLLM_ASCEND_KV_BENCH_PEERS", str(tmp_path))  # no harness there
    monkeypatch.setattr(rr, "start_target", lambda *a: pytest.fail("nothing to start"))
    cfg = bc.ClientConfig(model="/m", vocab=64, num_prompts=4, concurrency=(4,),
                          input_len=10, output_len=2, block_size=32, out=tmp_path)
    entry = rr.run_rounds(cfg, Steps(1, "t"), tmp_path, rounds=5)
    assert entry["status"] == "not run" and deploy.VLLM_PEERS_MISSING in entry["reason"]
    assert set(entry["not_run"]) == {"pd-vllm-mooncake", "pd-vllm-nixl"}
    assert deploy.NIXL_AFFINITY_MODULE in entry["not_run"]["pd-vllm-nixl"]
    two = ("a", "b")
    assert rr.round_order(two, 0) == two and rr.round_order(two, 3) == two[::-1]
    three = ("a", "b", "c")
    # each goes first once every three rounds, and the order stays a rotation
    assert [rr.round_order(three, r) for r in range(4)] == [
        ("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"), ("a", "b", "c")]


def test_rounds_with_both_peers_rotate_and_compare_ours_with_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.bench.benchutil import Steps
    from vllm_ascend.distributed.kv_transfer.bench.client import rounds as rr

    order: list[str] = []
    ttft = {"pd-pull": 100.0, "pd-vllm-mooncake": 200.0, "pd-vllm-nixl": 50.0}

    def start(target: Any, cfg: Any, logs: Path) -> Any:
        return deploy.Deployment(f"http://{target.name}", [], ["p"], ["d"],
                                 ours=not target.peer)

    def one_run(dep: Any, cfg: Any, conc: int, *, seed: int, **_: Any) -> dict[str, Any]:
        order.append(dep.url.removeprefix("http://"))
        v = ttft[order[-1]]
        return {"failed": 0, "ttft_p50_ms": v, "ttft_mean_ms": v, "tpot_p50_ms": 10.0,
                "output_tok_per_s": 1000.0 / v}

    monkeypatch.setattr(rr, "peer_missing", lambda t, cfg: None)
    monkeypatch.setattr(rr, "start_target", start)
    monkeypatch.setattr(rr, "one_run", one_run)
    monkeypatch.setattr(rr, "warm_up", lambda *a, **k: None)
    monkeypatch.setattr(rr, "SETTLE_S", 0.0)
    cfg = bc.ClientConfig(model="/m", vocab=64, num_prompts=4, concurrency=(4,),
                          input_len=10, output_len=2, block_size=32, out=tmp_path)
    entry = rr.run_rounds(cfg, Steps(1, "t"), tmp_path, rounds=3)
    assert entry["status"] == "ok" and entry["pair"] == list(rr.ROUND_TARGETS)
    # who goes first rotates: each pair first once in three rounds
    assert [order[i] for i in (0, 3, 6)] == list(rr.ROUND_TARGETS)
    by = {(c["peer_target"], c["metric"]): c for c in entry["comparisons"]}
    assert by[("pd-vllm-mooncake", "ttft_p50_ms")]["ratio"] == 0.5
    assert by[("pd-vllm-nixl", "ttft_p50_ms")]["ratio"] == 2.0
    assert by[("pd-vllm-nixl", "output_tok_per_s")]["ratio"] == 0.5
    assert len(entry["comparisons"]) == 2 * len(rr.METRICS)


def test_a_paused_server_takes_no_cpu_and_stops(tmp_path: Path) -> None:
    """``Server.pause`` stops the server's whole process group (an engine's worker process
    too), ``resume`` continues it, and a paused server still stops at once."""
    import time as _time

    busy = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
            "while True: time.sleep(0.01)\n")
    srv = procs.Server("busy", [sys.executable, "-c", busy], 1, tmp_path, dict(procs.os.environ))

    def states() -> list[str]:
        """The state letter of each process of the server's group (``T``: stopped)."""
        return group_states(srv.proc.pid)

    try:
        deadline = _time.monotonic() + 30
        while len(states()) < 2 and _time.monotonic() < deadline:  # the child started
            _time.sleep(0.1)
        assert len(states()) == 2
        srv.pause()
        _time.sleep(0.2)
        assert states() == ["T", "T"]
        srv.resume()
        _time.sleep(0.2)
        assert "T" not in states() and len(states()) == 2
        srv.pause()
        start = _time.monotonic()
    finally:
        srv.stop()
    assert _time.monotonic() - start < 10 and srv.proc.poll() is not None


def test_nixl_target_needs_nixl_and_its_harness(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    nixl = next(t for t in bc.targets() if t.peer == "nixl")
    cfg = bc.ClientConfig(model="/m", vocab=64, num_prompts=4, concurrency=(4,), input_len=10,
                          output_len=2, block_size=32, out=tmp_path,
                          nixl_python=str(tmp_path / "no-such-python"))
    # the shipped harness is there; the interpreter named cannot import nixl
    assert deploy.nixl_peers_dir() == str(deploy.PEERS_DIR.resolve())
    why = deploy.peer_missing(nixl, cfg)
    assert why is not None and "nixl package is not importable" in why
    assert str(tmp_path / "no-such-python") in why
    # a python that has a module named nixl passes
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "nixl.py").write_text("")
    py = tmp_path / "py"
    py.write_text(f"#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} \"$@\"\n")
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    assert deploy.peer_missing(nixl, bc.ClientConfig(
        model="/m", vocab=64, num_prompts=4, concurrency=(4,), input_len=10, output_len=2,
        block_size=32, out=tmp_path, nixl_python=str(py))) is None
    # a peers' directory without the affinity module: not run, saying which module
    monkeypatch.setenv("VLLM_ASCEND_KV_BENCH_PEERS", str(tmp_path))
    why = deploy.peer_missing(nixl, cfg)
    assert why is not None and deploy.NIXL_AFFINITY_MODULE in why
    entry = bc.run_target(nixl, cfg, __import__(
        "vllm_ascend.distributed.kv_transfer.bench.benchutil", fromlist=["Steps"]).Steps(1, "t"),
        tmp_path)
    assert entry["status"] == "not run" and entry["reason"] == why


def test_nixl_pair_runs_from_its_interpreter_behind_our_proxy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The NixlConnector pair's engines run the nixl interpreter with the affinity module
    loaded and a side channel port each; the proxy is ours (the run's interpreter), in pull
    mode, renewing no lease."""
    started: list[Any] = []

    class Srv:
        def __init__(self, name: str, cmd: list[str], port: int, logs: Path,
                     env: dict[str, str]) -> None:
            self.name, self.cmd, self.port, self.env = name, cmd, port, env
            self.url = f"http://127.0.0.1:{port}"
            started.append(self)

        def wait_ready(self, timeout: float) -> None:
            pass

        def stop(self) -> None:
            pass

    monkeypatch.setattr(deploy, "Server", Srv)
    nixl = next(t for t in bc.targets() if t.peer == "nixl")
    cfg = bc.ClientConfig(model="/m", vocab=64, num_prompts=4, concurrency=(4,), input_len=10,
                          output_len=2, block_size=32, out=tmp_path, python="/ours/python",
                          nixl_python="/nixl/python", pin=False)
    dep = deploy.start_target(nixl, cfg, tmp_path)
    p, d, proxy = started
    assert not dep.ours and dep.p_urls == [p.url] and dep.d_urls == [d.url]
    for eng in (p, d):
        assert eng.cmd[0] == "/nixl/python"
        kv = json.loads(eng.cmd[eng.cmd.index("--kv-transfer-config") + 1])
        assert kv["kv_connector"] == "NixlConnector" and kv["kv_role"] == "kv_both"
        site = Path(eng.env["PYTHONPATH"].split(":")[0])
        assert f"import {deploy.NIXL_AFFINITY_MODULE}" in (site / "sitecustomize.py").read_text()
    assert p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != d.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert proxy.cmd[:3] == ["/ours/python", "-m", deploy.PROXY_MODULE]
    assert proxy.cmd[proxy.cmd.index("--mode") + 1] == "pull"
    assert proxy.cmd[proxy.cmd.index("--lease-renew-interval") + 1] == "0"
    with pytest.raises(ValueError, match="module name"):
        procs.peer_env("/x", tmp_path / "s", module="os; import sys")


def test_every_successful_requests_ttft_and_tpot_go_to_the_ledger() -> None:
    from vllm_ascend.distributed.kv_transfer.bench.client import rounds

    doc = {**RESULT, "ttfts": [0.1, 0.2, 0.3, 0.0], "latencies": [0.41, 0.52, 0.3, 0.0],
           "output_lens": [32, 17, 1, 0]}
    row = procs.summarize(doc)
    # the failed request is left out; a one-token answer has a TTFT and no TPOT
    assert row["request_samples"]["ttft_s"] == [0.1, 0.2, 0.3]
    assert row["request_samples"]["tpot_s"] == pytest.approx([0.01, 0.02])
    assert procs.summarize(RESULT)["request_samples"] == {"ttft_s": [], "tpot_s": []}

    def run(ttft: float) -> dict[str, Any]:
        return {"completed": 1, "request_samples": {"ttft_s": [ttft], "tpot_s": [ttft / 10]}}

    results = {"pd-pull": {"runs": [{"concurrency": 4, "dataset": "random", **run(0.1)}]}}
    rnds = {"runs": {"pd-pull": {4: [{"round": 0, **run(0.2)}, {"round": 1, "failed": 4}]},
                     "pd-vllm-mooncake": {4: [{"round": 0, **run(0.3)},
                                              {"round": 1, **run(0.4)}]}}}
    series = rounds.ledger_series(results, rnds)
    by = {(s["tags"]["part"], s["tags"]["target"], s["tags"]["what"]): s for s in series}
    assert by["single", "pd-pull", "ttft_s"]["rounds"] == [[0.1]]
    assert by["single", "pd-pull", "ttft_s"]["tags"]["dataset"] == "random"
    assert by["rounds", "pd-pull", "ttft_s"]["rounds"] == [[0.2], []]  # still paired
    assert by["rounds", "pd-vllm-mooncake", "tpot_s"]["rounds"] == [[0.03], [0.04]]
    assert "request_samples" not in results["pd-pull"]["runs"][0]  # taken out of the rows
