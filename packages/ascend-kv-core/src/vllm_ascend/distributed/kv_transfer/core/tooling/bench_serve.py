# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench serve``: real vLLM CPU engines with and without each connector.

Every engine runs in its own process (vLLM keeps global state) on the same
model and the same token-id prompts, greedy, so the first token of every run
is checked against the engine without a connector. Scenarios:

``baseline``
    No connector: cold time to first token (TTFT = wall time of
    ``generate(max_tokens=1)``), recompute after ``reset_prefix_cache()`` and
    the hit of vLLM's own device prefix cache (the floor of any external
    cache on this engine), and throughput of a batch.
P/D (``pd/...``)
    P prefills with ``max_tokens=1`` and holds the KV; D gets the
    ``kv_transfer_params`` and its TTFT (the KV transfer plus the last
    token) is timed: ours (``MooncakeConnectorV1``) against vLLM's
    ``MooncakeConnector`` (needs ``torch.accelerator.current_device_index``
    patched on CPU: a module of ``benchmarks/peers`` imported first in both
    engines, never shipped) and vLLM's ``NixlConnector`` (needs the ``nixl``
    package, which can live in its own environment: ``--nixl-python``).
Pool and offload (``pool/...``, ``offload/...``)
    One engine with the connector: cold TTFT (a miss, with the save), then,
    after ``reset_prefix_cache()`` (vLLM's cache only), the hit from the
    connector's storage: ours (``AscendStoreConnector`` with the ``local`` and
    the ``mooncake`` backend, ``CPUOffloadingConnector``) against vLLM's
    ``MooncakeStoreConnector`` (same ``mooncake_master`` and pool holder) and
    ``ExampleConnector``; and the throughput of the same batch as the baseline.
Peers that do not run on CPU (``peer/...``)
    vLLM's ``OffloadingConnector`` and ``SimpleCPUOffloadConnector`` are
    started and their error is recorded.

Prompt lengths are ``k*block``, ``k*block + 1`` (a length ``ExampleConnector``
never hits) and ``k*block + block/2``. Writes ``<out>/serve.json`` with every
measurement and the ratios (connector / no connector, ours / peer, with the
goals of the issues) and prints a table; never fails on a number.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata, util
from pathlib import Path
from typing import Any

from .benchutil import (
    LoopbackMooncakeStore,
    Steps,
    add_common_args,
    format_table,
    goal_check,
    median,
    ratio,
    write_results,
)

logger = logging.getLogger(__name__)

#: Environment of every engine process (loopback only, in-process engine core).
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_ASCEND_KV_HOST": "127.0.0.1",
    "MC_TCP_BIND_ADDRESS": "127.0.0.1",
    "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
#: ``VLLM_CPU_OMP_THREADS_BIND`` of the P/D engines; empty: vLLM's default. Pinning
#: both to one core (``"1"``) starves NixlConnector, which also pins its own thread
#: to the last core: its D-side TTFT then equals a recompute (measured on the 2-core
#: machine), while ours and vLLM's MooncakeConnector are unaffected.
PD_THREADS_BIND = ""

#: The full-size model: the peer report's random Llama (8 layers, 4 KV heads of 64).
BENCH_MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1280,
                   num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                   head_dim=64, max_position_embeddings=4096, initializer_range=0.08)
#: The --quick model (2 layers): seconds per engine.
QUICK_MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, max_position_embeddings=4096, initializer_range=0.08)

PATCH_MODULE = "vllm_mooncake_cpu_patch"
PEERS_ENV = "VLLM_ASCEND_KV_BENCH_PEERS"
BOOTSTRAP_ENV = "VLLM_ASCEND_KV_BENCH_MC_BOOTSTRAP"

#: Our connectors and the distribution that ships each.
OURS = {"MooncakeConnectorV1": "ascend-kv-p2p", "AscendStoreConnector": "ascend-kv-pool",
        "CPUOffloadingConnector": "ascend-cpu-offload"}

#: Peers that do not run on a CPU engine, and why (see the peer report).
NOT_ON_CPU = {
    "LMCacheConnectorV1": "the lmcache wheel hard-requires CUDA packages (cupy-cuda13x, "
                          "cuda-python, cufile-python) and links libcudart: not installable "
                          "on a CPU machine",
}


