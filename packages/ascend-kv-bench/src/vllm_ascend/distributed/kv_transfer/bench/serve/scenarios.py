# SPDX-License-Identifier: Apache-2.0
"""The flows ``bench serve``'s scenarios run on real engines, and the state of a run.

A :class:`~.spec.Scenario`'s ``run`` drives engines through :func:`cache_flow` (one
engine: cold, device hit, hit after ``reset_prefix_cache``, throughput) or
:func:`~.pd.pd_flow` (P prefills, D's TTFT is timed), on the engines and prompts of a
:class:`Run`. The scenarios themselves: :mod:`.builtin` (the engine without a connector
and vLLM's own connectors) and :mod:`.p2p`, :mod:`.pool`, :mod:`.offload` (ours), gathered
by :func:`.command.scenarios`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import statistics
import tempfile
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..benchutil import Steps, median
from ..engine_env import STEADY_MALLOC_ENV
from ..mooncake_store import LoopbackMooncakeStore
from .child import EngineChild
from .spec import PD_BINDINGS, ServeConfig

logger = logging.getLogger(__name__)


def engine_malloc_env() -> dict[str, str]:
    """The malloc settings of the run's engines: :data:`~.engine_env.STEADY_MALLOC_ENV`,
    with this process's own value of a variable where it sets one."""
    return {k: os.environ.get(k, v) for k, v in STEADY_MALLOC_ENV.items()}


