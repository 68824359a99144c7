# SPDX-License-Identifier: Apache-2.0
"""Real multi-process ``torch.distributed`` worlds (gloo on CPU) for the ascend-dist-utils tests.

:func:`run_world` spawns ``world_size`` processes that each run one scenario
of this module (test modules load with ``--import-mode=importlib`` and cannot
be imported by a spawned child, so the children's code lives here). Each rank
writes what it observed to ``rank<r>.json`` (JSON, never pickle); the test
compares it with results computed in a single process, using the same input
generators (:func:`a2a_input`, :func:`rows_input`, ...).

Children never outlive the call: a world that does not finish in time is
killed and its logs are put in the error.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from .procs import free_port

#: Environment of the children: quiet, loopback, one torch thread each (2-core machines).
CHILD_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "OMP_NUM_THREADS": "1",
    "GLOO_SOCKET_IFNAME": "lo",
    "TOKENIZERS_PARALLELISM": "false",
}


# ---------------------------------------------------------------- shared inputs
def a2a_input(rank: int, world: int, *, rows_per_rank: int = 2, cols: int = 3) -> Any:
    """Even all-to-all input of ``rank``: ``(world * rows_per_rank, cols)``, values name the rank."""
    import torch

    n = world * rows_per_rank * cols
    return (torch.arange(n, dtype=torch.float32) + 1000 * rank).reshape(world * rows_per_rank,
                                                                        cols)


def ulysses_tokens(rank: int) -> int:
    """Tokens of ``rank`` in the uneven all-to-all (different on every rank)."""
    return rank + 1


def ulysses_heads(world: int) -> list[int]:
    """Uneven head split, the same on every rank: ``[1, 2, ..., world]``."""
    return list(range(1, world + 1))


def ulysses_input(rank: int, world: int, head_size: int = 2) -> Any:
    """``(tokens, heads, head_size)`` input of the uneven all-to-all."""
    import torch

    heads = sum(ulysses_heads(world))
    n = ulysses_tokens(rank) * heads * head_size
    return (torch.arange(n, dtype=torch.float32) + 1000 * rank).reshape(
        ulysses_tokens(rank), heads, head_size)


def rows_input(rank: int, rows: int, cols: int = 2) -> Any:
    """``(rows, cols)`` rows of ``rank`` for the gather tests."""
    import torch

    return (torch.arange(rows * cols, dtype=torch.float32) + 100 * rank).reshape(rows, cols)


def kv_input(rank: int, tokens: int, heads: int, head_size: int, salt: int = 0) -> Any:
    """``(tokens, heads, head_size)`` K (salt 0) or V (salt 1) rows of ``rank``."""
    import torch

    n = tokens * heads * head_size
    return (torch.arange(n, dtype=torch.float32) + 1000 * rank + 500 * salt).reshape(
        tokens, heads, head_size)


#: Per-DP-rank token counts and padded length of the fc3 unpad scenario (world 4 = dp 2 x tp 2).
FC3_COUNTS = {2: [3], 4: [3, 1]}
FC3_PADDED = {2: 4, 4: 4}


# ---------------------------------------------------------------- scenarios
def _rec(out: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """Run ``fn`` and record its value, or the exception it raised (type and message)."""
    try:
        out[name] = {"ok": _jsonable(fn())}
    except Exception as exc:  # the test decides whether an error was expected
        out[name] = {"error": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
                     "message": str(exc)}


def _jsonable(v: Any) -> Any:
    import torch

    if isinstance(v, torch.Tensor):
        return v.tolist()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


def _group_facts(group: Any) -> dict[str, Any]:
    """What a rank sees of a GroupCoordinator, plus an all-gather through it."""
    import torch

    gathered = group.all_gather(torch.tensor([float(torch.distributed.get_rank())]), 0)
    return {"ranks": list(group.ranks), "rank_in_group": group.rank_in_group,
            "world_size": group.world_size, "name": group.unique_name,
            "group_ranks": group.group_ranks, "all_gather": gathered.tolist()}


def scenario_dist_utils(rank: int, world: int) -> dict[str, Any]:
    """Everything ascend-dist-utils does, on a world of 2 or 4 ranks."""
    import torch
    import torch.distributed as dist

    from vllm_ascend.distributed import parallel_state as ps
    from vllm_ascend.distributed import utils
    from vllm_ascend.distributed.device_communicators import npu_communicator as nc

    out: dict[str, Any] = {"rank": rank, "world": world}
    # -- getters before anything was created
    _rec(out, "p_tp_before_init", ps.get_p_tp_group)
    _rec(out, "fc3_before_init", ps.get_fc3_quant_x_group)
    out["initialized_before"] = ps.model_parallel_initialized()

    # -- NPUCommunicator.all_to_all on a gloo group
    group = dist.new_group(list(range(world)), backend="gloo")
    comm = nc.NPUCommunicator(cpu_group=group, device=torch.device("cpu"), device_group=group,
                              unique_name="a2a_test")
    out["comm_device"] = str(comm.device)
    x = a2a_input(rank, world)
    _rec(out, "a2a_even_dim0", lambda: comm.all_to_all(x, 0, 0))
    _rec(out, "a2a_even_dim0_to_1", lambda: comm.all_to_all(x, 0, -1))
    u = ulysses_input(rank, world)
    sizes = ulysses_heads(world)
    recv = [ulysses_tokens(r) for r in range(world)]
    _rec(out, "a2a_uneven", lambda: comm.all_to_all(u, 1, 0, sizes, recv))
    _rec(out, "a2a_bad_sizes", lambda: comm.all_to_all(u, 1, 0, sizes[:-1], recv))
    _rec(out, "a2a_one_list", lambda: comm.all_to_all(u, 1, 0, sizes, None))
    _rec(out, "a2a_indivisible", lambda: comm.all_to_all(torch.zeros(world + 1, 2), 0, 0))
    _rec(out, "a2a_function", lambda: nc.all_to_all(x, group, scatter_dim=0, gather_dim=0))

    # -- all_gather_async on a raw process group and on a coordinator
    rows = rows_input(rank, 2)

    def gather_raw() -> Any:
        output, work = utils.all_gather_async(rows, group)
        work.wait()
        return output

    _rec(out, "all_gather_async_raw", gather_raw)

    # -- round 1: P/D producer (P TP = world, D TP = world/2), fc3, eplb, flashcomm2 2
    pc = SimpleNamespace(tensor_parallel_size=world, data_parallel_size=1,
                         pipeline_parallel_size=1, prefill_context_parallel_size=1)
    opts = ps.AscendParallelOptions(pd_tp_ratio=2, pd_head_ratio=2, is_kv_producer=True,
                                    multistream_overlap_gate=True, dynamic_eplb=True,
                                    flashcomm2_oproj_tensor_parallel_size=2, layer_sharding=True)
    ps.init_ascend_model_parallel(pc, opts)
    out["initialized_after"] = ps.model_parallel_initialized()
    for name, getter in (("p_tp", ps.get_p_tp_group), ("mc2", ps.get_mc2_group),
                         ("fc3", ps.get_fc3_quant_x_group), ("eplb", ps.get_dynamic_eplb_group),
                         ("fc2_otp", ps.get_flashcomm2_otp_group),
                         ("fc2_odp", ps.get_flashcomm2_odp_group),
                         ("shard", ps.get_shard_weight_group)):
        _rec(out, f"r1_{name}", lambda g=getter: _group_facts(g()))
    _rec(out, "r1_otp_missing", ps.get_otp_group)
    _rec(out, "r1_p_tp_again", lambda: ps.init_p_tp_group(pc, 2) is ps.get_p_tp_group())
    _rec(out, "r1_p_tp_other_layout", lambda: ps.init_p_tp_group(pc, 1))

    def gather_coordinator() -> Any:
        output = torch.empty(2 * world, 2)
        got, work = utils.all_gather_async(rows, ps.get_mc2_group(), output=output)
        work.wait()
        assert got is output
        return output

    _rec(out, "all_gather_async_coordinator", gather_coordinator)
    k = kv_input(rank, 4, 2, 3)
    v = kv_input(rank, 4, 2, 3, salt=1)
    _rec(out, "kv_alltoall", lambda: utils.kv_alltoall_and_rearrange(2, k, v))
    _rec(out, "kv_alltoall_noop", lambda: utils.kv_alltoall_and_rearrange(1, k, v))

    # -- fc3 all-gather and unpad
    from vllm.forward_context import DPMetadata, ForwardContext, override_forward_context

    def ctx(dp: Any = None, **extra: Any) -> Any:
        return ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                              dp_metadata=dp, additional_kwargs=extra)

    counts = FC3_COUNTS[world]
    padded = FC3_PADDED[world]
    per_rank = len(counts) * padded // world
    piece = rows_input(rank, per_rank)
    _rec(out, "fc3_no_context", lambda: utils.fc3_all_gather_and_maybe_unpad_impl(piece))

    def fc3(context: Any, **kw: Any) -> Any:
        with override_forward_context(context):
            return utils.fc3_all_gather_and_maybe_unpad_impl(piece, **kw)

    _rec(out, "fc3_pad", lambda: fc3(ctx(pad_size=1)))
    _rec(out, "fc3_pad_kwarg", lambda: fc3(ctx(), pad_size=2))
    dp_meta = DPMetadata(num_tokens_across_dp_cpu=torch.tensor(counts))
    _rec(out, "fc3_dp", lambda: fc3(ctx(dp_meta, padded_length=padded)))
    _rec(out, "fc3_dp_bad_length", lambda: fc3(ctx(dp_meta), padded_length=padded + 1))

    ps.destroy_ascend_model_parallel()
    out["initialized_after_destroy"] = ps.model_parallel_initialized()
    _rec(out, "p_tp_after_destroy", ps.get_p_tp_group)

    # -- round 2: dp x tp layout with fine-grained TP groups (world 4: dp 2, tp 2)
    dp = 2 if world >= 4 else 1
    pc2 = SimpleNamespace(tensor_parallel_size=world // dp, data_parallel_size=dp,
                          pipeline_parallel_size=1, prefill_context_parallel_size=1)
    opts2 = ps.AscendParallelOptions(oproj_tensor_parallel_size=dp, lmhead_tensor_parallel_size=dp,
                                     mlp_tensor_parallel_size=1)
    ps.init_ascend_model_parallel(pc2, opts2)
    for name, getter in (("mc2", ps.get_mc2_group), ("otp", ps.get_otp_group),
                         ("lmtp", ps.get_lmhead_tp_group), ("mlp", ps.get_mlp_tp_group)):
        _rec(out, f"r2_{name}", lambda g=getter: _group_facts(g()))
    out["r2_same_object"] = ps.get_otp_group() is ps.get_lmhead_tp_group()
    _rec(out, "r2_p_tp_missing", ps.get_p_tp_group)
    ps.destroy_ascend_model_parallel()

    # -- round 3: flashcomm2 with o_proj TP 1 borrows vLLM's TP group and does not destroy it
    import vllm.distributed.parallel_state as vps

    tp_group = vps.init_model_parallel_group([list(range(world))], rank, "gloo",
                                             group_name="vllm_tp_stand_in")
    vps._TP = tp_group
    try:
        ps.init_ascend_model_parallel(pc, ps.AscendParallelOptions(
            flashcomm2_oproj_tensor_parallel_size=1))
        out["r3_odp_is_vllm_tp"] = ps.get_flashcomm2_odp_group() is tp_group
        out["r3_otp_is_none"] = ps.get_flashcomm2_otp_group() is None
        ps.destroy_ascend_model_parallel()
        _rec(out, "r3_vllm_tp_alive", lambda: _group_facts(tp_group))
    finally:
        vps._TP = None
    dist.barrier()
    return out


SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "dist_utils": scenario_dist_utils,
}


# ---------------------------------------------------------------- process plumbing
def _child(scenario: str, rank: int, world: int, port: int, out_dir: str) -> None:
    log = open(Path(out_dir) / f"rank{rank}.log", "w")  # noqa: SIM115 - the child's lifetime
    sys.stdout = sys.stderr = log
    os.environ.update(CHILD_ENV)
    code = 0
    try:
        import torch

        torch.set_num_threads(1)
        from vllm.distributed.parallel_state import init_distributed_environment

        init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", local_rank=rank,
                                     backend="gloo", timeout=timedelta(seconds=60))
        result = SCENARIOS[scenario](rank, world)
    except BaseException:
        result = {"fatal": traceback.format_exc()}
        code = 1
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    log.flush()
    try:
        import torch.distributed as dist

        if dist.is_initialized() and not code:
            dist.destroy_process_group()
    finally:
        os._exit(code)  # skip interpreter teardown: nothing left to flush, no hang in atexit


def run_world(scenario: str, world_size: int, out_dir: Path,
              timeout: float = 300.0) -> list[dict[str, Any]]:
    """Run ``scenario`` on ``world_size`` spawned ranks; returns each rank's result, rank order.

    Raises:
        RuntimeError: A rank failed, crashed or timed out (its log is in the message).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_child, args=(scenario, r, world_size, port, str(out_dir)),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    problems = []
    results = []
    for r, p in enumerate(procs):
        path = out_dir / f"rank{r}.json"
        data = json.loads(path.read_text()) if path.exists() else {"fatal": "no result"}
        results.append(data)
        if p.exitcode != 0 or "fatal" in data:
            log = (out_dir / f"rank{r}.log")
            tail = log.read_text()[-3000:] if log.exists() else ""
            problems.append(f"rank {r}: exit code {p.exitcode}\n{data.get('fatal', '')}\n{tail}")
    if problems:
        raise RuntimeError(f"scenario {scenario!r} on {world_size} ranks failed:\n"
                           + "\n".join(problems))
    return results
