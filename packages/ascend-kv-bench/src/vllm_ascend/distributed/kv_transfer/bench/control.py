# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench control``: the P/D connectors' control plane at fleet size.

No engine runs. The scheduler half of ``MooncakeConnectorV1`` and of vLLM's own
``NixlConnector`` (its pull connector), each built by vLLM's ``KVConnectorFactory`` with
``KVConnectorRole.SCHEDULER`` from a real ``VllmConfig`` and ``KVCacheConfig`` (one
full-attention group, a model of a ``config.json`` only), are driven with real vLLM
``Request`` and ``KVCacheBlocks`` objects the way vLLM's scheduler calls them, step by step,
with a fixed number ``K`` of requests changing per step while ``N`` others are in flight
(vLLM's own ``Scheduler`` is not used: at 16k requests in flight its allocator and queues
would dominate what is timed). Per step, every hook the step calls is timed:

P (``kv_producer``): ``K`` new requests (``on_new_request``, ``get_num_new_matched_tokens``,
``update_state_after_alloc``), ``build_connector_meta``, ``K`` requests that prefilled finish
(``request_finished_all_groups``: held for D), and ``update_connector_output`` with the ``K``
oldest held ones D was done with. ``N`` requests stay held.

D (``kv_consumer``): ``K`` requests arrive with the params of a P of the same connector
(``on_new_request``, ``get_num_new_matched_tokens``; they then wait in the queue), ``K``
queued ones are allocated (``get_num_new_matched_tokens`` again, as vLLM asks when it
schedules one, and ``update_state_after_alloc``), ``build_connector_meta``,
``update_connector_output`` with the ``K`` loads that ended, and ``K`` requests that decoded
finish (``request_finished_all_groups``). Of the ``N`` in flight half are queued, half
loading or decoding. The params come from P's ``request_finished`` (untimed), fresh each
step, so they are within P's read window (``read_window_s``, set long here): our D claims
nothing ahead (no side-channel dial from the scheduler's thread; the claim, when one is
sent, goes on its own thread anyway) and its lease renewer (a background thread, one round
per ``lease_ttl_s / 3``) sends no round during the run.

``D-claimed``: D again, P's read window off (``read_window_s`` 0, ours only), so our scheduler
claims every request ahead, from a P that does not answer (nothing listens at P's port): the
claims stay out while their requests are allocated, load and finish (a P slow to answer).
vLLM's ``NixlConnector`` claims nothing; its D runs as in ``D``.

The heap as it is once the connectors are built is frozen (``gc.freeze``), as vLLM's engine
core does once it started; the requests in flight are collected as in vLLM, and the full
collections (generation 2) during each side's steps are counted (their pauses land in
whichever hook allocates when one is due: the p99).

Ours and the peer are kept at the same ``N`` side by side and measured in alternating rounds
(``--rounds``, the one going first alternating) of ``--steps`` steps each; per step the
total time of its hooks. Reported per role and ``N``: median and p99 per step (µs), ours /
the peer's per-round medians (``stats.compare``), and the median per hook.

