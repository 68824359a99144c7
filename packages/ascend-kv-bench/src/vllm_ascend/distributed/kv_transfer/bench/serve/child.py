# SPDX-License-Identifier: Apache-2.0
"""The engine process of ``bench serve``: one ``vllm.LLM`` driven over JSON lines.

``python -m vllm_ascend.distributed.kv_transfer.bench.serve.child`` is the
child; :class:`EngineChild` starts and drives it. Commands and answers are JSON
lines (nothing is unpickled). The child may run another interpreter, e.g. an
environment holding ``nixl``; that environment needs ``ascend-kv-bench`` installed.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.tooling.cpu_binding import OMP_BIND_ENV, bound_cpus

from ..engine_env import ENGINE_ENV
from ..procs import PausableGroup

logger = logging.getLogger(__name__)

#: How long :meth:`EngineChild.kill` waits for a killed engine to exit before it goes on
#: (a run of ``bench serve`` lost 10 minutes of rounds to one that took longer than 10 s).
KILL_WAIT_S = 30.0


def bind_in_process(env: MutableMapping[str, str] = os.environ) -> list[int] | None:
    """Apply a CPU list in ``VLLM_CPU_OMP_THREADS_BIND`` to this process (before torch loads).

    vLLM (0.32) applies the binding only to the workers its multiprocess executor starts
    (their OpenMP places and thread count); an engine in the calling process, as every
    ``bench serve`` engine is, ignores it and runs as many OpenMP threads as the host has
    CPUs, wherever the OS puts them. Here the process keeps to the listed CPUs (every
    thread it starts, the transfer engine's too) with one OpenMP thread per CPU. ``auto``,
    ``nobind`` or nothing: left as it is (``None``). Of a ``|``-separated list (one per
    rank) the first is taken.
    """
    cpus = bound_cpus(env.get(OMP_BIND_ENV, ""))
    if cpus is None:
        return None
    os.sched_setaffinity(0, cpus)
    env["OMP_NUM_THREADS"] = str(len(cpus))
    env["OMP_PLACES"] = "{" + ",".join(map(str, cpus)) + "}"
    env["OMP_PROC_BIND"] = "true"
    return cpus


def _child_main() -> int:
    """The engine process: JSON commands on stdin, JSON answers on the original stdout."""
    cpus = bind_in_process()  # before torch loads (libgomp reads OMP_* once)
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's own output goes to the log, not into the protocol
    sys.stdout = sys.stderr

    def answer(status: str, payload: Any = None) -> None:
        proto.write(json.dumps({"status": status, "payload": payload}, default=str) + "\n")
        proto.flush()

    spec = json.loads(sys.stdin.readline())
    if cpus is not None:
        print(f"bench serve: engine bound to CPUs {cpus} ({len(cpus)} OpenMP threads)",
              file=sys.stderr)
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
    external = _count_external_tokens(engine)
    waits = _track_scheduling(engine)
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin, selectors.EVENT_READ)

    sched = _scheduler(engine)

    def pending() -> bool:
        if sched is None:
            return bool(engine.has_unfinished_requests())
        # has_requests() also counts a connector's pending background work (e.g. vLLM's
        # MooncakeStoreConnector holds a save's blocks until a later step reports it)
        has_requests = getattr(sched, "has_requests", None)
        return bool(engine.has_unfinished_requests() or getattr(sched, "requests", None)
                    or getattr(sched, "finished_req_ids", None)
                    or (callable(has_requests) and has_requests()))

    def settle(timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while pending() and time.monotonic() < deadline:
            engine.step()
        return not pending()

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
                if external is not None:
                    external.clear()
                if waits is not None:
                    waits.clear()
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                ended_at = time.time()  # wall clock: engines of one host compare them
                answer("ok", {"seconds": seconds, "ended_at": ended_at,
                              # vLLM's num_external_computed_tokens of the call's requests
                              # (None: no prefill stats seen, so unknown)
                              "external_tokens": sum(external) if external else None,
                              # per request added, in order: first scheduled - added
                              "kv_wait_s": _waited(waits),
                              "outputs": [
                    {"tokens": list(o.outputs[0].token_ids),
                     "cached": o.num_cached_tokens,
                     "kv_transfer_params": o.kv_transfer_params,
                     "finish_reason": o.outputs[0].finish_reason} for o in outs]})
            elif op == "reset_prefix_cache":
                # vLLM refuses the reset while any block is referenced (a connector's save
                # in flight): settle first, retry a few steps; the answer says whether the
                # cache really was reset (a False one makes the next "hit" a device hit)
                ok = False
                for _ in range(5):
                    settle(float(cmd.get("timeout", 30)))
                    ok = bool(llm.reset_prefix_cache())
                    if ok:
                        break
                    engine.step()
                    time.sleep(0.05)
                answer("ok", ok)
            elif op == "call":
                # a function of an importable module run on the engine, ``module:name``
                # (as ``ascend_kv_testing``'s ``EngineProcess.call``): ``fn(llm, **args)``
                module, _, name = str(cmd["fn"]).partition(":")
                fn = getattr(importlib.import_module(module), name)
                answer("ok", fn(llm, **cmd.get("args", {})))
            elif op == "settle":
                # let background saves finish: step while anything is pending, then wait
                settled = settle(float(cmd.get("timeout", 10)))
                time.sleep(float(cmd.get("sleep", 0.0)))
                answer("ok", settled and not pending())
            else:
                answer("error", f"unknown op {op!r}")
        except Exception:
            answer("error", traceback.format_exc())


def _count_external_tokens(engine: Any) -> list[int] | None:
    """Record vLLM's ``num_external_cached_tokens`` (a connector's loaded tokens) of every
    finished prefill, from the prefill stats the engine core hands the output processor.

    ``RequestOutput.num_cached_tokens`` cannot tell: it adds the local prefix hits, and on
    a P/D decode instance vLLM overwrites it with P's own cache hits. Returns the list the
    counts are appended to, or ``None`` where this vLLM has no such stats (in-process
    engine core only).
    """
    proc = getattr(engine, "output_processor", None)
    if proc is None or not hasattr(proc, "process_outputs"):
        return None
    counts: list[int] = []
    original = proc.process_outputs

    def process_outputs(engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        for out in engine_core_outputs or ():
            stats = getattr(out, "prefill_stats", None)
            n = getattr(stats, "num_external_cached_tokens", None)
            if isinstance(n, int):
                counts.append(n)
        return original(engine_core_outputs, *args, **kwargs)

    proc.process_outputs = process_outputs
    return counts


def _scheduler(engine: Any) -> Any | None:
    """vLLM's scheduler, where the engine core runs in this process (else ``None``)."""
    try:
        return engine.engine_core.engine_core.scheduler
    except AttributeError:
        return None


