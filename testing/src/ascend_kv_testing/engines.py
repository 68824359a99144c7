# SPDX-License-Identifier: Apache-2.0
"""Real vLLM CPU engines for tests, each in its own process.

Two engines cannot share one Python process (vLLM keeps global state), so an
:class:`EngineProcess` runs ``vllm.LLM`` in a child process and drives it over a
pipe. Children are forked from a fork server that imported vLLM once
(:func:`engine_context`): importing vLLM and torch takes about 9 of the 12 seconds
an engine takes to start on these machines, and a test session starts dozens. The
child starts from the parent's environment and output streams, as a spawned one
would. Between commands the child keeps stepping the engine, so a prefill instance
holding blocks for a decode instance keeps serving the connector's side of the
exchange (vLLM only polls connectors inside ``step()``).

Prompts are token ids (no tokenizer); sampling is greedy, so two runs of the
same model and prompt give the same tokens, which is what the tests compare.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_ascend.distributed.kv_transfer.bench.engine_env import ENGINE_ENV

__all__ = ["ENGINE_ENV", "EngineProcess", "engine_context", "engine_kwargs"]

#: What the fork server imports once, before it forks an engine's process.
PRELOAD = ["vllm", "vllm.entrypoints.llm", "vllm.inputs", "vllm.sampling_params"]

_CONTEXT: Any = None
_CONTEXT_LOCK = threading.Lock()


def engine_context() -> Any:
    """The multiprocessing context of engine processes: a fork server with vLLM imported.

    The server imports with ``OMP_NUM_THREADS=1``, so no OpenMP thread pool exists when it
    forks (a GNU OpenMP pool does not survive a fork); the child restores the parent's
    environment, and vLLM's CPU worker sets its own thread count and binding at start.
    ``ASCEND_KV_TESTING_SPAWN=1`` spawns each engine afresh instead (slower).
    """
    global _CONTEXT
    with _CONTEXT_LOCK:
        if _CONTEXT is not None:
            return _CONTEXT
        if os.environ.get("ASCEND_KV_TESTING_SPAWN") == "1":
            _CONTEXT = mp.get_context("spawn")
            return _CONTEXT
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        _CONTEXT = ctx
        return _CONTEXT


class _StdStreams:
    """The parent's stdout and stderr as they are when an engine starts, passed to the child
    as file descriptors: a forked child would otherwise write to those the fork server was
    started with (another test's captured output)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import reduction

        return _std_streams, (reduction.DupFd(1), reduction.DupFd(2))


def _std_streams(out: Any, err: Any) -> tuple[int, int]:
    return out.detach(), err.detach()


def _adopt_std_streams(fds: tuple[int, int]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, target in zip(fds, (1, 2), strict=True):
        if fd != target:  # a spawned child received them as they were
            os.dup2(fd, target)
            os.close(fd)


def engine_kwargs(model: str | Path, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for a fast, deterministic CPU engine."""
    kw: dict[str, Any] = dict(
        model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=2048,
        enforce_eager=True, max_num_seqs=8, seed=0, block_size=32,
        enable_prefix_caching=True,
    )
    kw.update(overrides)
    return kw


@dataclass
class GenResult:
    """What one request produced."""

    request_id: str
    token_ids: list[int]
    prompt_len: int
    num_cached_tokens: int | None
    kv_transfer_params: dict[str, Any] | None
    finish_reason: str | None
    error: str | None = None


@dataclass
class _Cmd:
    op: str
    args: dict[str, Any] = field(default_factory=dict)


def _child(conn: Any, llm_kwargs: dict[str, Any], env: dict[str, str], pre_import: list[str],
           parent_env: dict[str, str], streams: tuple[int, int], netns: str | None) -> None:
    if netns is not None:  # before anything opens a socket
        from .netns import enter_netns

        enter_netns(netns)
    _adopt_std_streams(streams)
    os.environ.clear()  # a forked child has the fork server's
    os.environ.update(parent_env)
    os.environ.update(env)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        import torch  # a forked child's OpenMP runtime read the server's OMP_NUM_THREADS=1

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        import importlib

        for mod in pre_import:
            importlib.import_module(mod)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(**llm_kwargs)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    engine = llm.llm_engine
    while True:
        if not conn.poll(0.005):
            try:
                if engine.has_unfinished_requests() or _has_pending_work(engine):
                    engine.step()
            except Exception:
                conn.send(("error", traceback.format_exc()))
                return
            continue
        cmd: _Cmd = conn.recv()
        try:
            if cmd.op == "close":
                _shut_down(llm)
                conn.send(("ok", None))
                # vLLM's native teardown after this point takes seconds and frees nothing
                # another process sees: leave without it
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)
            if cmd.op == "generate":
                params = []
                for kvp in cmd.args["kv_params"]:
                    extra = {"kv_transfer_params": kvp} if kvp is not None else None
                    params.append(SamplingParams(max_tokens=cmd.args["max_tokens"], temperature=0.0,
                                                 ignore_eos=True, detokenize=False,
                                                 extra_args=extra))
                prompts = [TokensPrompt(prompt_token_ids=p) for p in cmd.args["prompts"]]
                outs = llm.generate(prompts, params, use_tqdm=False)
                res = [GenResult(request_id=o.request_id, token_ids=list(o.outputs[0].token_ids),
                                 prompt_len=len(o.prompt_token_ids or []),
                                 num_cached_tokens=o.num_cached_tokens,
                                 kv_transfer_params=o.kv_transfer_params,
                                 finish_reason=o.outputs[0].finish_reason) for o in outs]
                conn.send(("ok", res))
            elif cmd.op == "call":
                # run a function "module:attr" inside the engine process, with the LLM
                import importlib

                mod, _, attr = cmd.args["fn"].partition(":")
                fn = getattr(importlib.import_module(mod), attr)
                conn.send(("ok", fn(llm, **cmd.args.get("kwargs", {}))))
            elif cmd.op == "reset_prefix_cache":
                conn.send(("ok", llm.reset_prefix_cache()))
            elif cmd.op == "idle":
                deadline = time.monotonic() + cmd.args["timeout"]
                while time.monotonic() < deadline and (engine.has_unfinished_requests()
                                                       or _has_pending_work(engine)):
                    engine.step()
                conn.send(("ok", not (engine.has_unfinished_requests()
                                      or _has_pending_work(engine))))
            else:
                conn.send(("error", f"unknown op {cmd.op}"))
        except Exception:
            conn.send(("error", traceback.format_exc()))


def _shut_down(llm: Any) -> None:
    """Shut the engine down as vLLM does at exit: executor, workers, KV connectors (which
    close their transfer engines and pool clients)."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # still leave: the parent is waiting
        traceback.print_exc()


def _has_pending_work(engine: Any) -> bool:
    """True while the scheduler still holds finished requests' blocks for a connector."""
    try:
        sched = engine.engine_core.engine_core.scheduler
    except AttributeError:
        return False
    return bool(getattr(sched, "requests", None)) or bool(getattr(sched, "finished_req_ids", None))


class EngineProcess:
    """A ``vllm.LLM`` in a child process (see :func:`engine_context`).

    Args:
        model: model directory.
        kv_transfer_config: the ``kv_transfer_config`` dict, or ``None``.
        env: extra environment of the child.
        pre_import: modules imported in the child before the engine starts
            (e.g. a package whose ``register()`` must run).
        startup_timeout: seconds to wait for the engine.
        **llm_overrides: passed to :func:`engine_kwargs`.
    """

    def __init__(self, model: str | Path, kv_transfer_config: dict[str, Any] | None = None, *,
                 env: dict[str, str] | None = None, pre_import: list[str] | None = None,
                 startup_timeout: float = 300.0, **llm_overrides: Any) -> None:
        self._launch(model, kv_transfer_config, env or {}, pre_import, startup_timeout,
                     llm_overrides)

    def _launch(self, model: str | Path, kv_transfer_config: dict[str, Any] | None,
                env: dict[str, str], pre_import: list[str] | None, startup_timeout: float,
                llm_overrides: dict[str, Any], netns: str | None = None) -> None:
        """Start the child (in network namespace ``netns``, if one) and wait until it is
        ready."""
        kwargs = engine_kwargs(model, **llm_overrides)
        if kv_transfer_config is not None:
            kwargs["kv_transfer_config"] = kv_transfer_config
        ctx = engine_context()
        self._conn, child_conn = ctx.Pipe()
        # vLLM starts worker processes of its own for TP or PP > 1: a daemon process may not.
        daemon = (int(kwargs.get("tensor_parallel_size", 1))
                  * int(kwargs.get("pipeline_parallel_size", 1))) <= 1
        self.proc = ctx.Process(target=_child,
                                args=(child_conn, kwargs, {**ENGINE_ENV, **env},
                                      pre_import or [], dict(os.environ), _StdStreams(), netns),
                                daemon=daemon)
        self.proc.start()
        status, payload = self._recv(startup_timeout)
        if status != "ready":
            self.kill()
            where = f" in {netns}" if netns is not None else ""
            raise RuntimeError(f"engine{where} failed to start:\n{payload}")

    def _recv(self, timeout: float) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._conn.poll(0.1):
                return self._conn.recv()
            if not self.proc.is_alive():
                return "error", f"engine process died with exit code {self.proc.exitcode}"
        return "error", f"no answer from the engine within {timeout}s"

    def _call(self, op: str, call_timeout: float = 600.0, **args: Any) -> Any:
        self._conn.send(_Cmd(op, args))
        status, payload = self._recv(call_timeout)
        if status != "ok":
            raise RuntimeError(f"engine {op} failed:\n{payload}")
        return payload

    def generate(self, prompts: list[list[int]], *, max_tokens: int = 8,
                 kv_params: list[dict[str, Any] | None] | None = None,
                 timeout: float = 600.0) -> list[GenResult]:
        """Greedy generation of ``max_tokens`` tokens for each prompt (token ids)."""
        kv = kv_params if kv_params is not None else [None] * len(prompts)
        return self._call("generate", timeout, prompts=prompts, max_tokens=max_tokens, kv_params=kv)

    def call(self, fn: str, timeout: float = 120.0, **kwargs: Any) -> Any:
        """Run ``fn(llm, **kwargs)`` (``"module:function"``) in the child and return its result."""
        return self._call("call", timeout, fn=fn, kwargs=kwargs)

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Step until no request or held block is left; True when idle."""
        return bool(self._call("idle", timeout + 10, timeout=timeout))

    def reset_prefix_cache(self) -> Any:
        """Drop the engine's own prefix cache (the connector's storage is not touched)."""
        return self._call("reset_prefix_cache")

    def close(self, timeout: float = 30.0) -> None:
        """Stop the engine and its process."""
        if self.proc.is_alive():
            try:
                self._conn.send(_Cmd("close"))
                self._recv(timeout)
            except (BrokenPipeError, EOFError, OSError):
                pass
            self.proc.join(timeout)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the engine process (fault tests)."""
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
