# SPDX-License-Identifier: Apache-2.0
"""``vllm serve`` instances, the P/D proxy and vLLM's router as real processes, for end-to-end,
fault and soak tests.

Every process runs in its own process group with its output in a log file; the log tail
goes into every error so a failed start says why.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .procs import free_port, spawn, stop
from .requires import require_binary

HOST = "127.0.0.1"
MODEL_NAME = "tiny"
BLOCK_SIZE = 32
PROXY_MODULE = "vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.cli"
#: vLLM's count of finished requests (on every engine, P's max_tokens=1 requests included).
REQUESTS_DONE = "vllm:request_success_total"
#: P's requests whose blocks it still holds for D (pull mode).
HELD = "vllm:ascend_kv_p2p_held_requests"
#: D's requests whose KV it received from P.
LOADED = "vllm:ascend_kv_p2p_requests_loaded_total"


class Server:
    """A process serving HTTP on ``HOST:port``."""

    def __init__(self, name: str, cmd: list[str], port: int, logs: Path,
                 env: dict[str, str]) -> None:
        self.name, self.port, self.cmd, self.env = name, port, cmd, env
        self.log = logs / f"{name}.log"
        self.proc = spawn(cmd, log=self.log, env=env)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 400.0, path: str = "/health") -> Server:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   + self.tail())
            try:
                with urllib.request.urlopen(self.url + path, timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n" + self.tail())

    def restart(self) -> Server:
        """Start the same command again (same port) after the process died or was stopped."""
        stop(self.proc)
        self.proc = spawn(self.cmd, log=self.log, env=self.env)
        return self

    def kill(self) -> None:
        """SIGKILL the whole process group (vLLM's engine core child included)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def stop(self) -> None:
        stop(self.proc, timeout=20)


#: Where :func:`local_test_client` says its requests come from: this host.
LOOPBACK_CLIENT = ("127.0.0.1", 50000)


def local_test_client(app: Any, **kwargs: Any) -> Any:
    """Starlette's in-process ``TestClient`` over ``app``, its requests coming from this host
    (127.0.0.1) unless ``client=`` says otherwise. Its own default client host,
    ``"testclient"``, is no address: the proxy's protected mode refuses it, as it refuses any
    peer it cannot place on this host."""
    from fastapi.testclient import TestClient

    kwargs.setdefault("client", LOOPBACK_CLIENT)
    return TestClient(app, **kwargs)


def serve_env(**extra: str) -> dict[str, str]:
    """Environment of ``vllm serve`` children (loopback, small KV cache, engine core in its
    own process as in production). ``ENGINE_ENV`` is ascend-kv-bench's, imported here: the
    package sessions that only need :class:`AppThread` run without it."""
    from vllm_ascend.distributed.kv_transfer.bench.engine_env import ENGINE_ENV

    return {**os.environ, **ENGINE_ENV, "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
            **extra}


def vllm_serve(name: str, model: Path, logs: Path, kv: dict[str, Any] | None, *extra: str,
               env: dict[str, str] | None = None) -> Server:
    """Start ``vllm serve`` for the tiny model (float32, block size 32) with ``kv``."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", HOST, "--port", str(port), "--dtype", "float32", "--block-size",
           str(BLOCK_SIZE), "--max-model-len", "2048", "--enforce-eager", "--seed", "0",
           "--max-num-seqs", "8", "--served-model-name", MODEL_NAME, *extra]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return Server(name, cmd, port, logs, env or serve_env())


def started(make: Callable[[], Server], *, attempts: int = 3) -> Server:
    """``make()`` a server and wait until it is ready; when it died because a port it was
    given (``free_port``: free a moment ago) was taken meanwhile by another process, make
    it again, with the fresh ports ``make`` picks, up to ``attempts`` times."""
    for attempt in range(attempts):
        server = make()
        try:
            return server.wait_ready()
        except RuntimeError:
            lost_race = "Address already in use" in server.tail(200_000)
            server.stop()
            if not lost_race or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def start_all(make: dict[str, Callable[[], Server]], servers: dict[str, Server]) -> None:
    """Start several servers side by side, each through :func:`started`, into ``servers``
    (a vLLM start is mostly single-threaded imports and loading: two cores start two at
    once in about the time of one). If one fails, the others are stopped and it raises."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(len(make)) as pool:
        futures = {k: pool.submit(started, f) for k, f in make.items()}
        concurrent.futures.wait(futures.values())
    failed = [f.exception() for f in futures.values() if f.exception() is not None]
    ready = {k: f.result() for k, f in futures.items() if f.exception() is None}
    if failed:
        for server in ready.values():
            server.stop()
        raise failed[0]  # type: ignore[misc]
    servers.update(ready)


def proxy(name: str, logs: Path, prefill: list[str], decode: list[str], *extra: str,
          port: int | None = None, env: dict[str, str] | None = None) -> Server:
    """Start ``vllm-ascend-pd-proxy`` in front of the given instances."""
    port = port or free_port()
    cmd = [sys.executable, "-m", PROXY_MODULE, "--host", HOST, "--port", str(port),
           "--log-level", "warning", "--health-interval", "1"]
    for url in prefill:
        cmd += ["--prefill", url]
    for url in decode:
        cmd += ["--decode", url]
    return Server(name, [*cmd, *extra], port, logs, env or serve_env())


#: vLLM's Rust router on the package index, the version the e2e sessions install (noxfile.py).
VLLM_ROUTER = "vllm-router==0.1.17"


class RouterServer(Server):
    """``vllm-router`` (:func:`vllm_router`): its HTTP port and its Prometheus port."""

    def __init__(self, name: str, cmd: list[str], port: int, prometheus_port: int,
                 logs: Path, env: dict[str, str]) -> None:
        super().__init__(name, cmd, port, logs, env)
        self.prometheus_port = prometheus_port

    @property
    def prometheus_url(self) -> str:
        return f"http://{HOST}:{self.prometheus_port}"


def vllm_router(name: str, logs: Path, prefill: list[str], decode: list[str], *extra: str,
                policy: str = "round_robin", env: dict[str, str] | None = None) -> RouterServer:
    """Start vLLM's router (``vllm-router --vllm-pd-disaggregation``, the executable beside
    this interpreter) in front of the given P and D instances, its HTTP and Prometheus ports
    both on ``HOST`` (free ports); it checks the instances' health every second at start (its
    default waits 30 s between checks)."""
    exe = require_binary("vllm-router", VLLM_ROUTER)
    port, prometheus = free_port(), free_port()
    cmd = [exe, "--vllm-pd-disaggregation", "--host", HOST, "--port", str(port),
           "--prometheus-host", HOST, "--prometheus-port", str(prometheus),
           "--policy", policy, "--worker-startup-check-interval", "1"]
    for url in prefill:
        cmd += ["--prefill", url]
    for url in decode:
        cmd += ["--decode", url]
    return RouterServer(name, [*cmd, *extra], port, prometheus, logs, env or serve_env())


def http(url: str, body: Any = None, *, raw: bytes | None = None, timeout: float = 120.0,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """POST ``body`` as JSON (or ``raw`` bytes), GET when both are None; (status, decoded
    JSON or text). HTTP errors are returned, not raised."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, payload = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read()
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode(errors="replace")


def http_ok(url: str, body: Any = None, *, timeout: float = 120.0,
            headers: dict[str, str] | None = None) -> Any:
    """:func:`http` for a request that must succeed: the decoded answer, or an
    ``AssertionError`` naming the status and the start of the answer."""
    status, answer = http(url, body, timeout=timeout, headers=headers)
    assert status == 200, f"{url} answered {status}: {str(answer)[:2000]}"
    return answer


def completion(base: str, prompt: list[int], *, max_tokens: int = 8, timeout: float = 120.0,
               headers: dict[str, str] | None = None, **fields: Any) -> tuple[int, Any]:
    """A greedy completion of token ids, with the token ids in the answer (``fields``: more
    of the request's body; ``headers``: of the HTTP request)."""
    return http(base + "/v1/completions", {"model": MODEL_NAME, "prompt": prompt,
                                           "max_tokens": max_tokens, "temperature": 0.0,
                                           "ignore_eos": True, "return_token_ids": True,
                                           **fields}, timeout=timeout, headers=headers)


def token_ids(answer: Any) -> list[int]:
    """The completion's token ids."""
    return list(answer["choices"][0]["token_ids"])


def metrics(base: str) -> dict[str, float]:
    """Prometheus samples of ``base/metrics`` summed over label sets, by metric name."""
    status, text = http(base + "/metrics")
    assert status == 200, text
    out: dict[str, float] = {}
    for line in str(text).splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except ValueError:
            continue
    return out


def wait_metric(base: str, name: str, ok: Callable[[float], bool], *,
                timeout: float = 30.0) -> float:
    """Poll ``base/metrics`` until ``ok(value of name)`` (absent counts 0) or ``timeout``;
    the last value (vLLM publishes connector stats with its step stats, a little late)."""
    deadline = time.monotonic() + timeout
    value = metrics(base).get(name, 0.0)
    while not ok(value) and time.monotonic() < deadline:
        time.sleep(0.25)
        value = metrics(base).get(name, 0.0)
    return value


def bench_client(base: str, tokenizer: Path, work: Path, *, num_prompts: int, concurrency: int,
                 input_len: int = 64, output_len: int = 8, seed: int = 0,
                 extra: tuple[str, ...] = (), timeout: float = 600.0) -> dict[str, Any]:
    """vLLM's benchmark client (``vllm bench serve``, random dataset unless ``extra`` names
    another, e.g. ``--dataset-name prefix_repetition ...``) against ``base`` once, model
    ``MODEL_NAME`` with ``tokenizer``'s tokenizer; the summary row of bench client
    (``completed``, ``failed``, ``errors``, latencies)."""
    from vllm_ascend.distributed.kv_transfer.bench.client.procs import run_client

    work.mkdir(parents=True, exist_ok=True)
    return run_client(sys.executable, base, MODEL_NAME, num_prompts=num_prompts,
                      concurrency=concurrency, input_len=input_len, output_len=output_len,
                      seed=seed, work=work, timeout=timeout,
                      extra=("--tokenizer", str(tokenizer), *extra),
                      tag=f"-{len(list(work.iterdir()))}", env=serve_env())


class AppThread:
    """An ASGI app (a stand-in instance, a proxy or router under test) served by uvicorn on
    a daemon thread of the test process, on ``HOST:port`` (``port``: a free one unless
    given, e.g. when the app must know its own address before it is built)."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        import threading

        import uvicorn

        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host=HOST, port=self.port,
                                                    log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self, timeout: float = 10.0) -> AppThread:
        """Serve, and return once the server listens (``RuntimeError`` if it did not in
        ``timeout``)."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started and time.monotonic() < deadline:
            if not self.thread.is_alive():
                break
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError(f"the app on port {self.port} did not start in {timeout}s")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(5)

    def __enter__(self) -> AppThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class StubInstance:
    """An HTTP server in the test process standing in for a ``vllm serve`` instance behind
    the proxy (proxy tests that exercise the proxy alone: no model, no engine).

    ``GET /health`` and ``/v1/models`` answer 200; ``POST /v1/completions`` records the
    body in ``bodies`` and answers a one-token completion. A decode stub (``hold=True``)
    keeps each completion open until the test calls ``release(request_id)`` (or
    ``hold_s`` passed), the request id being ``kv_transfer_params["request_id"]``, which
    ``next_request()`` hands to the test: the proxy's layerwise request stays pending while
    the test posts to its metaserver.
    """

    def __init__(self, *, hold: bool = False, hold_s: float = 30.0) -> None:
        import queue
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.bodies: list[Any] = []
        self._arrived: queue.Queue[str] = queue.Queue()
        self._released: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, doc: Any) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path.startswith("/v1/models"):
                    self._answer(200, {"object": "list", "data": [{"id": MODEL_NAME}]})
                else:
                    self._answer(200, {})

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = None
                outer.bodies.append(body)
                kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
                rid = kv.get("request_id") if isinstance(kv, dict) else None
                if hold and isinstance(rid, str):
                    event = outer._event(rid)
                    outer._arrived.put(rid)
                    event.wait(hold_s)
                self._answer(200, {"id": "stub", "object": "text_completion",
                                   "choices": [{"index": 0, "text": "x", "token_ids": [5],
                                                "finish_reason": "length"}],
                                   "kv_transfer_params": kv if isinstance(kv, dict) else None})

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer((HOST, 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://{HOST}:{self.httpd.server_address[1]}"

    def _event(self, rid: str) -> Any:
        import threading

        with self._lock:
            return self._released.setdefault(rid, threading.Event())

    def next_request(self, timeout: float = 30.0) -> str:
        """The request id of the next completion that arrived (held until released)."""
        return self._arrived.get(timeout=timeout)

    def release(self, rid: str) -> None:
        """Let the held completion ``rid`` answer."""
        self._event(rid).set()

    def close(self) -> None:
        with self._lock:
            for event in self._released.values():
                event.set()
        self.httpd.shutdown()
        self.httpd.server_close()