# ====================================================================== engine process
def _child_main() -> int:
    """The engine process: JSON commands on stdin, JSON answers on the original stdout."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own output goes to the log, not into the protocol
    sys.stdout = sys.stderr

    def answer(status: str, payload: Any = None) -> None:
        proto.write(json.dumps({"status": status, "payload": payload}, default=str) + "\n")
        proto.flush()

    spec = json.loads(sys.stdin.readline())
    try:
        import importlib

        for path in spec.get("sys_path", []):
            sys.path.insert(0, path)
        for mod in spec.get("pre_import", []):
            importlib.import_module(mod)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(**spec["llm"])
    except BaseException:
        answer("error", traceback.format_exc())
        return 1
    answer("ready")
    engine = llm.llm_engine
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)

    def pending() -> bool:
        try:
            sched = engine.engine_core.engine_core.scheduler
        except AttributeError:
            return bool(engine.has_unfinished_requests())
        return bool(engine.has_unfinished_requests() or getattr(sched, "requests", None)
                    or getattr(sched, "finished_req_ids", None))

    while True:
        if not sel.select(0.005):
            # a P instance holding blocks for D must keep stepping (connectors are polled
            # inside step())
            try:
                if pending():
                    engine.step()
            except Exception:
                answer("error", traceback.format_exc())
                return 1
            continue
        line = sys.stdin.readline()
        if not line:
            return 0
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "close":
                answer("ok")
                return 0
            if op == "generate":
                params = []
                for kvp in cmd["kv_params"]:
                    extra = {"kv_transfer_params": kvp} if kvp is not None else None
                    params.append(SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0,
                                                 ignore_eos=True, detokenize=False,
                                                 extra_args=extra))
                prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd["prompts"]]
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                answer("ok", {"seconds": seconds, "outputs": [
                    {"tokens": list(o.outputs[0].token_ids),
                     "cached": o.num_cached_tokens,
                     "kv_transfer_params": o.kv_transfer_params,
                     "finish_reason": o.outputs[0].finish_reason} for o in outs]})
            elif op == "reset_prefix_cache":
                answer("ok", bool(llm.reset_prefix_cache()))
            elif op == "settle":
                # let background saves finish: step while anything is pending, then wait
                deadline = time.monotonic() + float(cmd.get("timeout", 10))
                while pending() and time.monotonic() < deadline:
                    engine.step()
                time.sleep(float(cmd.get("sleep", 0.0)))
                answer("ok", not pending())
            else:
                answer("error", f"unknown op {op!r}")
        except Exception:
            answer("error", traceback.format_exc())


class EngineError(RuntimeError):
    """An engine process failed to start or to answer; the message holds its error."""


class EngineChild:
    """A ``vllm.LLM`` in a child process (``python -m ...bench_serve --engine-child``).

    Commands and answers are JSON lines (nothing is unpickled). The child may
    run another interpreter (``python``), e.g. an environment holding ``nixl``;
    that environment needs ``ascend-kv-core`` installed.

    Args:
        llm_kwargs: keyword arguments of ``vllm.LLM``.
        env: extra environment.
        log: file receiving the engine's output.
        python: interpreter of the child.
        pre_import: modules imported before the engine starts.
        sys_path: directories put in front of ``sys.path`` first.
        timeout: seconds to wait for the engine to start.
    """

    def __init__(self, llm_kwargs: dict[str, Any], *, env: dict[str, str] | None = None,
                 log: Path, python: str | None = None, pre_import: list[str] | None = None,
                 sys_path: list[str] | None = None, timeout: float = 300.0) -> None:
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        child_env = {**os.environ, **ENGINE_ENV, **(env or {})}
        with open(log, "ab") as logf:
            self.proc = subprocess.Popen(
                [python or sys.executable, "-m", __name__, "--engine-child"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf, env=child_env,
                start_new_session=True)
        self._sel = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self._send({"llm": llm_kwargs, "pre_import": pre_import or [],
                    "sys_path": sys_path or []})
        try:
            self._answer(timeout)
        except EngineError:
            self.kill()
            raise

    def _send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write((json.dumps(obj) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise EngineError(f"engine process gone ({exc}); log: {self.log}") from exc

    def _answer(self, timeout: float) -> Any:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._sel.select(min(1.0, max(0.0, deadline - time.monotonic()))):
                line = self.proc.stdout.readline()
                if not line:
                    break
                msg = json.loads(line)
                if msg["status"] != "ok" and msg["status"] != "ready":
                    raise EngineError(str(msg["payload"]).strip())
                return msg["payload"]
            if self.proc.poll() is not None:
                break
        if self.proc.poll() is not None:
            raise EngineError(f"engine process exited with {self.proc.returncode}; last log "
                              f"lines:\n{tail(self.log)}")
        raise EngineError(f"no answer from the engine within {timeout:.0f}s (log: {self.log})")

    def call(self, op: str, timeout: float = 600.0, **args: Any) -> Any:
        """Send one command and return its answer's payload."""
        self._send({"op": op, **args})
        return self._answer(timeout)

    def generate(self, prompts: list[list[int]], *, max_tokens: int = 1,
                 kv_params: list[dict[str, Any] | None] | None = None,
                 timeout: float = 600.0) -> dict[str, Any]:
        """Greedy generation; returns ``seconds`` (wall, in the child) and ``outputs``."""
        kv = kv_params if kv_params is not None else [None] * len(prompts)
        return dict(self.call("generate", timeout, prompts=prompts, max_tokens=max_tokens,
                              kv_params=kv))

    def close(self, timeout: float = 30.0) -> None:
        """Ask the engine to stop; kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.call("close", timeout)
            except EngineError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL the engine process if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._sel.close()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


def tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a log file (empty if unreadable)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def short_error(text: str) -> str:
    """The most telling line of an error text: the last line naming an error."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln:
            return ln[:400]
    return lines[-1][:400] if lines else ""


