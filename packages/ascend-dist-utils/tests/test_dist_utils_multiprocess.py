# SPDX-License-Identifier: Apache-2.0
"""Real multi-process torch.distributed (gloo, 2 and 4 ranks) against single-process results.

Each world runs the whole ``dist_utils`` scenario of
:mod:`ascend_kv_testing.dist_workers` once (spawning ranks that import vLLM
takes most of the time); the tests below check what every rank observed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ascend_kv_testing import dist_workers as dw
from vllm_ascend.distributed import parallel_state as ps

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def world(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    size = request.param
    return dw.run_world("dist_utils", size, Path(tmp_path_factory.mktemp(f"world{size}")))


def ok(result: dict[str, Any], name: str) -> Any:
    entry = result[name]
    assert "ok" in entry, f"{name} raised {entry}"
    return entry["ok"]


def err(result: dict[str, Any], name: str) -> dict[str, Any]:
    entry = result[name]
    assert "error" in entry, f"{name} returned {entry} instead of raising"
    return entry


def test_getters_raise_before_init_and_after_destroy(world: list[dict[str, Any]]) -> None:
    for r in world:
        assert r["initialized_before"] is False and r["initialized_after"] is True
        assert r["initialized_after_destroy"] is False
        for name in ("p_tp_before_init", "fc3_before_init", "p_tp_after_destroy",
                     "r1_otp_missing", "r2_p_tp_missing"):
            e = err(r, name)
            assert e["error"] == "GroupNotInitializedError", name
            assert "AssertionError" in e["mro"] and "not initialized" in e["message"]


def test_all_to_all_even(world: list[dict[str, Any]]) -> None:
    n = len(world)
    inputs = [dw.a2a_input(i, n) for i in range(n)]
    for rank, r in enumerate(world):
        parts = [torch.tensor_split(x, n, 0)[rank] for x in inputs]
        assert torch.equal(torch.tensor(ok(r, "a2a_even_dim0")), torch.cat(parts, 0))
        assert torch.equal(torch.tensor(ok(r, "a2a_function")), torch.cat(parts, 0))
        assert torch.equal(torch.tensor(ok(r, "a2a_even_dim0_to_1")), torch.cat(parts, -1))
        assert r["comm_device"] == "cpu"


def test_all_to_all_uneven(world: list[dict[str, Any]]) -> None:
    n = len(world)
    heads = dw.ulysses_heads(n)
    for rank, r in enumerate(world):
        lo = sum(heads[:rank])
        want = torch.cat([dw.ulysses_input(i, n)[:, lo:lo + heads[rank]] for i in range(n)], 0)
        got = torch.tensor(ok(r, "a2a_uneven"))
        assert got.shape == (sum(dw.ulysses_tokens(i) for i in range(n)), heads[rank], 2)
        assert torch.equal(got, want)


def test_all_to_all_bad_arguments_fail_before_communicating(
        world: list[dict[str, Any]]) -> None:
    for r in world:
        assert "scatter_sizes has" in err(r, "a2a_bad_sizes")["message"]
        assert "both scatter_sizes and gather_sizes" in err(r, "a2a_one_list")["message"]
        assert "does not split evenly" in err(r, "a2a_indivisible")["message"]
        assert err(r, "a2a_bad_sizes")["error"] == "SplitSizeError"
    # every later collective still worked, so no rank was left waiting on a half-started one


def test_all_gather_async(world: list[dict[str, Any]]) -> None:
    n = len(world)
    want = torch.cat([dw.rows_input(i, 2) for i in range(n)], 0)
    for r in world:
        assert torch.equal(torch.tensor(ok(r, "all_gather_async_raw")), want)
        assert torch.equal(torch.tensor(ok(r, "all_gather_async_coordinator")), want)


def _expect_group(facts: dict[str, Any], rank: int, group_ranks: list[list[int]],
                  prefix: str) -> None:
    mine = next(g for g in group_ranks if rank in g)
    assert facts["group_ranks"] == group_ranks
    assert facts["ranks"] == mine and facts["world_size"] == len(mine)
    assert facts["rank_in_group"] == mine.index(rank)
    assert facts["all_gather"] == [float(x) for x in mine]  # the group really communicates
    assert facts["name"].startswith(prefix)


def test_round1_groups_match_the_layouts(world: list[dict[str, Any]]) -> None:
    n = len(world)
    lay = ps.RankLayout(n, tp=n)
    p_tp = ps.p_tp_group_ranks(lay, 2)
    otp, odp = ps.flashcomm2_group_ranks(lay, 2)
    for rank, r in enumerate(world):
        _expect_group(ok(r, "r1_p_tp"), rank, p_tp, f"p_tp_{rank // 2}:")
        for name, prefix in (("r1_mc2", "mc2"), ("r1_fc3", "fc3_quant_x"),
                             ("r1_eplb", "dynamic_eplb")):
            _expect_group(ok(r, name), rank, ps.mc2_group_ranks(lay), prefix)
        _expect_group(ok(r, "r1_fc2_otp"), rank, otp, "flashcomm2_otp")
        _expect_group(ok(r, "r1_fc2_odp"), rank, odp, "flashcomm2_odp")
        _expect_group(ok(r, "r1_shard"), rank, ps.shard_weight_group_ranks(lay, otp),
                      "shard_weight")
        assert ok(r, "r1_p_tp_again") is True
        assert err(r, "r1_p_tp_other_layout")["error"] == "GroupAlreadyInitializedError"


def test_round2_fine_grained_groups(world: list[dict[str, Any]]) -> None:
    n = len(world)
    dp = 2 if n >= 4 else 1
    lay = ps.RankLayout(n, dp=dp, tp=n // dp)
    for rank, r in enumerate(world):
        _expect_group(ok(r, "r2_mc2"), rank, ps.mc2_group_ranks(lay), "mc2")
        _expect_group(ok(r, "r2_otp"), rank, ps.finegrained_tp_group_ranks(lay, dp), "otp")
        _expect_group(ok(r, "r2_mlp"), rank, ps.finegrained_tp_group_ranks(lay, 1),
                      "otp" if dp == 1 else "mlptp")
        assert r["r2_same_object"] is True  # one group per distinct size, as upstream


def test_round3_flashcomm2_borrows_and_keeps_vllm_tp(world: list[dict[str, Any]]) -> None:
    n = len(world)
    for rank, r in enumerate(world):
        assert r["r3_odp_is_vllm_tp"] is True and r["r3_otp_is_none"] is True
        _expect_group(ok(r, "r3_vllm_tp_alive"), rank, [list(range(n))], "vllm_tp_stand_in")


def test_kv_alltoall_on_the_p_tp_group(world: list[dict[str, Any]]) -> None:
    n = len(world)
    groups = ps.p_tp_group_ranks(ps.RankLayout(n, tp=n), 2)
    for rank, r in enumerate(world):
        members = next(g for g in groups if rank in g)
        j = members.index(rank)
        got_k, got_v = (torch.tensor(t) for t in ok(r, "kv_alltoall"))
        for salt, got in ((0, got_k), (1, got_v)):
            chunks = [torch.tensor_split(dw.kv_input(m, 4, 2, 3, salt), len(members), 0)[j]
                      for m in members]
            # token t of member c's chunk lands at row t * len(members) + c
            for c, chunk in enumerate(chunks):
                for t in range(chunk.shape[0]):
                    assert torch.equal(got[t * len(members) + c], chunk[t])
        assert ok(r, "kv_alltoall_noop") == [None, None]


def test_fc3_all_gather_and_unpad(world: list[dict[str, Any]]) -> None:
    n = len(world)
    counts, padded = dw.FC3_COUNTS[n], dw.FC3_PADDED[n]
    per_rank = len(counts) * padded // n
    gathered = torch.cat([dw.rows_input(i, per_rank) for i in range(n)], 0)
    chunks = gathered.view(len(counts), padded, -1)
    want_dp = torch.cat([chunks[i, :c] for i, c in enumerate(counts)], 0)
    for rank, r in enumerate(world):
        assert torch.equal(torch.tensor(ok(r, "fc3_no_context")), dw.rows_input(rank, per_rank))
        assert torch.equal(torch.tensor(ok(r, "fc3_pad")), gathered[:-1])
        assert torch.equal(torch.tensor(ok(r, "fc3_pad_kwarg")), gathered[:-2])
        assert torch.equal(torch.tensor(ok(r, "fc3_dp")), want_dp)
        assert err(r, "fc3_dp_bad_length")["error"] == "SplitSizeError"
