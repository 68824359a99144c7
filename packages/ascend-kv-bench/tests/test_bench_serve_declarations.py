# SPDX-License-Identifier: Apache-2.0
"""``bench serve``: the comparisons our connectors' scenarios declare (``serve.p2p``,
``serve.pool``), reported with their goals."""

from __future__ import annotations

import pytest

from vllm_ascend.distributed.kv_transfer.bench.serve import p2p as p2p_serve
from vllm_ascend.distributed.kv_transfer.bench.serve import pool as pool_serve
from vllm_ascend.distributed.kv_transfer.bench.serve.report import comparisons


def test_p2p_scenarios_declare_their_comparisons() -> None:
    sc, tcp, layerwise = p2p_serve.scenarios()
    assert sc.name == "pd/ours" and sc.quick
    assert tcp.name == "pd/ours-tcp" and not tcp.quick
    assert layerwise.name == "pd/ours-layerwise" and not layerwise.quick
    summary = {"pd/ours": {"d_ttft_over_recompute": 0.06},
               "pd/vllm-nixl": {"d_ttft_over_recompute": 0.11}}
    comps = {c["what"]: c for c in comparisons(summary, [sc])}
    c = comps["P/D decode TTFT: ours / NixlConnector"]
    assert c["ratio"] == pytest.approx(0.06 / 0.11) and c["met"] is True and c["kind"] == "peer"
    c = comps["P/D KV throughput: ours / NixlConnector"]
    assert c["ratio"] == pytest.approx(0.11 / 0.06) and c["met"] is True
    c = comps["P/D decode TTFT: ours / vLLM MooncakeConnector"]
    assert c["ratio"] is None and c["goal"] == "" and c["met"] is None
    assert comps["pd/ours D TTFT / recompute"]["kind"] == "recompute"


def test_pool_scenarios_declare_their_comparisons() -> None:
    scs = pool_serve.scenarios()
    assert [s.name for s in scs] == ["pool/ours-local", "pool/ours-local-prefault",
                                     "pool/ours-mooncake"]
    summary = {"pool/ours-mooncake": {"hit_over_recompute": 0.05, "cold_over_baseline": 1.1},
               "pool/vllm-mooncake-store": {"hit_over_recompute": 0.1,
                                            "cold_over_baseline": 1.2}}
    comps = {c["what"]: c for c in comparisons(summary, scs)}
    c = comps["pool hit TTFT: ours-mooncake / MooncakeStoreConnector"]
    assert c["ratio"] == pytest.approx(0.5) and c["met"] is None  # the goal is the overhead's
    # issue 17: the overheads (hit over the floor, save) at most 0.8x the Store peer's, the
    # throughput at least theirs; the other pairs have no goal
    decl = {c.what: c for s in scs for c in s.comparisons}
    vs_store = "ours-mooncake / MooncakeStoreConnector"
    for what in (f"pool hit TTFT: {vs_store}", f"pool cold TTFT (miss + save): {vs_store}"):
        goal = decl[what].overhead_goal
        assert goal is not None and goal.at_most == 0.8
    thr = decl[f"pool serving throughput (new prompts, saved): {vs_store}"].goal
    assert thr is not None and thr.at_least == 1.0
    local = decl["pool hit TTFT: ours-local / MooncakeStoreConnector"].overhead_goal
    assert local is not None and local.at_most is None
    assert comps["pool cold TTFT (miss + save): ours-mooncake / MooncakeStoreConnector"][
        "ratio"] == pytest.approx(1.1 / 1.2)
    assert comps["pool serving throughput (new prompts, saved): ours-local / "
                 "ExampleConnector"]["ratio"] is None  # ours-local was not run
    hit = comps["pool/ours-mooncake hit TTFT / recompute"]
    assert hit["kind"] == "recompute" and hit["goal"] == "well below 1" and hit["met"] is True