P's holder (``pull.holder.LeaseHolder``, the worker side) with ``N`` held requests, driven
through its side-channel handler (no socket): claims, ``Done`` messages (each releasing a
request, which is then held again under a new id) and lease sweeps (``collect_finished``,
vLLM's ``get_finished`` step) per second.

A request's params, part by part (:func:`.control_parts.measure_parts`): what P's
``request_finished`` does for each request it holds for D (the capability token, the read
window's tag, the params, their MAC) and what D's scheduler
checks of them (the MAC, the parse, the read window's tag), each timed apart with the
functions the schedulers call, without a deployment key and with one, in the same kind of
alternating rounds. Each hook's time is also recorded per round (µs a step), so a step's
time can be split by hook.

Writes ``<out>/control.json`` and a ledger entry; never fails on a number.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import tempfile
import time
import types
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .benchutil import add_common_args, format_table, write_results
from .control_parts import (
    KEY_MODES,
    PART_CALLS,
    PARTS,
    QUICK_PART_CALLS,
    measure_holder,
    measure_parts,
)
from .ledger import series
from .stats import compare, verdict

#: Requests in flight of a full run and of --quick.
COUNTS = (1024, 4096, 16384)
QUICK_COUNTS = (100, 400)
CONNECTORS = {"ours": "MooncakeConnectorV1", "peer": "NixlConnector"}
#: Each role measured and its vLLM ``kv_role``; ``D-claimed`` is D whose every request our
#: scheduler claims ahead (P's read window off) from a P that does not answer: the claims
#: stay out while the requests are allocated, load and finish.
ROLES = {"P": "kv_producer", "D": "kv_consumer", "D-claimed": "kv_consumer"}
#: The hooks a step calls, in the order reported.
HOOKS = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
         "build_connector_meta", "update_connector_output", "request_finished")
#: A model vLLM's config reads (no weights: no engine runs).
MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 8192, "torch_dtype": "float32"}
#: Our connector's options here: a read window longer than any run (see the docstring).
EXTRA_CONFIG = {"lease_ttl_s": 600.0, "max_hold_s": 1200.0, "read_window_s": 300.0}
#: ... and for ``D-claimed`` (its P too): no read window, a claim given up after a second.
CLAIMED_CONFIG = {**EXTRA_CONFIG, "read_window_s": 0.0, "handshake_timeout_s": 1.0}


# ---------------------------------------------------------------------- vLLM objects
def model_dir(out: Path) -> Path:
    path = out / "control-model"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return path


def make_connector(name: str, kv_role: str, model: Path, *, block_size: int,
                   max_len: int, extra: dict[str, Any] | None = None) -> Any:
    """The scheduler half of connector ``name`` as vLLM builds it."""
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from vllm_ascend.distributed.kv_transfer.kv_p2p import register

    register()
    mc = ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32",
                     max_model_len=max_len, enforce_eager=True, seed=0)
    vc = VllmConfig(
        model_config=mc, cache_config=CacheConfig(block_size=block_size),
        scheduler_config=SchedulerConfig(max_num_seqs=256,
                                         max_num_batched_tokens=max(max_len, 256),
                                         max_model_len=max_len, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector=name, kv_role=kv_role, engine_id=f"control-{name}-{kv_role}",
            kv_connector_extra_config=dict(extra or EXTRA_CONFIG)
            if name == CONNECTORS["ours"] else {}),
        device_config=DeviceConfig("cpu"))
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=16,
                             dtype=torch.float32)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    kcc = KVCacheConfig(num_blocks=1 << 22, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return KVConnectorFactory.create_connector(vc, KVConnectorRole.SCHEDULER, kcc)


class Requests:
    """vLLM ``Request`` objects of one prompt length, with fresh ids and blocks."""

    def __init__(self, tag: str, prompt_tokens: int, block_size: int) -> None:
        self.tag = tag
        self.prompt = list(range(100, 100 + prompt_tokens))
        self.blocks_per = -(-prompt_tokens // block_size)
        self._ids = itertools.count()
        self._next_block = 0

    def new(self, params: dict[str, Any] | None) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        return Request(f"{self.tag}-{next(self._ids)}", self.prompt, sp, None)

    def blocks(self) -> Any:
        """A new allocation of the prompt's blocks (never hashed: D's to load into)."""
        from vllm.v1.core.kv_cache_manager import KVCacheBlocks
        from vllm.v1.core.kv_cache_utils import KVCacheBlock

        first = self._next_block
        self._next_block = (first + self.blocks_per) % ((1 << 22) - self.blocks_per)
        return KVCacheBlocks(([KVCacheBlock(first + i) for i in range(self.blocks_per)],))

    @staticmethod
    def ids(blocks: Any) -> tuple[list[int], ...]:
        """The block ids of an allocation, by group (what vLLM hands ``request_finished``)."""
        return tuple([b.block_id for b in group] for group in blocks.blocks)


def _finish(request: Any) -> None:
    """The request computed its prompt and its one token (vLLM's state when it ends)."""
    from vllm.v1.request import RequestStatus

    request.num_computed_tokens = request.num_prompt_tokens
    request.append_output_token_ids(7)
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED


def _step_output(tokens: int) -> Any:
    """What ``build_connector_meta`` reads of vLLM's ``SchedulerOutput`` (its host-buffer
    save, off on CPU, would read the scheduled requests)."""
    return types.SimpleNamespace(total_num_scheduled_tokens=tokens, scheduled_new_reqs=[],
                                 scheduled_cached_reqs=None, num_scheduled_tokens={})


def _connector_output(**sets: set[str]) -> Any:
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(**sets)


class Timer:
    """Nanoseconds per hook within one step."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = dict.fromkeys(HOOKS, 0)

    def call(self, hook: str, fn: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = fn(*args)
        self.ns[hook] += time.perf_counter_ns() - t0
        return out


# ---------------------------------------------------------------------- P and D pipelines
class ProducerSide:
    """P: ``n`` requests held, ``k`` new, ``k`` finishing and ``k`` released a step."""

    def __init__(self, connector: Any, reqs: Requests, n: int, k: int) -> None:
        self.c, self.reqs, self.n, self.k = connector, reqs, n, k
        self.prefilling: list[tuple[Any, Any]] = []
        self.held: deque[Any] = deque()

    def step(self) -> Timer:
        t, c, k = Timer(), self.c, self.k
        new = [self.reqs.new({"do_remote_decode": True, "do_remote_prefill": False})
               for _ in range(k)]
        allocs = [self.reqs.blocks() for _ in new]
        for r, blocks in zip(new, allocs, strict=True):
            t.call("on_new_request", c.on_new_request, r)
            t.call("get_num_new_matched_tokens", c.get_num_new_matched_tokens, r, 0)
            t.call("update_state_after_alloc", c.update_state_after_alloc, r, blocks, 0)
        t.call("build_connector_meta", c.build_connector_meta,
               _step_output(k * len(self.reqs.prompt)))
        done = [self.held.popleft()
                for _ in range(min(k, max(0, len(self.held) - self.n + k)))]
        t.call("update_connector_output", c.update_connector_output,
               _connector_output(finished_sending={r.request_id for r in done}))
        for r, blocks in self.prefilling:
            _finish(r)
            t.call("request_finished", c.request_finished_all_groups, r, Requests.ids(blocks))
            self.held.append(r)
        self.prefilling = list(zip(new, allocs, strict=True))
        return t

    def fill(self) -> None:
        while len(self.held) < self.n:
            self.step()


class ConsumerSide:
    """D: ``n`` requests in flight (half queued, half loading or decoding), ``k`` arriving,
    allocated, loaded and finished a step; params from ``source`` (P of the same connector)."""

    def __init__(self, connector: Any, source: Any, reqs: Requests, p_reqs: Requests,
                 n: int, k: int) -> None:
        self.c, self.source, self.reqs, self.p_reqs = connector, source, reqs, p_reqs
        self.n, self.k = n, k
        self.queued: deque[Any] = deque()
        #: allocated: (request, its blocks)
        self.loading: deque[tuple[Any, Any]] = deque()
        self.decoding: deque[tuple[Any, Any]] = deque()

    def _params(self) -> dict[str, Any]:
        """Fresh params of P's ``request_finished`` (untimed)."""
        pr = self.p_reqs.new({"do_remote_decode": True, "do_remote_prefill": False})
        self.source.update_state_after_alloc(pr, self.p_reqs.blocks(), 0)
        _finish(pr)
        _, params = self.source.request_finished_all_groups(
            pr, (list(range(self.p_reqs.blocks_per)),))
        assert params is not None, "P's connector returned no kv_transfer_params"
        return dict(params)

    def step(self) -> Timer:
        t, c, k = Timer(), self.c, self.k
        for _ in range(k):
            r = self.reqs.new(self._params())
            t.call("on_new_request", c.on_new_request, r)
            t.call("get_num_new_matched_tokens", c.get_num_new_matched_tokens, r, 0)
            self.queued.append(r)
        half = self.n // 2
        allocated = [self.queued.popleft() for _ in range(max(0, len(self.queued) - half))]
        for r in allocated:
            blocks = self.reqs.blocks()
            count, _ = t.call("get_num_new_matched_tokens", c.get_num_new_matched_tokens, r, 0)
            t.call("update_state_after_alloc", c.update_state_after_alloc, r, blocks, count or 0)
            self.loading.append((r, blocks))
        t.call("build_connector_meta", c.build_connector_meta, _step_output(k))
        rest = self.n - half
        loaded = [self.loading.popleft()
                  for _ in range(max(0, len(self.loading) - rest // 2))]
        t.call("update_connector_output", c.update_connector_output,
               _connector_output(finished_recving={r.request_id for r, _ in loaded}))
        self.decoding.extend(loaded)
        ended = [self.decoding.popleft()
                 for _ in range(max(0, len(self.decoding) - (rest - rest // 2)))]
        for r, blocks in ended:
            _finish(r)
            t.call("request_finished", c.request_finished_all_groups, r, Requests.ids(blocks))
        return t

    def in_flight(self) -> int:
        return len(self.queued) + len(self.loading) + len(self.decoding)

    def fill(self) -> None:
        while self.in_flight() < self.n:
            self.step()


# ---------------------------------------------------------------------- the rounds
def measure_count(model: Path, role: str, n: int, *, k: int, rounds: int, steps: int,
                  prompt_tokens: int, block_size: int) -> dict[str, Any]:
    """Ours and the peer at ``n`` in flight: per side, per round, the step times (µs) and
    the hooks' (ns summed over the round)."""
    max_len = prompt_tokens + 2 * block_size
    sides: dict[str, Any] = {}
    extra = CLAIMED_CONFIG if role == "D-claimed" else EXTRA_CONFIG
    for side, name in CONNECTORS.items():
        c = make_connector(name, ROLES[role], model, block_size=block_size, max_len=max_len,
                           extra=extra)
        reqs = Requests(f"{side}-{role}-{n}", prompt_tokens, block_size)
        if role == "P":
            sides[side] = ProducerSide(c, reqs, n, k)
        else:
            src = make_connector(name, ROLES["P"], model, block_size=block_size,
                                 max_len=max_len, extra=extra)
            sides[side] = ConsumerSide(c, src, reqs, Requests(f"{side}-src-{n}",
                                                              prompt_tokens, block_size), n, k)
    # as vLLM's engine core does once it started (``freeze_gc_heap``): what exists now is
    # left out of the collector's full passes, what the requests in flight allocate is not
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()
    for s in sides.values():
        s.fill()
    out: dict[str, Any] = {side: {"steps": [], "hooks": dict.fromkeys(HOOKS, 0),
                                  "hook_rounds": {h: [] for h in HOOKS},
                                  "full_collections": 0} for side in sides}
    current: list[str] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2 and current:
            out[current[0]]["full_collections"] += 1

    gc.callbacks.append(count)
    try:
        for r in range(rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                for _ in range(2):  # warm after the other side's round
                    sides[side].step()
                per_round: list[float] = []
                round_ns = dict.fromkeys(HOOKS, 0)
                current[:] = [side]
                for _ in range(steps):
                    t = sides[side].step()
                    per_round.append(sum(t.ns.values()) / 1e3)
                    for hook, ns in t.ns.items():
                        round_ns[hook] += ns
                current.clear()
                out[side]["steps"].append(per_round)
                for hook, ns in round_ns.items():
                    out[side]["hooks"][hook] += ns
                    # the hook's mean µs a step over the round
                    out[side]["hook_rounds"][hook].append(ns / 1e3 / steps)
    finally:
        gc.callbacks.remove(count)
        gc.unfreeze()
    for s in sides.values():
        s.c.shutdown()
        if isinstance(s, ConsumerSide):
            s.source.shutdown()
    return out


def _p99(values: list[float]) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def summarize(measured: dict[tuple[str, int], dict[str, Any]], *, steps: int
              ) -> list[dict[str, Any]]:
    rows = []
    for (role, n), m in measured.items():
        row: dict[str, Any] = {"role": role, "in_flight": n}
        medians = {}
        for side in CONNECTORS:
            flat = [x for rnd in m[side]["steps"] for x in rnd]
            medians[side] = [statistics.median(rnd) for rnd in m[side]["steps"]]
            row[f"{side}_median_us"] = statistics.median(flat)
            row[f"{side}_p99_us"] = _p99(flat)
            total_steps = steps * len(m[side]["steps"])
            row[f"{side}_hooks_us_per_step"] = {h: ns / 1e3 / total_steps
                                                for h, ns in m[side]["hooks"].items()}
            row[f"{side}_full_collections"] = m[side].get("full_collections", 0)
        cmp = compare(medians["ours"], medians["peer"]).as_dict()
        row["ours_over_peer"] = cmp
        row["at_most_peer"] = verdict(cmp, at_most=1.0)
        rows.append(row)
    return rows


def growth(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per role and side: median per step at the largest ``N`` over at the smallest (1.0:
    flat; ``N`` times larger: linear in what is in flight)."""
    out: dict[str, dict[str, float]] = {}
    for role in ROLES:
        mine = sorted((r for r in rows if r["role"] == role), key=lambda r: r["in_flight"])
        if len(mine) < 2:
            continue
        out[role] = {side: mine[-1][f"{side}_median_us"] / mine[0][f"{side}_median_us"]
                     for side in CONNECTORS}
        out[role]["in_flight_ratio"] = mine[-1]["in_flight"] / mine[0]["in_flight"]
    return out


# ---------------------------------------------------------------------- CLI
def run(args: argparse.Namespace) -> int:
    """Run the section; print and write the results."""
    counts = tuple(args.counts or (QUICK_COUNTS if args.quick else COUNTS))
    rounds = args.rounds or (3 if args.quick else 9)
    steps = args.steps or (10 if args.quick else 60)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    with tempfile.TemporaryDirectory(prefix="control-model-") as tmp:
        model = model_dir(Path(tmp))
        measured: dict[tuple[str, int], dict[str, Any]] = {}
        for role in args.roles:
            for n in counts:
                print(f"{role} at {n} in flight", flush=True)
                measured[(role, n)] = measure_count(
                    model, role, n, k=args.changed, rounds=rounds, steps=steps,
                    prompt_tokens=args.prompt_tokens, block_size=args.block_size)
    rows = summarize(measured, steps=steps)
    holder = [measure_holder(n, batch=args.changed, rounds=rounds,
                             prompt_blocks=-(-args.prompt_tokens // args.block_size))
              for n in (args.holder_counts or counts)]
    parts = measure_parts(rounds=rounds, calls=QUICK_PART_CALLS if args.quick else PART_CALLS,
                          prompt_tokens=args.prompt_tokens, block_size=args.block_size)
    payload = {"changed_per_step": args.changed, "rounds": rounds, "steps_per_round": steps,
               "prompt_tokens": args.prompt_tokens, "block_size": args.block_size,
               "counts": list(counts), "connectors": CONNECTORS, "driven": "connector objects",
               "rows": rows, "growth": growth(rows), "holder": holder,
               "parts_us": {f"{side}/{part} ({mode})": statistics.median(v)
                            for (mode, side, part), v in parts.items()},
               "goal_met": all(r["at_most_peer"] for r in rows) if rows else None}
    samples = [series({"role": role, "in_flight": n, "connector": side, "metric": "step"},
                      m[side]["steps"], unit="us")
               for (role, n), m in measured.items() for side in CONNECTORS]
    samples += [series({"role": role, "in_flight": n, "connector": side, "metric": "hook",
                        "hook": hook}, [[x] for x in m[side]["hook_rounds"][hook]], unit="us")
                for (role, n), m in measured.items() for side in CONNECTORS for hook in HOOKS]
    samples += [series({"held": h["held"], "metric": metric}, [[x] for x in h["rounds"][metric]],
                       unit="1/s")
                for h in holder for metric in h["rounds"]]
    samples += [series({"metric": "part", "side": side, "part": part, "key": mode},
                       [[x] for x in v], unit="us")
                for (mode, side, part), v in parts.items()]
    path = write_results("control", payload, args.out, args=args, samples=samples)

    def interval(c: dict[str, Any]) -> str:
        return f"{c['ratio']:.2f} [{c['low']:.2f}, {c['high']:.2f}]" if c["low"] else "-"

    print(format_table([{
        "role": r["role"], "N": r["in_flight"], "ours med (us)": r["ours_median_us"],
        "p99": r["ours_p99_us"], "Nixl med (us)": r["peer_median_us"], "p99 ": r["peer_p99_us"],
        "ours/Nixl [95%]": interval(r["ours_over_peer"]),
        "full GCs ours/Nixl": f"{r['ours_full_collections']}/{r['peer_full_collections']}"}
        for r in rows]))
    print(format_table([{
        "held": h["held"], "claims/s": h["claims_per_s"], "Dones/s": h["dones_per_s"],
        "sweeps/s": h["sweeps_per_s"], "idle sweeps/s": h["idle_sweeps_per_s"],
        "holds/s": h["holds_per_s"]} for h in holder]))
    print(format_table([{"part": f"{side}: {part}",
                         **{mode: statistics.median(parts[(mode, side, part)])
                            for mode in KEY_MODES}}
                        for side, names in PARTS.items() for part in names]))
    print(f"results: {path}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Add ``bench control`` to the ``vllm-ascend-kv bench`` subcommands."""
    p = subparsers.add_parser("control", help="the P/D connectors' scheduler side and P's "
                                              "holder at 1k-16k requests in flight, against "
                                              "vLLM's NixlConnector (no engines)")
    add_common_args(p)
    p.add_argument("--counts", type=int, nargs="+",
                   help=f"requests in flight (default {' '.join(map(str, COUNTS))}; --quick "
                        f"{' '.join(map(str, QUICK_COUNTS))})")
    p.add_argument("--holder-counts", type=int, nargs="+",
                   help="requests P's holder holds (default: --counts)")
    p.add_argument("--roles", nargs="+", choices=tuple(ROLES), default=list(ROLES),
                   help="P (producer), D (consumer) or both (default)")
    p.add_argument("--changed", type=int, default=16,
                   help="requests of each change per step (default %(default)s)")
    p.add_argument("--rounds", type=int, help="alternating rounds (default 9; --quick 3)")
    p.add_argument("--steps", type=int, help="steps per round (default 60; --quick 10)")
    p.add_argument("--prompt-tokens", type=int, default=2048,
                   help="prompt length (default %(default)s)")
    p.add_argument("--block-size", type=int, default=128,
                   help="KV block size (default %(default)s)")
    p.set_defaults(func=run)