# ====================================================================== configuration
@dataclass
class ServeConfig:
    """What one run measures, and on what."""

    model: str
    model_spec: dict[str, Any]
    dtype: str
    block_size: int
    lengths: list[int]
    throughput_batch: int
    throughput_prompt: int
    throughput_tokens: int
    max_model_len: int
    out: Path
    nixl_python: str | None = None
    peers_path: str | None = None
    startup_timeout: float = 300.0
    seed: int = 0
    repeats: int = 1
    pd_threads_bind: str = PD_THREADS_BIND

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token occupies across all layers."""
        s = self.model_spec
        itemsize = 2 if self.dtype in ("bfloat16", "float16") else 4
        return (2 * int(s["num_hidden_layers"]) * int(s["num_key_value_heads"])
                * int(s["head_dim"]) * itemsize)


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


def llm_kwargs(cfg: ServeConfig, kv: dict[str, Any] | None) -> dict[str, Any]:
    """``vllm.LLM`` arguments of every engine of the run (only the connector differs)."""
    kw: dict[str, Any] = dict(model=cfg.model, skip_tokenizer_init=True, dtype=cfg.dtype,
                              max_model_len=cfg.max_model_len, enforce_eager=True,
                              max_num_seqs=max(4, cfg.throughput_batch), seed=0,
                              block_size=cfg.block_size, enable_prefix_caching=True)
    if kv is not None:
        kw["kv_transfer_config"] = kv
    return kw


# ====================================================================== scenarios
@dataclass
class Scenario:
    """One engine setup of the run."""

    name: str
    family: str  # baseline | pd | pool | offload | peer
    who: str  # ours | vllm | -
    connector: str
    describe: str
    needs: list[str] = field(default_factory=list)
    run: Callable[..., dict[str, Any]] | None = None


def _installed(dist: str) -> bool:
    try:
        metadata.distribution(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def _has_module(name: str) -> bool:
    try:
        return util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def peers_path(explicit: str | None) -> str | None:
    """Directory holding the peer harness modules (``benchmarks/peers``), if found."""
    for cand in (explicit, os.environ.get(PEERS_ENV), str(Path.cwd() / "benchmarks" / "peers")):
        if cand and (Path(cand) / f"{PATCH_MODULE}.py").exists():
            return str(Path(cand).resolve())
    return None


def python_has(python: str, module: str) -> bool:
    """Whether ``python`` can import ``module`` (a quick child process)."""
    try:
        return subprocess.run([python, "-c", f"import {module}"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def skip_reason(sc: Scenario, cfg: ServeConfig) -> str | None:
    """Why ``sc`` cannot run here, or ``None``."""
    for need in sc.needs:
        if need.startswith("dist:") and not _installed(need[5:]):
            return f"{need[5:]} is not installed"
        if need == "mooncake" and not _has_module("mooncake.engine"):
            return "mooncake-transfer-engine is not installed (pip install 'ascend-kv-core[cpu]')"
        if need == "store":
            from .benchutil import find_binary

            if not (find_binary("mooncake_master") and find_binary("mooncake_client")):
                return "mooncake_master / mooncake_client not found"
        if need == "patch" and not cfg.peers_path:
            return (f"needs the CPU patch of torch.accelerator.current_device_index "
                    f"({PATCH_MODULE}.py of benchmarks/peers, not shipped): pass --peers-path "
                    f"or set {PEERS_ENV}")
        if need == "nixl":
            python = cfg.nixl_python or sys.executable
            if not python_has(python, "nixl"):
                return (f"the nixl package is not importable by {python} (nox -s bench builds "
                        "an environment with it; or pass --nixl-python)")
            if not python_has(python, __name__):
                return f"ascend-kv-core is not installed in {python}"
    return None


class Run:
    """State shared by the scenarios of one run: config, prompts, baseline results."""

    def __init__(self, cfg: ServeConfig, steps: Steps) -> None:
        self.cfg = cfg
        self.steps = steps
        vocab = int(cfg.model_spec["vocab_size"])
        self.prompts = make_prompts(cfg.lengths, cfg.seed + 1, vocab)
        self.warmup = make_prompts([max(8, cfg.block_size // 2)], cfg.seed + 2, vocab)[0]
        # fresh prompts for each throughput sample (no sample hits another's prefix)
        self.batches = [make_prompts([cfg.throughput_prompt] * cfg.throughput_batch,
                                     cfg.seed + 10 + r, vocab) for r in range(cfg.repeats)]
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
        return EngineChild(llm_kwargs(self.cfg, kv), env=env, python=python,
                           pre_import=pre_import, sys_path=sys_path,
                           log=self.cfg.out / "serve-logs" / f"{name.replace('/', '-')}.log",
                           timeout=self.cfg.startup_timeout)

    def mooncake_store(self) -> LoopbackMooncakeStore:
        """The run's Mooncake Store (master + pool holder), started on first use."""
        if self.store is None:
            self.store = LoopbackMooncakeStore("1GB", self.tmp / "mooncake").start()
        return self.store

    def close(self) -> None:
        """Stop what the run started and remove its scratch files (saved KV, Store logs)."""
        if self.base_engine is not None:
            self.base_engine.close()
            self.base_engine = None
        if self.store is not None:
            self.store.stop()
            self.store = None
        shutil.rmtree(self.tmp, ignore_errors=True)


def _first(out: dict[str, Any]) -> dict[str, Any]:
    return dict(out["outputs"][0])


