# SPDX-License-Identifier: Apache-2.0
"""Helpers of the P/D end-to-end tests (MooncakeConnectorV1 on real engines)."""

from __future__ import annotations

import random
from typing import Any

from .engines import EngineProcess
from .procs import free_port

#: Module of the in-engine probe functions (``EngineProcess.call``).
PROBES = "ascend_kv_testing.probes"
#: What the proxy puts in P's kv_transfer_params.
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False}


def kv_config(role: str, engine_id: str, policy: str = "fail", *,
              connector: str = "MooncakeConnectorV1", **extra: Any) -> dict[str, Any]:
    """A ``kv_transfer_config`` for one P or D engine on a free port."""
    return {"kv_connector": connector, "kv_role": role, "kv_port": free_port(),
            "engine_id": engine_id, "kv_load_failure_policy": policy,
            "kv_connector_extra_config": {"load_timeout_s": 30, **extra}}


def prompts_of(lengths: list[int], seed: int, *, vocab: int | None = None) -> list[list[int]]:
    """Random token-id prompts of the given lengths (reproducible); with ``vocab``, every id
    folded into ``[3, vocab)`` (a served model's tokenizer is that small)."""
    rng = random.Random(seed)
    out = [[rng.randrange(3, 1000) for _ in range(n)] for n in lengths]
    return out if vocab is None else [[3 + t % (vocab - 3) for t in p] for p in out]


def prefill(p: EngineProcess, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Prefill on P (max_tokens=1); returns the kv_transfer_params for D."""
    res = p.generate(prompts, max_tokens=1, kv_params=[dict(PREFILL) for _ in prompts])
    params = [r.kv_transfer_params for r in res]
    for r, x in zip(res, params, strict=True):
        if not (isinstance(x, dict) and x.get("do_remote_prefill")):
            raise AssertionError(f"P returned no kv_transfer_params for {r.request_id}: {r}")
    return params  # type: ignore[return-value]


def baseline(d: EngineProcess, prompts: list[list[int]], n: int = 8) -> list[list[int]]:
    """Single-instance tokens (an engine asked without kv params behaves as a plain engine);
    its prefix cache is reset afterwards so later runs really transfer."""
    out = [r.token_ids for r in d.generate(prompts, max_tokens=n)]
    d.reset_prefix_cache()
    return out


#: The layerwise connector.
LAYERWISE = "MooncakeLayerwiseConnector"


class Metaserver:
    """Records D's layerwise metaserver posts (the proxy's ``/v1/metaserver`` without the
    forwarding to P): ``wait(ids)`` returns the posts, which are P's kv_transfer_params."""

    def __init__(self) -> None:
        import itertools
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.posts: dict[str, dict[str, Any]] = {}
        self._ids = itertools.count()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.posts[body["request_id"]] = body
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/metaserver"

    def params(self, request_id: str) -> dict[str, Any]:
        """What the proxy gives D for one layerwise request."""
        return {"do_remote_prefill": True, "metaserver": self.url, "request_id": request_id}

    def wait(self, ids: list[str], timeout: float = 60.0) -> list[dict[str, Any]]:
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not all(i in self.posts for i in ids):
            time.sleep(0.02)
        missing = [i for i in ids if i not in self.posts]
        if missing:
            raise AssertionError(f"D never posted {missing}")
        return [self.posts[i] for i in ids]

    def start_decode(self, d: EngineProcess, prompt: list[int], out: dict[str, Any], *,
                     prefix: str) -> tuple[str, Any]:
        """D gets a layerwise request first, as from the proxy, on a thread whose outcome
        lands in ``out`` (``d``: D's result, or ``error``; ``took``: seconds); the request's
        id (``prefix-N``, for :meth:`wait`) and the thread."""
        import threading
        import time

        rid = f"{prefix}-{next(self._ids)}"

        def decode() -> None:
            start = time.monotonic()
            try:
                out["d"] = d.generate([prompt], max_tokens=8, kv_params=[self.params(rid)],
                                      timeout=120)[0]
            except BaseException as exc:  # D killed: the pipe to it breaks
                out["error"] = exc
            out["took"] = time.monotonic() - start

        thread = threading.Thread(target=decode, daemon=True)
        thread.start()
        return rid, thread

    def pd_once(self, p: EngineProcess, d: EngineProcess, prompt: list[int], *,
                prefix: str) -> Any:
        """One layerwise P/D request: D first, then P with what D posted; D's result."""
        out: dict[str, Any] = {}
        rid, thread = self.start_decode(d, prompt, out, prefix=prefix)
        p.generate([prompt], max_tokens=1, kv_params=self.wait([rid]))
        thread.join(120)
        assert "d" in out, out
        return out["d"]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