def _track_scheduling(engine: Any) -> dict[str, list[float]] | None:
    """Record, per request, when vLLM's scheduler took it in (``add_request``) and when it
    first scheduled it for a forward pass (``scheduled_new_reqs``), on this process's clock.

    A request whose KV a connector loads asynchronously (a P/D decode) waits in between in
    ``WAITING_FOR_REMOTE_KVS``: the difference is the D-side wait for the KV, the same
    measure for every connector, without the forward pass that a TTFT adds. Returns the
    dict the times go to (request id -> ``[added, scheduled]``), or ``None`` where the
    scheduler is not in this process.
    """
    sched = _scheduler(engine)
    if sched is None or not callable(getattr(sched, "add_request", None)) or not callable(
            getattr(sched, "schedule", None)):
        return None
    times: dict[str, list[float]] = {}
    add, schedule = sched.add_request, sched.schedule

    def add_request(request: Any, *args: Any, **kwargs: Any) -> Any:
        times.setdefault(str(getattr(request, "request_id", id(request))),
                         [time.perf_counter()])
        return add(request, *args, **kwargs)

    def schedule_(*args: Any, **kwargs: Any) -> Any:
        at = time.perf_counter()
        out = schedule(*args, **kwargs)
        for new in getattr(out, "scheduled_new_reqs", None) or ():
            seen = times.get(str(getattr(new, "req_id", "")))
            if seen is not None and len(seen) == 1:
                seen.append(at)
        return out

    sched.add_request = add_request
    sched.schedule = schedule_
    return times


def _waited(times: dict[str, list[float]] | None) -> list[float | None] | None:
    """Each request's wait between being added and first scheduled, in the order added
    (``None`` for one never scheduled); ``None`` when not tracked."""
    if times is None:
        return None
    return [t[1] - t[0] if len(t) == 2 else None for t in times.values()]


class EngineError(RuntimeError):
    """An engine process failed to start or to answer; the message holds its error."""


class EngineChild(PausableGroup):
    """A ``vllm.LLM`` in a child process (``python -m ...bench.serve.child``), paused
    (:meth:`pause`, SIGSTOP of its process group) while other engines are measured; the
    next :meth:`call` (or :meth:`resume`) continues it.

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
                [python or sys.executable, "-m", __name__],
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
        """Send one command and return its answer's payload (a paused engine goes on first)."""
        self.resume()
        self._send({"op": op, **args})
        return self._answer(timeout)

    def probe(self, fn: str, timeout: float = 120.0, **args: Any) -> Any:
        """Run ``module:function`` in the engine process as ``function(llm, **args)`` and
        return what it returns (JSON)."""
        return self.call("call", timeout, fn=fn, args=args)

    def generate(self, prompts: list[list[int]], *, max_tokens: int = 1,
                 kv_params: list[dict[str, Any] | None] | None = None,
                 timeout: float = 600.0) -> dict[str, Any]:
        """Greedy generation; returns ``seconds`` (wall, in the child) and ``outputs``."""
        kv = kv_params if kv_params is not None else [None] * len(prompts)
        return dict(self.call("generate", timeout, prompts=prompts, max_tokens=max_tokens,
                              kv_params=kv))

    def close(self, timeout: float = 30.0) -> None:
        """Ask the engine to stop; kill it if it does not."""
        self.resume()
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
        """SIGKILL the engine and every process of its session (vLLM's workers, anything
        they started): killing the engine alone left its children running, orphaned."""
        try:  # the engine leads its own session; after an exit, its children may be left
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            # killed, but not gone yet (a thread in the kernel): the rest of the run, and
            # the other engines to stop, must not be lost for it
            logger.warning("engine of %s (pid %d) was killed but had not exited after %.0f s; "
                           "going on without waiting for it", self.log, self.proc.pid,
                           KILL_WAIT_S)
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


if __name__ == "__main__":
    sys.exit(_child_main())