def cache_flow(run: Run, eng: EngineChild, name: str) -> dict[str, Any]:
    """Cold TTFT, device-cache hit, and TTFT after ``reset_prefix_cache`` of every prompt
    (the median of ``repeats`` of those); then the throughput batches (the best).
    Used for the baseline and every pool/offload connector."""
    eng.generate([run.warmup])
    rows = []
    for prompt in run.prompts:
        cold = eng.generate([prompt])
        eng.call("settle", timeout=30, sleep=0.3)  # background saves finish
        device = eng.generate([prompt])
        agains = []
        for _ in range(run.cfg.repeats):
            eng.call("reset_prefix_cache")
            agains.append(eng.generate([prompt]))
            eng.call("settle", timeout=30, sleep=0.1)
        eng.call("reset_prefix_cache")
        c = _first(cold)
        again_s = median(a["seconds"] for a in agains)
        a = _first(agains[-1])
        rows.append({"tokens": len(prompt), "cold_s": cold["seconds"],
                     "device_hit_s": device["seconds"], "again_s": again_s,
                     "again_samples": [x["seconds"] for x in agains],
                     "again_cached": a["cached"], "cold_token": (c["tokens"] or [None])[0],
                     "again_token": (a["tokens"] or [None])[0],
                     "again_tokens_all": [(_first(x)["tokens"] or [None])[0] for x in agains],
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


def reference(run: Run) -> dict[str, Any] | None:
    """Recompute TTFT, device-cache hit and throughput of the engine without a connector,
    measured now (next to the scenario that uses them); ``None`` without that engine."""
    eng = run.base_engine
    if eng is None:
        return None
    recompute, device = {}, {}
    for prompt in run.prompts:
        eng.call("reset_prefix_cache")
        recompute[len(prompt)] = eng.generate([prompt])["seconds"]
        device[len(prompt)] = eng.generate([prompt])["seconds"]
    eng.call("reset_prefix_cache")
    thr = eng.generate(run.batches[0], max_tokens=run.cfg.throughput_tokens)
    out_tokens = sum(len(o["tokens"]) for o in thr["outputs"])
    return {"recompute_s": recompute, "device_hit_s": device,
            "output_tok_per_s": out_tokens / thr["seconds"]}


def run_single(run: Run, name: str, kv: dict[str, Any] | None,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """One engine (baseline, pool or offload connector) through :func:`cache_flow`."""
    eng = run.engine(name, kv, env=env)
    try:
        return cache_flow(run, eng, name)
    finally:
        eng.close()


def pd_flow(run: Run, p: EngineChild, d: EngineChild, name: str,
            params: Callable[[str], tuple[dict[str, Any], Callable[[dict[str, Any] | None],
                                                                 dict[str, Any]]]]
            ) -> dict[str, Any]:
    """P prefills each prompt (max_tokens=1) and holds it; D's TTFT with P's KV is timed.

    Each prompt is sent ``repeats`` times (P's own prefix cache makes the repeats
    cheap on P; D's cache is reset after every request, so D always transfers);
    the median D TTFT is kept. ``params(key)`` gives P's ``kv_transfer_params``
    and a function turning P's output params into D's.
    """
    rows = []
    for i, prompt in enumerate([run.warmup, *run.prompts]):
        samples = []
        for r in range(1 if i == 0 else run.cfg.repeats):
            p_in, to_d = params(f"{i}-{r}")
            pout = p.generate([prompt], kv_params=[p_in])
            d_in = to_d(_first(pout)["kv_transfer_params"])
            dout = d.generate([prompt], kv_params=[d_in])
            d.call("reset_prefix_cache")
            samples.append((pout, dout))
        if i == 0:
            continue  # warm-up: connections, bootstrap queries
        outs = [_first(dout) for _p, dout in samples]
        bad = [o for o in outs if o["finish_reason"] not in ("length", "stop")]
        d_ttft = median(dout["seconds"] for _p, dout in samples)
        rows.append({"tokens": len(prompt), "prefill_s": samples[0][0]["seconds"],
                     "d_ttft_s": d_ttft, "d_samples": [x[1]["seconds"] for x in samples],
                     "d_cached": outs[-1]["cached"],
                     "d_token": (outs[-1]["tokens"] or [None])[0],
                     "d_tokens_all": [(o["tokens"] or [None])[0] for o in outs],
                     "finish": bad[0]["finish_reason"] if bad else outs[-1]["finish_reason"]})
        run.steps.note(f"{name}: {len(prompt)} tokens: P {samples[0][0]['seconds']:.3f}s, "
                       f"D TTFT {d_ttft:.3f}s (median of {len(samples)}; "
                       f"{rows[-1]['finish']})")
    return {"prompts": rows}


def run_pd(run: Run, name: str, p_kv: dict[str, Any], d_kv: dict[str, Any],
           params: Callable[..., Any], *, p_env: dict[str, str] | None = None,
           d_env: dict[str, str] | None = None, python: str | None = None,
           pre_import: list[str] | None = None) -> dict[str, Any]:
    """Start P and D with the same pinning, run :func:`pd_flow`, stop both."""
    bind = {"VLLM_CPU_OMP_THREADS_BIND": run.cfg.pd_threads_bind} if run.cfg.pd_threads_bind \
        else {}
    p = run.engine(f"{name}-prefill", p_kv, env={**bind, **(p_env or {})}, python=python,
                   pre_import=pre_import)
    try:
        d = run.engine(f"{name}-decode", d_kv, env={**bind, **(d_env or {})}, python=python,
                       pre_import=pre_import)
        try:
            return pd_flow(run, p, d, name, params)
        finally:
            d.close()
    finally:
        p.close()


def _free_port() -> int:
    from .net import free_port

    return free_port()


# ---------------------------------------------------------------------- each scenario
def sc_baseline(run: Run) -> dict[str, Any]:
    """No connector. The engine stays up: :func:`reference` measures it again next to
    every other scenario."""
    eng = run.engine("baseline", None)
    try:
        result = cache_flow(run, eng, "baseline")
    except BaseException:
        eng.close()
        raise
    run.base_engine = eng
    return result


def sc_pd_ours(run: Run) -> dict[str, Any]:
    """MooncakeConnectorV1: D pulls from P over the Mooncake transfer engine."""
    def kv(role: str, engine_id: str) -> dict[str, Any]:
        return {"kv_connector": "MooncakeConnectorV1", "kv_role": role,
                "kv_port": _free_port(), "engine_id": engine_id,
                "kv_load_failure_policy": "fail",
                "kv_connector_extra_config": {"load_timeout_s": 60}}

    def params(_key: str) -> tuple[dict[str, Any], Callable[..., dict[str, Any]]]:
        return {"do_remote_decode": True, "do_remote_prefill": False}, _require_params

    return run_pd(run, "pd/ours", kv("kv_producer", "bench-ours-p"),
                  kv("kv_consumer", "bench-ours-d"), params)


def _require_params(p_out: dict[str, Any] | None) -> dict[str, Any]:
    if not isinstance(p_out, dict) or not p_out.get("do_remote_prefill"):
        raise RuntimeError(f"P returned no kv_transfer_params for D: {p_out!r}")
    return p_out


def sc_pd_vllm_mooncake(run: Run) -> dict[str, Any]:
    """vLLM's MooncakeConnector (P pushes on D's request), patched for CPU."""
    port = _free_port()
    engine_id = "bench-vllm-mc-p"
    p_kv = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
            "engine_id": engine_id,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp", "num_workers": 2,
                                          "bootstrap_server_address": f"127.0.0.1:{port}"}}
    d_kv = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
            "engine_id": "bench-vllm-mc-d",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}

    def params(key: str) -> tuple[dict[str, Any], Callable[..., dict[str, Any]]]:
        tid = f"bench-{os.getpid()}-{key}"
        d = {"do_remote_decode": False, "do_remote_prefill": True,
             "remote_engine_id": engine_id, "remote_bootstrap_addr": f"http://127.0.0.1:{port}",
             "remote_dp_rank": 0, "transfer_id": tid}
        return ({"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid},
                lambda _p_out: d)

    return run_pd(run, "pd/vllm-mooncake", p_kv, d_kv, params,
                  p_env={BOOTSTRAP_ENV: f"127.0.0.1:{port}"}, pre_import=[PATCH_MODULE])


def sc_pd_nixl(run: Run) -> dict[str, Any]:
    """vLLM's NixlConnector (D pulls; the request protocol of MooncakeConnectorV1)."""
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    p_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port())}
    d_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port())}

    def params(_key: str) -> tuple[dict[str, Any], Callable[..., dict[str, Any]]]:
        return ({"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None},
                _require_params)

    return run_pd(run, "pd/vllm-nixl", dict(kv, engine_id="bench-nixl-p"),
                  dict(kv, engine_id="bench-nixl-d"), params, p_env=p_env, d_env=d_env,
                  python=run.cfg.nixl_python)


def sc_pool_local(run: Run) -> dict[str, Any]:
    """AscendStoreConnector, embedded ``local`` backend (host memory in the engine)."""
    return run_single(run, "pool/ours-local", {
        "kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "local", "local_pool_size": "1GB"}})


def sc_pool_mooncake(run: Run) -> dict[str, Any]:
    """AscendStoreConnector, ``mooncake`` backend on the run's Store."""
    store = run.mooncake_store()
    return run_single(run, "pool/ours-mooncake", {
        "kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "mooncake", "mooncake": store.config()}})


def sc_pool_vllm_store(run: Run) -> dict[str, Any]:
    """vLLM's MooncakeStoreConnector on the same Store (the peer report's config)."""
    store = run.mooncake_store()
    path = run.tmp / "vllm-mooncake-store.json"
    path.write_text(json.dumps(store.config(mode="standalone-store")))
    return run_single(run, "pool/vllm-mooncake-store", {
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {}}, env={"MOONCAKE_CONFIG_PATH": str(path)})


def sc_pool_example(run: Run) -> dict[str, Any]:
    """vLLM's ExampleConnector (safetensors files on disk)."""
    path = run.tmp / "example-connector"
    path.mkdir(exist_ok=True)
    return run_single(run, "pool/vllm-example", {
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)}})


def sc_offload(run: Run) -> dict[str, Any]:
    """CPUOffloadingConnector: host-memory prefix cache."""
    shm = run.tmp / "offload-shm"
    shm.mkdir(exist_ok=True)
    return run_single(run, "offload/ours", {
        "kv_connector": "CPUOffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_swap_space": "1GB"}},
        env={"VLLM_ASCEND_KV_SHM_DIR": str(shm)})


def _try_start(connector: str) -> Callable[[Run], dict[str, Any]]:
    def attempt(run: Run) -> dict[str, Any]:
        """Start the engine; a peer that fails on CPU is recorded with its error."""
        name = f"peer/{connector}"
        kv = {"kv_connector": connector, "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}
        try:
            eng = run.engine(name, kv)
        except EngineError as exc:
            return {"unsupported": short_error(str(exc)) or "engine failed to start"}
        try:
            return cache_flow(run, eng, name)
        finally:
            eng.close()

    return attempt


def scenarios() -> list[Scenario]:
    """Every scenario, in run order (the baseline first: the others are compared to it)."""
    mc = ["mooncake"]
    return [
        Scenario("baseline", "baseline", "-", "-", "no connector", [], sc_baseline),
        Scenario("pd/ours", "pd", "ours", "MooncakeConnectorV1",
                 "D pulls P's blocks (Mooncake TE, tcp)",
                 ["dist:ascend-kv-p2p", *mc], sc_pd_ours),
        Scenario("pd/vllm-mooncake", "pd", "vllm", "MooncakeConnector",
                 "P pushes on D's request (Mooncake TE, tcp), patched for CPU",
                 [*mc, "patch"], sc_pd_vllm_mooncake),
        Scenario("pd/vllm-nixl", "pd", "vllm", "NixlConnector", "D pulls (NIXL/UCX)",
                 ["nixl"], sc_pd_nixl),
        Scenario("pool/ours-local", "pool", "ours", "AscendStoreConnector",
                 "backend local (host memory in the engine)",
                 ["dist:ascend-kv-pool"], sc_pool_local),
        Scenario("pool/ours-mooncake", "pool", "ours", "AscendStoreConnector",
                 "backend mooncake (Store held by mooncake_client)",
                 ["dist:ascend-kv-pool", *mc, "store"], sc_pool_mooncake),
        Scenario("pool/vllm-mooncake-store", "pool", "vllm", "MooncakeStoreConnector",
                 "same Store, standalone-store mode", [*mc, "store"], sc_pool_vllm_store),
        Scenario("pool/vllm-example", "pool", "vllm", "ExampleConnector",
                 "safetensors files on local disk", [], sc_pool_example),
        Scenario("offload/ours", "offload", "ours", "CPUOffloadingConnector",
                 "host-memory prefix cache", ["dist:ascend-cpu-offload"], sc_offload),
        Scenario("peer/OffloadingConnector", "peer", "vllm", "OffloadingConnector",
                 "vLLM's CPU offload (CUDA only?)", [], _try_start("OffloadingConnector")),
        Scenario("peer/SimpleCPUOffloadConnector", "peer", "vllm", "SimpleCPUOffloadConnector",
                 "vLLM's simple CPU offload (CUDA only?)", [],
                 _try_start("SimpleCPUOffloadConnector")),
    ]


QUICK_SCENARIOS = ("baseline", "pd/ours", "pool/ours-local", "offload/ours")


# ====================================================================== summaries
def _reference_of(res: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Recompute / device-hit TTFT per prompt length and throughput of the engine without a
    connector: measured next to the scenario when it was, else the baseline's own run."""
    ref = res.get("reference")
    if isinstance(ref, dict):
        return {"recompute": {int(k): v for k, v in ref["recompute_s"].items()},
                "floor": {int(k): v for k, v in ref["device_hit_s"].items()},
                "thr": ref.get("output_tok_per_s")}
    rows = base.get("prompts", [])
    return {"recompute": {r["tokens"]: r["again_s"] for r in rows},
            "floor": {r["tokens"]: r["device_hit_s"] for r in rows},
            "thr": base.get("throughput", {}).get("output_tok_per_s")}


def summarize(results: dict[str, dict[str, Any]], cfg: ServeConfig) -> dict[str, Any]:
    """Per-scenario medians, and ratios against the engine without a connector measured
    next to each scenario."""
    base = results.get("baseline", {})
    base_tok = {r["tokens"]: r["cold_token"] for r in base.get("prompts", [])}
    summary: dict[str, dict[str, Any]] = {}
    for name, res in results.items():
        if res.get("status") != "ok":
            continue
        ref = _reference_of(res, base)
        recompute, floor = ref["recompute"], ref["floor"]
        rows = res.get("prompts", [])
        s: dict[str, Any] = {}
        if "d_ttft_s" in (rows[0] if rows else {}):
            s["d_ttft_s"] = median(r["d_ttft_s"] for r in rows)
            s["d_ttft_over_recompute"] = median(ratio(r["d_ttft_s"], recompute.get(r["tokens"]))
                                                for r in rows)
            # KV throughput as D sees it: the prompt's KV bytes over D's TTFT (which also
            # holds D's compute of the last token; always defined, unlike a subtraction)
            s["kv_GBps"] = median(r["tokens"] * cfg.kv_bytes_per_token / r["d_ttft_s"] / 1e9
                                  for r in rows if r["d_ttft_s"] > 0)
            s["d_ttft_over_device_hit"] = median(ratio(r["d_ttft_s"], floor.get(r["tokens"]))
                                                 for r in rows)
            s["tokens_equal"] = all(
                t == base_tok.get(r["tokens"])
                for r in rows for t in r.get("d_tokens_all", [r["d_token"]]))
            s["failed"] = [r["tokens"] for r in rows if r["finish"] not in ("length", "stop")]
        else:
            s["cold_s"] = median(r["cold_s"] for r in rows)
            s["hit_s"] = median(r["again_s"] for r in rows)
            s["cold_over_baseline"] = median(ratio(r["cold_s"], recompute.get(r["tokens"]))
                                             for r in rows)
            s["hit_over_recompute"] = median(ratio(r["again_s"], recompute.get(r["tokens"]))
                                             for r in rows)
            s["hit_over_device_hit"] = median(ratio(r["again_s"], floor.get(r["tokens"]))
                                              for r in rows)
            s["cached"] = {r["tokens"]: r["again_cached"] for r in rows}
            s["missed"] = [r["tokens"] for r in rows if not r["again_cached"]]
            s["tokens_equal"] = all(
                r["cold_token"] == base_tok.get(r["tokens"])
                and all(t == base_tok.get(r["tokens"])
                        for t in r.get("again_tokens_all", [r["again_token"]]))
                for r in rows)
            thr = res.get("throughput", {}).get("output_tok_per_s")
            s["output_tok_per_s"] = thr
            s["throughput_over_baseline"] = ratio(thr, ref["thr"])
        s["reference_recompute_s"] = median(recompute.values())
        summary[name] = s
    return summary


def comparisons(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours against each peer (and against recompute) with the goals of the issues.

    Scenarios run one after the other on a shared machine, so ours / peer ratios
    divide the *normalized* figures: each scenario's TTFT over the recompute (or
    throughput over the throughput) of the engine without a connector measured
    next to it. Load that changed between the two scenarios cancels.
    """
    def get(name: str, key: str) -> float | None:
        v = summary.get(name, {}).get(key)
        return float(v) if isinstance(v, int | float) else None

    out: list[dict[str, Any]] = []

    def add(what: str, value: float | None, goal: str, at_least: float | None = None,
            at_most: float | None = None) -> None:
        # "peer": ours / one of vLLM's connectors; "recompute": against no connector
        kind = "recompute" if what.endswith("/ recompute") else "peer"
        out.append({"what": what, "kind": kind, "ratio": value, "goal": goal,
                    "met": goal_check(value, at_least=at_least, at_most=at_most)
                    if (at_least is not None or at_most is not None) else None})

    ttft = "d_ttft_over_recompute"
    for peer, label in (("pd/vllm-nixl", "NixlConnector"),
                        ("pd/vllm-mooncake", "vLLM MooncakeConnector")):
        is_nixl = peer == "pd/vllm-nixl"
        add(f"P/D decode TTFT: ours / {label}", ratio(get("pd/ours", ttft), get(peer, ttft)),
            "<= 0.8" if is_nixl else "", at_most=0.8 if is_nixl else None)
        # bytes / D TTFT: the inverse of the TTFT ratio, with the issue's own goal
        add(f"P/D KV throughput: ours / {label}", ratio(get(peer, ttft), get("pd/ours", ttft)),
            ">= 1.2", at_least=1.2)
    for ours in ("pool/ours-mooncake", "pool/ours-local"):
        short = ours.split("/")[1]
        for peer, label in (("pool/vllm-mooncake-store", "MooncakeStoreConnector"),
                            ("pool/vllm-example", "ExampleConnector")):
            has_goal = ours == "pool/ours-mooncake" and peer == "pool/vllm-mooncake-store"
            add(f"pool hit TTFT: {short} / {label}",
                ratio(get(ours, "hit_over_recompute"), get(peer, "hit_over_recompute")),
                "<= 0.8" if has_goal else "", at_most=0.8 if has_goal else None)
            # the miss path: prefill plus the save, and serving a batch of new prompts
            add(f"pool cold TTFT (miss + save): {short} / {label}",
                ratio(get(ours, "cold_over_baseline"), get(peer, "cold_over_baseline")), "")
            add(f"pool serving throughput (new prompts, saved): {short} / {label}",
                ratio(get(ours, "throughput_over_baseline"),
                      get(peer, "throughput_over_baseline")), "")
    for name, s in summary.items():
        if "hit_over_recompute" in s and name != "baseline":
            goal = "<= 0.1" if name == "offload/ours" else ("well below 1" if
                                                            name.startswith("pool/ours") else "")
            add(f"{name} hit TTFT / recompute", s["hit_over_recompute"], goal,
                at_most=0.1 if name == "offload/ours" else (0.5 if goal else None))
        if ttft in s:
            add(f"{name} D TTFT / recompute", s[ttft], "")
    return out


def table_rows(results: dict[str, dict[str, Any]],
               summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One printable row per scenario."""
    rows = []
    for name, res in results.items():
        s = summary.get(name, {})
        row: dict[str, Any] = {"scenario": name, "connector": res.get("connector", "-"),
                               "status": res.get("status")}
        if res.get("status") != "ok":
            row["note"] = res.get("reason", "")[:70]
        elif "d_ttft_s" in s:
            row.update({"ttft_s": s["d_ttft_s"], "vs_recompute": s["d_ttft_over_recompute"],
                        "kv_GBps": s["kv_GBps"], "tokens_ok": s["tokens_equal"],
                        "note": f"failed: {s['failed']}" if s["failed"] else "D side"})
        else:
            row.update({"ttft_s": s["hit_s"], "vs_recompute": s["hit_over_recompute"],
                        "cold_vs_base": s["cold_over_baseline"],
                        "tput_vs_base": s["throughput_over_baseline"],
                        "tokens_ok": s["tokens_equal"],
                        "note": f"missed lengths {s['missed']}" if s["missed"] and
                        name != "baseline" else ""})
        rows.append(row)
    return rows


# ====================================================================== CLI
def build_config(args: argparse.Namespace) -> ServeConfig:
    """The run's configuration from the command line (``--quick``: tiny model)."""
    spec = QUICK_MODEL if args.quick else BENCH_MODEL
    block = args.block_size or (32 if args.quick else 128)
    target = args.prompt_tokens or (2 * block if args.quick else 2048)
    lengths = prompt_lengths(target, block)
    model = args.model or str(make_model(
        Path(args.model_dir or Path(tempfile.gettempdir()) /
             ("vakv-serve-quick" if args.quick else "vakv-serve-llama")) / args.dtype,
        spec, args.dtype))
    if args.model:
        cfg_path = Path(args.model) / "config.json"
        if cfg_path.exists():
            spec = {**spec, **{k: v for k, v in json.loads(cfg_path.read_text()).items()
                               if k in spec}}
    thr_prompt = args.throughput_prompt or (block if args.quick else 512)
    return ServeConfig(
        model=model, model_spec=dict(spec), dtype=args.dtype, block_size=block, lengths=lengths,
        throughput_batch=args.throughput_batch or (2 if args.quick else 4),
        throughput_prompt=thr_prompt,
        throughput_tokens=args.throughput_tokens or (8 if args.quick else 32),
        max_model_len=max(max(lengths), thr_prompt) + 256, out=Path(args.out),
        nixl_python=args.nixl_python, peers_path=peers_path(args.peers_path),
        startup_timeout=args.startup_timeout,
        repeats=args.repeats or (1 if args.quick else 3),
        pd_threads_bind=args.pd_threads_bind)


def select(args: argparse.Namespace) -> list[Scenario]:
    """The scenarios ``--only`` / ``--quick`` ask for (the baseline always runs first)."""
    all_sc = scenarios()
    names = [s.name for s in all_sc]
    if args.only:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = sorted(wanted - set(names))
        if unknown:
            raise SystemExit(f"bench serve: unknown scenario(s) {unknown}; known: {names}")
    elif args.quick:
        wanted = set(QUICK_SCENARIOS)
    else:
        wanted = set(names)
    wanted.add("baseline")
    return [s for s in all_sc if s.name in wanted]


def run(args: argparse.Namespace) -> int:
    """Run ``bench serve``: every selected scenario, the summary, the table, ``serve.json``."""
    cfg = build_config(args)
    chosen = select(args)
    steps = Steps(len(chosen), "serve")
    state = Run(cfg, steps)
    results: dict[str, dict[str, Any]] = {}
    try:
        for sc in chosen:
            steps.step(f"{sc.name}: {sc.connector} ({sc.describe})")
            entry: dict[str, Any] = {"family": sc.family, "who": sc.who,
                                     "connector": sc.connector, "describe": sc.describe}
            reason = skip_reason(sc, cfg)
            if reason:
                steps.note(f"{sc.name}: skipped: {reason}")
                entry.update(status="skipped", reason=reason)
            else:
                start = time.monotonic()
                try:
                    assert sc.run is not None
                    data = sc.run(state)
                    if "unsupported" in data:
                        entry.update(status="unsupported", reason=data["unsupported"])
                    else:
                        entry.update(status="ok", **data)
                        if sc.name != "baseline":
                            steps.note(f"{sc.name}: the engine without a connector again")
                            entry["reference"] = reference(state)
                except Exception as exc:  # one scenario's failure is reported, not fatal
                    logger.warning("%s failed: %s", sc.name, exc)
                    entry.update(status="failed", reason=short_error(str(exc)) or repr(exc),
                                 error=str(exc)[-4000:])
                entry["wall_s"] = time.monotonic() - start
            results[sc.name] = entry
    finally:
        state.close()
    for name, why in NOT_ON_CPU.items():
        results[f"peer/{name}"] = {"family": "peer", "who": "vllm", "connector": name,
                                   "status": "unsupported", "reason": why}
    summary = summarize(results, cfg)
    comps = comparisons(summary)
    rows = table_rows(results, summary)
    print(format_table(rows, ["scenario", "connector", "status", "ttft_s", "vs_recompute",
                              "cold_vs_base", "tput_vs_base", "kv_GBps", "tokens_ok", "note"]))
    measured = [c for c in comps if c["ratio"] is not None]
    if measured:
        print()
        print(format_table(measured, ["what", "ratio", "goal", "met"]))
    path = write_results("serve", {
        "description": "real vLLM CPU engines with and without each connector, same model and "
                       "prompts; TTFT = wall time of generate(max_tokens=1) in the engine "
                       "process",
        "config": {"model": cfg.model, "model_spec": cfg.model_spec, "dtype": cfg.dtype,
                   "block_size": cfg.block_size, "lengths": cfg.lengths,
                   "kv_bytes_per_token": cfg.kv_bytes_per_token,
                   "repeats": cfg.repeats,
                   "throughput": {"batch": cfg.throughput_batch,
                                  "prompt_tokens": cfg.throughput_prompt,
                                  "max_tokens": cfg.throughput_tokens},
                   "pd_threads_bind": cfg.pd_threads_bind, "quick": bool(args.quick),
                   "nixl_python": cfg.nixl_python or sys.executable},
        "scenarios": results, "summary": summary, "comparisons": comps, "rows": rows}, cfg.out)
    print(f"results: {path}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Register ``vllm-ascend-kv bench serve``."""
    p = subparsers.add_parser(
        "serve", help="real vLLM CPU engines with and without each connector (ours and vLLM's "
                      "own): TTFT and throughput")
    add_common_args(p)
    p.add_argument("--only", default="",
                   help="comma-separated scenarios (default: all; quick: "
                        f"{','.join(QUICK_SCENARIOS)}); known: "
                        + ",".join(s.name for s in scenarios()))
    p.add_argument("--model", help="model directory (default: a random Llama made on first use)")
    p.add_argument("--model-dir", help="where the default model is saved")
    p.add_argument("--dtype", default="float32",
                   help="model dtype (default float32: exact token checks; the peer report "
                        "used bfloat16)")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default 128, "
                                                                "quick 32; a multiple of 32)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="about how long the prompts are (default 2048, quick 2 blocks)")
    p.add_argument("--throughput-batch", type=int, default=None, help="requests of the batch")
    p.add_argument("--throughput-prompt", type=int, default=None, help="tokens per request")
    p.add_argument("--throughput-tokens", type=int, default=None,
                   help="tokens generated per request")
    p.add_argument("--nixl-python", default=os.environ.get("VLLM_ASCEND_KV_BENCH_NIXL_PYTHON"),
                   help="interpreter of an environment with nixl, vllm-cpu and ascend-kv-core "
                        "for the NixlConnector engines (default: this one)")
    p.add_argument("--peers-path", default=None,
                   help=f"directory of the peer harness modules (default: ${PEERS_ENV} or "
                        "./benchmarks/peers)")
    p.add_argument("--repeats", type=int, default=None,
                   help="samples of each hit / recompute and of the throughput batch (median "
                        "/ best; default 3, quick 1)")
    p.add_argument("--pd-threads-bind", default=PD_THREADS_BIND,
                   help="VLLM_CPU_OMP_THREADS_BIND of every P/D engine (default: "
                        "vLLM's own binding)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds an engine may take to start")
    p.set_defaults(func=_checked_run)


def _checked_run(args: argparse.Namespace) -> int:
    if args.block_size is not None and (args.block_size <= 0 or args.block_size % 32):
        raise SystemExit(f"bench serve: --block-size must be a positive multiple of 32 on CPU, "
                         f"got {args.block_size}")
    return run(args)


if __name__ == "__main__":
    if "--engine-child" in sys.argv:
        sys.exit(_child_main())
    sys.exit("use: vllm-ascend-kv bench serve")