def prompt_lengths(target: int, block: int) -> list[int]:
    """``k*block``, ``k*block + 1`` and ``k*block + block/2`` with ``k*block`` near ``target``.

    Raises:
        ValueError: ``block`` is not positive or ``target`` is below one block.
    """
    if block <= 0 or target < block:
        raise ValueError(f"need a prompt of at least one block (target {target}, block {block})")
    k = max(1, round(target / block))
    return [k * block, k * block + 1, k * block + block // 2]


def make_prompts(lengths: list[int], seed: int, vocab: int) -> list[list[int]]:
    """Random token-id prompts (reproducible; ids 3..vocab-1, no special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def make_model(path: Path, spec: dict[str, Any], dtype: str = "float32") -> Path:
    """Save a random-weight Llama of ``spec`` to ``path`` once (no download)."""
    stamp = path / ".bench-serve-spec.json"
    want = {**spec, "dtype": dtype}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**spec)).to(getattr(torch, dtype))
    model.save_pretrained(path)
    stamp.write_text(json.dumps(want))
    return path


def binding_env(binding: str | None) -> tuple[dict[str, str], dict[str, str]]:
    """``VLLM_CPU_OMP_THREADS_BIND`` of P and of D under ``binding``.

    ``pinned`` on a machine of one CPU puts both on core 0; ``bind=<v>`` gives both ``v``;
    ``None`` or ``""``: vLLM's default.

    Raises:
        ValueError: an unknown binding name.
    """
    if not binding:
        return {}, {}
    if binding.startswith("bind="):
        v = binding[5:]
        return ({"VLLM_CPU_OMP_THREADS_BIND": v}, {"VLLM_CPU_OMP_THREADS_BIND": v}) if v \
            else ({}, {})
    if binding not in PD_BINDINGS:
        raise ValueError(f"unknown P/D binding {binding!r}; known: {sorted(PD_BINDINGS)} or "
                         "bind=<VLLM_CPU_OMP_THREADS_BIND>")
    p, d = PD_BINDINGS[binding]
    if binding == "pinned" and (os.cpu_count() or 1) < 2:
        d = p
    return {"VLLM_CPU_OMP_THREADS_BIND": p}, {"VLLM_CPU_OMP_THREADS_BIND": d}


def llm_kwargs(cfg: ServeConfig, kv: dict[str, Any] | None) -> dict[str, Any]:
    """``vllm.LLM`` arguments of every engine of the run (only the connector differs)."""
    kw: dict[str, Any] = dict(model=cfg.model, skip_tokenizer_init=True, dtype=cfg.dtype,
                              max_model_len=cfg.max_model_len, enforce_eager=True,
                              max_num_seqs=max(4, cfg.throughput_batch), seed=0,
                              block_size=cfg.block_size, enable_prefix_caching=True)
    if kv is not None:
        kw["kv_transfer_config"] = kv
    return kw


class Run:
    """State shared by the scenarios of one run: config, prompts, baseline results."""

    def __init__(self, cfg: ServeConfig, steps: Steps) -> None:
        self.cfg = cfg
        self.steps = steps
        self.vocab = int(cfg.model_spec["vocab_size"])
        #: the prompts of the current round (:meth:`start_round`)
        self.prompts = make_prompts(cfg.lengths, cfg.seed + 1, self.vocab)
        #: the P/D prompts: the same every round (P's own prefix cache keeps P's part cheap)
        self.pd_prompts = make_prompts(cfg.pd_lengths or cfg.lengths, cfg.seed + 3, self.vocab)
        self.warmup = make_prompts([max(8, cfg.block_size // 2)], cfg.seed + 2, self.vocab)[0]
        # fresh prompts for each throughput sample (no sample hits another's prefix)
        self.batches = [make_prompts([cfg.throughput_prompt] * cfg.throughput_batch,
                                     cfg.seed + 10 + r, self.vocab) for r in range(cfg.repeats)]
        #: the round being measured, and the P/D thread binding of this pass
        self.round = 0
        self.binding: str | None = None
        #: engines kept up across the rounds of one family, by scenario (and binding)
        self.live: dict[str, list[EngineChild]] = {}
        #: values a scenario must keep across its rounds (e.g. the port its kept P listens on)
        self.memo: dict[str, Any] = {}
        # what scenarios started besides engines (e.g. a metaserver), stopped by close()
        self._closers: list[Callable[[], None]] = []
        #: the engine without a connector, kept for the whole run: its recompute and
        #: throughput are measured again next to every scenario (a shared machine drifts)
        self.base_engine: EngineChild | None = None
        self.store: LoopbackMooncakeStore | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))

    def engine(self, name: str, kv: dict[str, Any] | None, *, env: dict[str, str] | None = None,
               python: str | None = None, pre_import: list[str] | None = None) -> EngineChild:
        """Start one engine of scenario ``name`` (its log under ``<out>/serve-logs``)."""
        self.steps.note(f"starting engine {name}")
        sys_path = [self.cfg.peers_path] if self.cfg.peers_path else []
        env = {**engine_malloc_env(), **(env or {})}
        return EngineChild(llm_kwargs(self.cfg, kv), env=env, python=python,
                           pre_import=pre_import, sys_path=sys_path,
                           log=self.cfg.out / "serve-logs" / f"{name.replace('/', '-')}.log",
                           timeout=self.cfg.startup_timeout)

    def start_round(self, index: int, *, pd: bool = False) -> None:
        """Make round ``index`` current: fresh prompts (a cold request must miss every
        cache, a save must write) and a fresh throughput batch; P/D keeps its prompts."""
        self.round = index
        if not pd:
            seed = self.cfg.seed + 1 + 1000 * index
            self.prompts = make_prompts(self.cfg.lengths, seed, self.vocab)
            self.batches = [make_prompts([self.cfg.throughput_prompt] * self.cfg.throughput_batch,
                                         seed + 500, self.vocab)]

    def kept(self, key: str, start: Callable[[], list[EngineChild]], *,
             pause_others: bool = False) -> list[EngineChild]:
        """The engines of ``key``, started by ``start`` on first use and kept up until
        :meth:`close_live` (the rounds of one family measure the same engines).

        With ``pause_others`` (P/D: three pairs of engines on two cores), every other kept
        engine and the engine without a connector are paused first (SIGSTOP; a call
        continues them): idle engines kept up beside the measured pair took its CPU time
        (device-hit floors from 0.08 s in the first round to seconds in later ones)."""
        if pause_others:
            for other, engines in self.live.items():
                if other != key:
                    for eng in engines:
                        eng.pause()
            if self.base_engine is not None:
                self.base_engine.pause()
        if key not in self.live:
            self.live[key] = start()
        for eng in self.live[key]:
            eng.resume()
        return self.live[key]

    def pause_live(self) -> None:
        """Pause every kept engine (before the P/D reference is measured on the engine
        without a connector)."""
        for engines in self.live.values():
            for eng in engines:
                eng.pause()

    def drop(self, key: str) -> None:
        """Stop the engines of ``key`` (after a failure: the next round starts them again)."""
        for eng in reversed(self.live.pop(key, [])):
            eng.close()

    def close_live(self) -> None:
        """Stop every kept engine (the family's rounds are done), side by side: each waits
        for vLLM's shutdown, seconds an engine one after the other (a family keeps 8)."""
        engines = [eng for key in list(self.live) for eng in reversed(self.live.pop(key))]
        with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
            list(pool.map(lambda eng: eng.close(), engines))

    def mooncake_store(self) -> LoopbackMooncakeStore:
        """The run's Mooncake Store (master + pool holder), started on first use, its
        segment written once and emptied (:meth:`~.mooncake_store.LoopbackMooncakeStore.
        touch_segment`): the connectors that share it are measured on a Store whose memory
        is in use, as a long-running one's is, not on the first touch of its pages, which
        fell on whichever connector wrote first."""
        if self.store is None:
            store = LoopbackMooncakeStore("1GB", self.tmp / "mooncake").start()
            try:
                done = store.touch_segment()
            except BaseException:
                store.stop()
                raise
            self.store = store
            self.steps.note(f"Mooncake Store: segment written once ({done['bytes'] >> 20} MiB "
                            f"in {done['seconds']:.1f} s) and emptied before the rounds")
        return self.store

    def on_close(self, stop: Callable[[], None]) -> None:
        """Have :meth:`close` call ``stop`` (after the engines; last registered first)."""
        self._closers.append(stop)

    def close(self) -> None:
        """Stop what the run started and remove its scratch files (saved KV, Store logs)."""
        self.close_live()
        while self._closers:
            try:
                self._closers.pop()()
            except Exception:  # one that fails must not keep the others running
                logger.exception("bench serve: stopping a scenario's helper failed")
        if self.base_engine is not None:
            self.base_engine.close()
            self.base_engine = None
        if self.store is not None:
            self.store.stop()
            self.store = None
        shutil.rmtree(self.tmp, ignore_errors=True)


def first_output(out: dict[str, Any]) -> dict[str, Any]:
    """The first output of an engine's ``generate`` answer."""
    return dict(out["outputs"][0])


def cache_flow(run: Run, eng: EngineChild, name: str) -> dict[str, Any]:
    """Cold TTFT, device-cache hit, and TTFT after ``reset_prefix_cache`` of every prompt
    (the median of ``repeats`` of those); then the throughput batches (the best).
    Used for the baseline and every pool/offload connector.

    The device-cache hit (vLLM computing only the last token, :func:`last_token_floor`) is
    the floor of a hit on this engine: a hit's overhead is its TTFT minus that floor."""
    eng.generate([run.warmup])
    rows = []
    for prompt in run.prompts:
        cold = eng.generate([prompt])
        eng.call("settle", timeout=30, sleep=0.3)  # background saves finish
        device_s = last_token_floor(eng, prompt, run.cfg.block_size)
        agains = []
        resets = []
        for _ in range(run.cfg.repeats):
            resets.append(bool(eng.call("reset_prefix_cache")))
            agains.append(eng.generate([prompt]))
            eng.call("settle", timeout=30, sleep=0.1)
        resets.append(bool(eng.call("reset_prefix_cache")))
        if not all(resets):
            run.steps.note(f"{name}: {len(prompt)} tokens: reset_prefix_cache refused "
                           f"{resets.count(False)} time(s): a hit after it may be vLLM's own")
        c = first_output(cold)
        again_s = median(a["seconds"] for a in agains)
        a = first_output(agains[-1])
        rows.append({"tokens": len(prompt), "cold_s": cold["seconds"],
                     "device_hit_s": device_s, "again_s": again_s,
                     "again_samples": [x["seconds"] for x in agains],
                     "again_cached": a["cached"],
                     "again_external": agains[-1].get("external_tokens"),
                     "cold_token": (c["tokens"] or [None])[0],
                     "again_token": (a["tokens"] or [None])[0],
                     "again_tokens_all": [(first_output(x)["tokens"] or [None])[0] for x in agains],
                     # False: vLLM kept its cache, so that sample was not a connector hit
                     "resets_ok": resets,
                     "finish": a["finish_reason"]})
        run.steps.note(f"{name}: {len(prompt)} tokens: cold {cold['seconds']:.3f}s, "
                       f"after reset {again_s:.3f}s ({a['cached']} cached)")
    best: dict[str, Any] | None = None
    for batch in run.batches:
        thr = eng.generate(batch, max_tokens=run.cfg.throughput_tokens)
        out_tokens = sum(len(o["tokens"]) for o in thr["outputs"])
        in_tokens = sum(len(p) for p in batch)
        cur = {"seconds": thr["seconds"], "requests": len(batch), "output_tokens": out_tokens,
               "output_tok_per_s": out_tokens / thr["seconds"],
               "total_tok_per_s": (out_tokens + in_tokens) / thr["seconds"]}
        if best is None or cur["output_tok_per_s"] > best["output_tok_per_s"]:
            best = cur
    return {"prompts": rows, "throughput": best or {}}


#: Samples of a floor (a device-cache hit: the last token only; cheap), median kept: the
#: overhead over the floor is a difference of two times, so the floor must not add noise.
FLOOR_SAMPLES = 3


def floor(eng: EngineChild, prompt: list[int]) -> float:
    """The engine's TTFT on a device-cache hit of ``prompt`` (already in its cache): vLLM
    computes only the last token. Median of :data:`FLOOR_SAMPLES`."""
    return float(statistics.median(eng.generate([prompt])["seconds"]
                                   for _ in range(FLOOR_SAMPLES)))


def last_token_floor(eng: EngineChild, prompt: list[int], block_size: int) -> float:
    """The floor of a hit of ``prompt``: the engine's TTFT on a device-cache hit in which
    vLLM computes only the last token, as it does once a connector loaded the whole prompt
    (P/D's D; a pool hit of every token but the last).

    vLLM's prefix cache hits whole blocks and at most the prompt's length less one token,
    so a device hit of a prompt that fills whole blocks recomputes its whole last block
    (128 tokens at block size 128), not one token: such a floor was higher than D's own
    forward, and D's overhead over it came out negative in rounds. A prompt that fills whole
    blocks is therefore measured with one more token (its own blocks hit, the one token is
    computed); another length as it is (vLLM computes the tokens of its partial block).
    Median of :data:`FLOOR_SAMPLES`."""
    probe = [*prompt, prompt[-1]] if prompt and len(prompt) % block_size == 0 else prompt
    return floor(eng, probe)


def reference(run: Run, prompts: list[list[int]] | None = None, *,
              throughput: bool = True) -> dict[str, Any] | None:
    """Recompute TTFT, device-cache hit and throughput of the engine without a connector,
    measured now (next to the scenario that uses them); ``None`` without that engine."""
    eng = run.base_engine
    if eng is None:
        return None
    recompute, device, tokens = {}, {}, {}
    for prompt in run.prompts if prompts is None else prompts:
        eng.call("reset_prefix_cache")
        out = eng.generate([prompt])
        recompute[len(prompt)] = out["seconds"]
        tokens[len(prompt)] = (first_output(out)["tokens"] or [None])[0]
        device[len(prompt)] = eng.generate([prompt])["seconds"]
    eng.call("reset_prefix_cache")
    ref: dict[str, Any] = {"recompute_s": recompute, "device_hit_s": device, "tokens": tokens}
    if throughput:
        thr = eng.generate(run.batches[0], max_tokens=run.cfg.throughput_tokens)
        out_tokens = sum(len(o["tokens"]) for o in thr["outputs"])
        ref["output_tok_per_s"] = out_tokens / thr["seconds"]
    return ref


def warm_up(run: Run, eng: EngineChild, name: str) -> dict[str, Any]:
    """A fresh engine's first requests at the run's sizes, before its first round: one
    prompt of the longest length and one throughput batch, new prompts of their own (a
    connector saves them, and no round's prompt hits them).

    The first large requests of a process cost more than the next ones (on this VM, a
    connector engine's first round took 0.6-1.9 s where the rounds after took 0.45-0.6 s,
    as did the engine without a connector once it had served a first request); the engine
    without a connector had always served a first request before the rounds, the others
    served theirs in round 1. Every engine now serves them here, and they are reported
    (``warm_up``), not hidden."""
    cfg = run.cfg
    seed = cfg.seed + 7 + zlib.crc32(name.encode())
    prompt = make_prompts([max(cfg.lengths)], seed, run.vocab)[0]
    first = eng.generate([prompt])
    eng.call("settle", timeout=30, sleep=0.3)
    batch = make_prompts([cfg.throughput_prompt] * cfg.throughput_batch, seed + 1, run.vocab)
    thr = eng.generate(batch, max_tokens=cfg.throughput_tokens)
    eng.call("settle", timeout=30, sleep=0.3)
    out = {"tokens": len(prompt), "first_request_s": first["seconds"],
           "first_batch_s": thr["seconds"], "batch_tokens": cfg.throughput_prompt}
    run.steps.note(f"{name}: warm-up: a first request of {len(prompt)} tokens "
                   f"{first['seconds']:.3f}s, a first batch {thr['seconds']:.3f}s")
    return out


def run_single(run: Run, name: str, kv: dict[str, Any] | None,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """One engine (pool or offload connector) through :func:`cache_flow`.

    The engine is started on the first round, warmed up (:func:`warm_up`, reported with
    that round as ``warm_up``) and kept up for the family's next rounds (:meth:`Run.kept`);
    a failure stops it."""
    fresh = name not in run.live
    (eng,) = run.kept(name, lambda: [run.engine(name, kv, env=env)])
    try:
        warm = warm_up(run, eng, name) if fresh else None
        data = cache_flow(run, eng, name)
    except BaseException:
        run.drop(name)
        raise
    if warm is not None:
        data["warm_up"] = warm
    return data
