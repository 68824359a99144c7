# SPDX-License-Identifier: Apache-2.0
"""The report renderer: the one rule of the goal rows on ledger entries, the page, the sections."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

render = sys.modules["bench_render"]  # loaded by conftest.py

MACHINE = {"platform": "Linux-x86_64", "cpus": 2, "torch": "2.13.0+cpu",
           "time": "2026-11-30T06:00:00Z"}


def _results() -> dict[str, dict[str, Any]]:
    return {
        "engine": {"benchmark": "engine", "machine": MACHINE, "description": "raw TE",
                   "config": {"protocol": "tcp", "host": "127.0.0.1", "min_time_s": 0.1},
                   "verified": [64, 1024],
                   "rows": [{"op": "read", "block_kib": 64, "batch": 1, "concurrency": 1,
                             "GBps": 1.0, "p50_ms": 0.1, "p99_ms": 0.2},
                            {"op": "read", "block_kib": 1024, "batch": 1, "concurrency": 1,
                             "GBps": 2.0, "p50_ms": 0.5, "p99_ms": 0.9}],
                   "best": [{"op": "read", "block_kib": 64, "batch": 1, "concurrency": 1,
                             "GBps": 1.0, "p50_ms": 0.1, "p99_ms": 0.2},
                            {"op": "read", "block_kib": 1024, "batch": 1, "concurrency": 1,
                             "GBps": 2.0, "p50_ms": 0.5, "p99_ms": 0.9}]},
        "kernels": {"benchmark": "kernels", "machine": MACHINE,
                    "goal": {"min_ratio": 0.8, "from_block_kib": 64, "worst_ratio": 0.95},
                    "results": [{"block_kib": 16, "memcpy_gbps": 2.0, "gather": 0.5,
                                 "scatter": 0.5},
                                {"block_kib": 64, "memcpy_gbps": 4.0, "gather": 0.95,
                                 "scatter": 1.0, "gather_layers": 0.97,
                                 "scatter_layers": 1.1}]},
        "p2p": {"benchmark": "p2p", "machine": MACHINE, "goal": "ratio >= 0.9",
                "results": [{"blocks": 1, "ratio": 1.2}, {"blocks": 16, "ratio": 0.85}]},
        "pool": {"benchmark": "pool", "machine": MACHINE,
                 "rows": [{"path": "mooncake put", "GiB/s": 1.0, "raw GiB/s": 1.0,
                           "ratio": 0.95},
                          {"path": "mooncake get", "GiB/s": 1.0, "raw GiB/s": 1.0,
                           "ratio": 1.05},
                          {"path": "local exists (batch 1024)", "keys/s": 2e6},
                          {"path": "local lookup over ZeroMQ (batch 512)", "keys/s": 3e5}]},
        "layerwise": {"benchmark": "layerwise", "machine": MACHINE, "what": "push vs pull",
                      "rows": [{"connector": "layerwise", "kv_ready_after_forward_ms": 2.0}],
                      "pull_over_layerwise": 20.0, "layerwise_forward_slowdown": 1.1,
                      "vs_raw": {"what": "same bytes", "bytes": 1 << 20, "raw_ms": 1.0,
                                 "connector_ms": 1.25, "raw_GBps": 1.0, "connector_GBps": 0.8,
                                 "ratio": 0.8}},
        "trace": {"benchmark": "trace", "machine": MACHINE,
                  "config": {"trace": "/x/conversation_trace.jsonl", "requests": 10,
                             "unique_blocks": 100, "block_bytes": 4096, "tokens_per_block": 512},
                  "unbounded": {"hit_rate": 0.4},
                  "rows": [{"capacity_fraction": 0.1, "capacity_blocks": 10, "hit_rate": 0.1,
                            "best_hit_rate": 0.4, "vs_best": 0.25, "requests/s": 1000.0},
                           {"capacity_fraction": 0.5, "capacity_blocks": 50, "hit_rate": 0.3,
                            "best_hit_rate": 0.4, "vs_best": 0.75, "requests/s": 900.0}]},
        "offload": {"benchmark": "offload", "machine": MACHINE,
                    "bandwidth": [{"block_kib": 64, "memcpy_gbps": 10.0, "save_gbps": 5.0,
                                   "load_gbps": 9.0, "save_ratio": 0.5, "load_ratio": 0.9}],
                    "ttft": {"skipped": "--quick"}},
        "serve": {"benchmark": "serve", "machine": MACHINE,
                  "config": {"model_spec": {"num_hidden_layers": 8}, "dtype": "float32",
                             "block_size": 128, "lengths": [2048, 2049, 2112], "repeats": 3},
                  "scenarios": {"baseline": {"status": "ok", "connector": "-"},
                                "pd/vllm-nixl": {"status": "skipped", "connector":
                                                 "NixlConnector", "reason": "no nixl"}},
                  "summary": {"pool/ours-mooncake": {"hit_over_recompute": 0.04},
                              "pool/ours-local": {"hit_over_recompute": 0.03},
                              "offload/ours": {"hit_over_recompute": 0.05},
                              "pool/vllm-example": {"hit_over_recompute": 0.06}},
                  "comparisons": [
                      {"what": "pool hit TTFT: ours-mooncake / MooncakeStoreConnector",
                       "kind": "peer", "ratio": 0.7, "goal": "<= 0.8", "met": True},
                      {"what": "pool hit TTFT: ours-local / ExampleConnector",
                       "kind": "peer", "ratio": 1.3, "goal": "", "met": None},
                      {"what": "pool/ours-local hit TTFT / recompute", "kind": "recompute",
                       "ratio": 0.03, "goal": "well below 1", "met": True}],
                  "rows": [{"scenario": "baseline", "connector": "-", "status": "ok",
                            "ttft_s": 2.0}]},
    }


def test_table_cells() -> None:
    assert render.fmt(None) == "–" and render.fmt(True) == "yes"
    assert render.fmt(0.123456) == "0.123" and render.fmt("a|b") == "a\\|b"
    assert render.md_table([], ["a"]) == "_no rows_\n"


def test_the_auth_section_renders(tmp_path: Path) -> None:
    rows = [{"mode": "no key", "msgs_per_s": 12500.0, "p50_us": 74.5, "p99_us": 222.0},
            {"mode": "key", "msgs_per_s": 8150.0, "p50_us": 110.3, "p99_us": 548.0}]
    page = _page(tmp_path, {"auth": {
        "benchmark": "auth", "machine": MACHINE, "description": "round trips",
        "results": rows, "ratio": 0.652, "added_p50_us": 35.8, "envelope_us": 8.1}})
    assert "`bench auth`" in page and "0.652" in page and "| key |" in page


def test_the_pool_section_says_how_this_machines_glibc_copies(tmp_path: Path) -> None:
    local = [{"path": "local put (full pool)", "GiB/s": 7.0, "raw GiB/s": 6.5, "ratio": 1.08,
              "ratio_min": 1.0, "ratio_max": 1.1},
             {"path": "local get", "GiB/s": 9.0, "raw GiB/s": 6.5, "ratio": 1.4,
              "ratio_min": 1.3, "ratio_max": 1.6}]
    low = [{**r, "path": r["path"] + ", non-temporal from 4 MiB"} for r in local]
    doc = {"benchmark": "pool", "rows": local + low, "local_rounds": [{}] * 9,
           "local_low_nt": {"threshold": 4 << 20, "memcpy": {"non_temporal_threshold": 4 << 20}},
           "config": {"local_rounds": 9, "local_copy_threads": 2, "range_bytes": 128 << 10},
           "machine": {**MACHINE, "memcpy": {"glibc": "2.36", "non_temporal_threshold": 4 << 20,
                                             "shared_cache_size": 32 << 20}}}
    page = _page(tmp_path, {"pool": doc})
    assert "On this machine (glibc 2.36) the threshold is 4 MiB" in page
    assert "32 MiB of shared cache" in page and "(0.125 MiB here)" in page
    assert "| local get, non-temporal from 4 MiB |" in page
    assert "The rows `non-temporal from 4 MiB` are the same rounds" in page
    doc["machine"] = MACHINE  # an older result, without the facts
    doc["local_low_nt"] = {"skipped": "glibc did not take the threshold"}
    page = _page(tmp_path, {"pool": doc})
    assert "threshold was not recorded" in page
    assert "not measured: glibc did not take the threshold" in page


def test_every_benchmark_has_its_section_module() -> None:
    sections = render.load_sections()
    for name in render.CORE_BENCHMARKS:
        assert name in sections, name
        assert isinstance(sections[name], render.Section)


def _interval_serve() -> dict[str, Any]:
    """A serve.json of repeated rounds (the shape of bench serve's serve.compare)."""
    def row(what: str, kind: str, ratio: float | None, low: float | None,
            high: float | None, **extra: Any) -> dict[str, Any]:
        return {"what": what, "kind": kind, "ratio": ratio, "low": low, "high": high,
                "min": low, "max": high, "rounds": 5 if ratio is not None else 0,
                "goal": "<= 0.8", "met": None, **extra}

    by_tokens = {"2048": {"ttft": {"median": 0.07}, "floor": {"median": 0.058},
                          "overhead": {"median": 0.012, "min": 0.01, "max": 0.02},
                          "recompute": {"median": 0.3}, "external": {"min": 2048.0}}}
    return {
        "benchmark": "serve", "machine": MACHINE,
        "config": {"model_spec": {"num_hidden_layers": 8}, "dtype": "float32",
                   "block_size": 128, "lengths": [2048, 2049, 2112], "repeats": 2,
                   "rounds": 5, "pd_lengths": [2048, 8192], "pd_bindings": ["pinned", "nobind"],
                   "pd_binding_env": {"pinned": {"prefill": "0", "decode": "1"},
                                      "nobind": {"prefill": "nobind", "decode": "nobind"}}},
        "scenarios": {"pd/ours[pinned]": {"status": "ok", "connector": "MooncakeConnectorV1"}},
        "rounds": {"pd/ours[pinned]": {"rounds": 5, "by_tokens": by_tokens, "loaded": True,
                                       "load_check": "num_external_computed_tokens"}},
        "comparisons": [
            # the median meets the goal but the interval does not: not met
            row("D-side overhead over the floor at 2048 tokens (pinned): ours / NixlConnector",
                "overhead", 0.7, 0.5, 0.9),
            row("D-side overhead over the floor at 8192 tokens (pinned): ours / NixlConnector",
                "overhead", 0.5, 0.4, 0.6),
            row("D-side overhead over the floor at 2048 tokens (pinned): ours / vLLM "
                "MooncakeConnector", "overhead", 0.5, 0.4, 0.6),
            row("D-side overhead over the floor at 8192 tokens (pinned): ours / vLLM "
                "MooncakeConnector", "overhead", 0.6, 0.5, 0.7),
            # a peer that fell back to recompute: no ratio, said so
            row("P/D decode TTFT: ours / NixlConnector (pinned)", "peer", None, None, None,
                note="the peer fell back to recompute (pd/vllm-nixl[pinned]): no ratio",
                peer_fell_back=True)],
        "rows": [{"scenario": "pd/ours[pinned]", "status": "ok"}]}


def test_serve_section_states_rounds_spread_and_the_overhead_table(tmp_path: Path) -> None:
    page = _page(tmp_path, {"serve": _interval_serve()})
    assert "**5 rounds**" in page and "whole interval is on the right side" in page
    assert "`pinned` (P `VLLM_CPU_OMP_THREADS_BIND=0`, D `1`)" in page
    assert "| 0.7 | 0.5–0.9 | 0.5–0.9 | 5 |" in page
    assert "the peer fell back to recompute" in page
    assert "### Overhead over the floor" in page
    assert "| pd/ours[pinned] | MooncakeConnectorV1 | 2048 | 0.07 | 0.058 | 0.012 | 0.01–0.02 " \
           "| 0.3 | 2048 | yes | num_external_computed_tokens |" in page
    serve = _interval_serve()
    serve["rounds"]["pool/ours-local"] = {"rounds": 5, "by_tokens": {"2048": {
        "hit": {"median": 0.03}, "floor": {"median": 0.02}, "hit_overhead": {
            "median": 0.01, "min": 0.005, "max": 0.02}, "cold": {"median": 0.6},
        "recompute": {"median": 0.59}, "save_overhead": {"median": 0.01}}}}
    page = _page(tmp_path, {"serve": serve})
    assert "| pool/ours-local |" in page
    assert "**First requests after start-up.**" not in page  # no warm-up in these results
    serve["scenarios"]["pool/ours-local"] = {"status": "ok", "connector": "AscendStoreConnector",
                                             "warm_up": {"tokens": 2048, "first_request_s": 1.3,
                                                         "first_batch_s": 2.5}}
    serve["config"]["engine_malloc"] = {"MALLOC_MMAP_MAX_": "0"}
    page = _page(tmp_path, {"serve": serve})
    assert "**First requests after start-up.**" in page
    assert "glibc's malloc keeping the memory it frees (`MALLOC_MMAP_MAX_=0`)" in page
    assert "| pool/ours-local | AscendStoreConnector | 2048 | 1.3 | 0.6 | 2.5 |" in page


def test_a_section_draws_its_own_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def plot_client(res: dict[str, dict[str, Any]], path: Path, draw: bool = True
                    ) -> Path | None:
        if not draw:
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x89PNG\r\n\x1a\n")
        return path

    sections = {**render.load_sections(),
                "client": render.Section("Client", "issue 17", 90,
                                         lambda d, images: f"plot: {images.get('client')}\n",
                                         plot=plot_client)}
    monkeypatch.setattr(render, "load_sections", lambda: sections)
    page = _page(tmp_path, {"client": {"machine": MACHINE}})
    assert "plot: img/bench-client.png" in page
    assert (tmp_path / "docs" / "img" / "bench-client.png").exists()
    assert "## Plots" not in page  # shown in its section, not among the shared plots


def test_the_inline_reads_column_with_its_interval() -> None:
    res = _results()
    page = render.load_sections()["p2p"].render(res["p2p"], {})
    assert "| inline |" not in page and "`inline`: window loads" not in page  # no mode
    rows = res["p2p"]["results"]
    rows[0].update(ratio_inline=0.81, ratio_inline_low=0.78, ratio_inline_high=0.84)
    rows[1].update(ratio_inline=0.97)  # an interval missing: the median alone
    page = render.load_sections()["p2p"].render(res["p2p"], {})
    assert "| inline |" in page and "`inline`: window loads with `inline_reads` on" in page
    assert "| 0.81 (95%: 0.78–0.84) |" in page and "| 0.97 |" in page


# ---------------------------------------------------------------------- the ledger and the rule
ledger = render.ledger
HEAD = {"ascend-kernels": "tree-k", "ascend-kv-core": "tree-c", "ascend-kv-p2p": "tree-p",
        "ascend-kv-pool": "tree-s", "ascend-cpu-offload": "tree-o", "ascend-dist-utils": "tree-d"}


def _entry(section: str, result: dict[str, Any], *, ended: str = "2026-12-06T10:00:00Z",
           samples: list[dict[str, Any]] | None = None, config: dict[str, Any] | None = None,
           trees: dict[str, str] | None = None) -> dict[str, Any]:
    """A ledger entry as ``bench.ledger.make_entry`` writes it, its sources those of HEAD."""
    packages = ledger.MEASURED.get(section, ("ascend-kv-core",))
    return {"format": 1, "section": section, "started": ended, "ended": ended,
            "source": {"commit": "a" * 40, "dirty": False,
                       "packages": trees or {p: HEAD.get(p, "tree") for p in packages}},
            "versions": {"ascend-kv-core": "0.1.0", "vllm": "0.32.0", "mooncake": "0.3"},
            "machine": {"cpu_model": "AMD EPYC", "cpus": 2, "mem_total_kib": 2 ** 21,
                        "affinity": [0, 1], "loadavg_start": [0.1, 0.2, 0.3],
                        "loadavg_end": [0.4, 0.5, 0.6], "platform": "Linux"},
            "config": config or {}, "result": result, "samples": samples or []}


def _stored(tmp_path: Path, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries written to a ledger and read back (with their ids)."""
    for e in entries:
        ledger.append(tmp_path / "ledger", e)
    return ledger.read_entries(tmp_path / "ledger")


def _page(tmp_path: Path, docs: dict[str, dict[str, Any]]) -> str:
    """The page of one run of each section holding ``docs`` (its result JSON)."""
    entries = _stored(tmp_path, [_entry(n, d) for n, d in docs.items()])
    return render.render(entries, HEAD, tmp_path / "docs")


def _kernel_samples(kernel_s: float, base_s: float, rounds: int = 9,
                    noise: float = 0.0) -> list[dict[str, Any]]:
    """Raw samples of bench kernels at 64 KiB: each round's three calls of each side."""
    tags = {"block_kib": 64, "kernel": "gather"}
    k = [[kernel_s * (1 + noise * ((r % 3) - 1))] * 3 for r in range(rounds)]
    b = [[base_s] * 3 for _r in range(rounds)]
    return [ledger.series({**tags, "role": "kernel", "bytes": 1 << 20}, k),
            ledger.series({**tags, "role": "baseline", "bytes": 1 << 20}, b)]


KERNEL_GOAL = ("KV block gather/scatter (one layer and all layers) >= 0.8 of memcpy from "
               "64 KiB blocks")


def _row(entries: list[dict[str, Any]], goal: str, head: dict[str, Any] | None = None) -> Any:
    rows = render.evaluate_goals(entries, HEAD if head is None else head)
    return next(r for r in rows if r.spec.goal == goal)


def test_a_section_without_a_run_is_not_met_and_says_so(tmp_path: Path) -> None:
    row = _row([], KERNEL_GOAL)
    assert row.met is False and row.entry is None and row.why == "no run recorded"
    page = render.render([], HEAD, tmp_path, draw=False)
    assert "| no run recorded |" in page and "**not met** (no run recorded)" in page
    assert "No run recorded in the ledger." in page and "0 of " in page
    assert "## Plots" not in page


def test_the_goal_is_judged_on_the_raw_samples_bootstrap(tmp_path: Path) -> None:
    # the kernel moves its bytes in 1.1 s where memcpy takes 1 s: 0.909 of memcpy
    entries = _stored(tmp_path, [_entry("kernels", {}, samples=_kernel_samples(1.1, 1.0))])
    row = _row(entries, KERNEL_GOAL)
    assert row.met is True and row.measured.rounds == 9
    assert abs(row.measured.value - 1 / 1.1) < 1e-9
    assert row.measured.where == "gather, 64 KiB"
    # a median above the bound with an interval across it: not met
    noisy = _stored(tmp_path / "n", [_entry("kernels", {}, samples=_kernel_samples(
        1.1, 1.0, noise=0.4))])
    row = _row(noisy, KERNEL_GOAL)
    assert row.measured.value > 0.8 and row.measured.low < 0.8 and row.met is False


def test_fewer_than_nine_rounds_is_not_met(tmp_path: Path) -> None:
    entries = _stored(tmp_path, [_entry("kernels", {}, samples=_kernel_samples(1.0, 1.0, 8))])
    row = _row(entries, KERNEL_GOAL)
    assert row.met is False and row.why == "8 rounds, fewer than 9"


def test_a_run_of_other_sources_than_heads_is_stale_and_not_met(tmp_path: Path) -> None:
    entries = _stored(tmp_path, [_entry("kernels", {}, samples=_kernel_samples(1.0, 1.0))])
    assert _row(entries, KERNEL_GOAL).met is True
    row = _row(entries, KERNEL_GOAL, head={**HEAD, "ascend-kernels": "tree-after-a-commit"})
    assert row.met is False and row.stale and row.why == "stale"
    page = render.render(entries, {**HEAD, "ascend-kernels": "x"}, tmp_path, draw=False)
    assert "(stale)" in page and "**stale**: the measured packages' sources differ" in page


def test_the_row_reads_the_latest_run_never_the_best(tmp_path: Path) -> None:
    good = _entry("kernels", {}, ended="2026-12-06T09:00:00Z", samples=_kernel_samples(1.0, 1.0))
    bad = _entry("kernels", {}, ended="2026-12-06T11:00:00Z", samples=_kernel_samples(2.0, 1.0))
    entries = _stored(tmp_path, [bad, good])  # written in any order
    row = _row(entries, KERNEL_GOAL)
    assert row.met is False and row.entry is not None
    assert row.entry["ended"] == "2026-12-06T11:00:00Z"


def test_p2p_rows_read_the_latest_run_of_their_layer_count(tmp_path: Path) -> None:
    def samples(layers: int, conn_us: float) -> list[dict[str, Any]]:
        out = []
        for n, raw in ((1, 300e-6), (16, 5e-3)):
            for path, t in (("raw", raw), ("window", raw + conn_us * 1e-6)):
                out.append(ledger.series({"blocks": n, "bytes": n, "layers": layers,
                                          "path": path}, [[t] * 3] * 9))
        return out

    e8 = _entry("p2p", {}, config={"layers": 8}, ended="2026-12-06T10:00:00Z",
                samples=samples(8, 40.0))
    e64 = _entry("p2p", {}, config={"layers": 64}, ended="2026-12-06T11:00:00Z",
                 samples=samples(64, 120.0))
    entries = _stored(tmp_path, [e8, e64])
    fixed8 = _row(entries, "pull fixed cost per load at 1 block, 8 layers <= 50 µs")
    fixed64 = _row(entries, "pull fixed cost per load at 1 block, 64 layers <= 50 µs")
    assert fixed8.met is True and abs(fixed8.measured.value - 40.0) < 1e-6
    assert fixed64.met is False and abs(fixed64.measured.value - 120.0) < 1e-6
    assert fixed64.measured.unit == " µs"
    ratio8 = _row(entries, "pull connector / raw >= 0.9 from 16 blocks, 8 layers")
    assert ratio8.met is True and ratio8.measured.where == "16 blocks"
    keyed = _row(entries, "a deployment key keeps the pull's speed: plain / keyed >= 0.9 at "
                          "every size (8 layers, `--auth`)")
    assert keyed.entry is None  # no run with --auth: no run recorded, not met
    assert keyed.met is False


def test_the_page_is_the_same_from_the_same_ledger_and_check_fails_on_a_difference(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [_entry("kernels", _results()["kernels"], samples=_kernel_samples(1.0, 1.0))]
    _stored(tmp_path, entries)
    monkeypatch.setattr(render.ledger, "head_trees", lambda root, pkgs: dict(HEAD))
    docs = tmp_path / "docs"
    docs.mkdir()
    args = ["--ledger", str(tmp_path / "ledger"), "--docs", str(docs)]
    assert render.main(args) == 0
    first = (docs / "benchmarks.md").read_bytes()
    assert render.main([*args, "--check"]) == 0
    (docs / "benchmarks.md").unlink()
    assert render.main([*args, "--check"]) == 1  # deleted: the check fails
    assert render.main(args) == 0
    assert (docs / "benchmarks.md").read_bytes() == first  # back byte for byte
    (docs / "benchmarks.md").write_text(first.decode().replace("**met**", "**not met**"))
    assert render.main([*args, "--check"]) == 1
    page = first.decode()
    assert page.index("The rule of every goal row") < page.index("## Goals") \
        < page.index("## Plots") < page.index("## KV block kernels")
    assert "| # | goal | value (95% interval) | against | verdict | run |" in page
    # the table's row: the goal's short words, the value and interval; the goal in full
    # below it, with where the value was read
    assert "1 of " in page and "| gather/scatter >= 0.8 of memcpy | 1 (1–1) |" in page
    assert ". KV block gather/scatter (one layer and all layers) >= 0.8 of memcpy from 64 KiB " \
           "blocks — gather, 64 KiB.\n" in page
    assert page.index("| gather/scatter") < page.index("The goals in full") \
        < page.index("**What these runs took.**")
    assert "bound to CPUs [0, 1]; load average [0.1, 0.2, 0.3] at the start" in page


def test_a_run_of_a_section_without_a_module_is_listed(tmp_path: Path) -> None:
    entries = _stored(tmp_path, [_entry("nosuchbench", {"x": 1})])
    page = render.render(entries, HEAD, tmp_path, draw=False)
    assert "nosuchbench: 1 run" in page
    assert "without a module in `benchmarks/sections/` (not rendered): nosuchbench." in page


def test_offload_copies_against_the_faster_memcpy_of_each_round(tmp_path: Path) -> None:
    def s(role: str, t: float) -> dict[str, Any]:
        return ledger.series({"block_kib": 64, "role": role, "bytes": 1 << 20}, [[t] * 3] * 9)

    goal = "offload save/load >= 0.8 of memcpy from 64 KiB blocks"
    # libc's memmove is the faster baseline: save at 0.9 of it, load at 0.5
    entries = _stored(tmp_path, [_entry("offload", {}, samples=[
        s("torch", 2.0), s("libc", 1.0), s("save", 1 / 0.9), s("load", 2.0)])])
    row = _row(entries, goal)
    assert row.met is False and row.measured.where == "load, 64 KiB"
    assert abs(row.measured.value - 0.5) < 1e-9
    entries = _stored(tmp_path / "b", [_entry("offload", {}, samples=[
        s("torch", 2.0), s("libc", 1.0), s("save", 1 / 0.9), s("load", 1.0)])])
    row = _row(entries, goal)
    assert row.met is True and row.measured.where == "save, 64 KiB"


def test_non_inferiority_needs_the_median_and_the_low_end() -> None:
    common = render._common
    peer = [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.02, 0.98]
    level = common.judged_noninferior(peer, peer)
    assert level.value == 1.0 and level.low == 1.0 and level.met is True
    slower = common.judged_noninferior([p * 0.96 for p in peer], peer)
    assert slower.low is not None and slower.low >= 0.95 and slower.met is False  # median 0.96
    noisy = common.judged_noninferior([p * f for p, f in zip(
        peer, (1.0, 0.8, 1.2, 0.99, 1.0, 0.85, 1.1, 0.98, 1.0), strict=True)], peer)
    assert noisy.value is not None and noisy.value >= 0.97
    assert noisy.low is not None and noisy.low < 0.95 and noisy.met is False


def test_the_page_says_what_its_runs_took_against_the_sets_budget(tmp_path: Path) -> None:
    """The wall time of every run the page shows, summed by section from the ledger's start
    and end, against the 2 hours the whole set may take; sections without a run named."""
    def timed(section: str, start: str, end: str) -> dict[str, Any]:
        return {**_entry(section, {}, ended=end), "started": start}

    entries = _stored(tmp_path, [timed("kernels", "2026-12-06T10:00:00Z", "2026-12-06T10:30:00Z"),
                                 timed("p2p", "2026-12-06T11:00:00Z", "2026-12-06T11:45:30Z")])
    rows = render.evaluate_goals(entries, HEAD)
    names = render.benchmark_names()
    text = render.set_time(rows, entries, names)
    assert "The 2 runs the page shows" in text and "took 76 minutes" in text
    assert "p2p 45.5, kernels 30.0 minutes; within the 120 minutes" in text
    assert "sections without a run, not counted: " in text and "serve" in text
    over = _stored(tmp_path / "o", [timed("kernels", "2026-12-06T10:00:00Z",
                                          "2026-12-06T12:01:00Z")])
    assert "; **over** the 120 minutes" in render.set_time(
        render.evaluate_goals(over, HEAD), over, names)
    assert render.set_time([], [], names) == ""
    page = render.render(entries, HEAD, tmp_path / "docs", draw=False)
    assert text in page


def test_every_goal_has_a_few_words_for_the_table_on_top() -> None:
    """The table on top fits a screen: a line a goal, its short words, one to a goal."""
    goals = [g for s in render.load_sections().values() for g in s.goals]
    assert len(goals) >= 40
    too_long = [g.short for g in goals if not g.short or len(g.short) > render.SHORT_MAX]
    assert too_long == []
    assert len({g.short for g in goals}) == len(goals)
