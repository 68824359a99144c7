# SPDX-License-Identifier: Apache-2.0
"""``bench serve`` scenarios of ascend-kv-p2p's two P/D connectors between two engines.

The ``vllm_ascend_kv.serve`` entry point ``p2p`` names :func:`scenarios`.

* ``pd/ours``: ``MooncakeConnectorV1``, D pulls P's blocks once P finished: from P's
  memory (same-host reads, ``core.local_reads``: P and D run on one host here, their KV
  caches in host memory), else over the Mooncake transfer engine (tcp); D's TTFT is
  compared with vLLM's ``NixlConnector`` and ``MooncakeConnector`` (:mod:`.builtin`).
* ``pd/ours-tcp``: the same with same-host reads off (``VLLM_ASCEND_KV_LOCAL_READS=0`` on
  both engines): every byte over the transfer engine's TCP transport, as between two hosts
  without RDMA. What the same-host path gives is ``pd/ours`` against it; it is compared
  with vLLM's ``MooncakeConnector``, whose bytes go over the same transport (no goal).
* ``pd/ours-layerwise``: ``MooncakeLayerwiseConnector``, as behind the proxy in layerwise
  mode: D gets the request first and posts its blocks to a metaserver (here, in the
  benchmark's process), then P prefills and pushes every layer into D's blocks while it
  computes. D's figure is the same as the pull's: its time to the first token once P
  had finished (wall clocks of one host), over the same floor. P computes every prompt
  afresh (its prefix cache is reset first), as a cached P would push everything at once
  after a short forward. P's prefill (with the pushes) and the whole request (D's request
  sent to D's first token, ``pd_total_s``) are kept beside it: the push moves work into
  P's forward, and a comparison of D's wait alone would hide it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.local_reads import LOCAL_READS_ENV
from vllm_ascend.distributed.kv_transfer.core.net import free_port

from .child import EngineChild
from .compare import PD_REQUEST
from .pd import require_params, run_pd
from .scenarios import Run
from .spec import Comparison, Goal, Scenario

logger = logging.getLogger(__name__)

#: The summary key compared: D's TTFT over the recompute measured next to it.
TTFT = "d_ttft_over_recompute"


def _kv(connector: str, role: str, engine_id: str) -> dict[str, Any]:
    """The ``kv_transfer_config`` of one engine of our P/D scenarios."""
    return {"kv_connector": connector, "kv_role": role, "kv_port": free_port(),
            "engine_id": engine_id, "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"load_timeout_s": 60}}


def _pull(run: Run, name: str, engine_id: str, env: dict[str, str] | None = None
          ) -> dict[str, Any]:
    """MooncakeConnectorV1 between a P and a D started with ``env``. P computes every
    prompt, as the layerwise P does: their prefills and whole requests are compared (a
    repeat that hit P's own cache would make the pull look free on P)."""
    def params(_key: str) -> tuple[dict[str, Any], Callable[..., dict[str, Any]]]:
        return {"do_remote_decode": True, "do_remote_prefill": False}, require_params

    return run_pd(run, name, _kv("MooncakeConnectorV1", "kv_producer", f"{engine_id}-p"),
                  _kv("MooncakeConnectorV1", "kv_consumer", f"{engine_id}-d"), params,
                  p_env=env, d_env=env, fresh_p=True)


def sc_pd_ours(run: Run) -> dict[str, Any]:
    """MooncakeConnectorV1: D pulls from P (from P's memory on this host)."""
    return _pull(run, "pd/ours", "bench-ours")


def sc_pd_ours_tcp(run: Run) -> dict[str, Any]:
    """MooncakeConnectorV1 with same-host reads off: D pulls over the transfer engine."""
    return _pull(run, "pd/ours-tcp", "bench-tcp", {LOCAL_READS_ENV: "0"})


#: How long the layerwise flow waits for D's post and for D's answer after P's.
LAYERWISE_WAIT_S = 120.0


class Metaserver:
    """The layerwise proxy's ``/v1/metaserver`` without the proxy: D's posts, by request id
    (each is P's ``kv_transfer_params`` for that request), on a loopback port."""

    def __init__(self) -> None:
        self.posts: dict[str, dict[str, Any]] = {}
        self._cv = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                try:
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    rid = body["request_id"]
                except (KeyError, TypeError, ValueError):
                    self.send_error(400, "expected a JSON object with a request_id")
                    return
                with outer._cv:
                    outer.posts[str(rid)] = body
                    outer._cv.notify_all()
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, name="bench-metaserver",
                         daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/metaserver"

    def wait(self, request_id: str, timeout: float) -> dict[str, Any] | None:
        """D's post of ``request_id`` (``None`` if none came within ``timeout``)."""
        with self._cv:
            self._cv.wait_for(lambda: request_id in self.posts, timeout)
            return self.posts.pop(request_id, None)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def layerwise_sample(meta: Metaserver) -> Callable[..., tuple[dict[str, Any], dict[str, Any],
                                                               float]]:
    """One layerwise request as the proxy runs it (``pd.PDSample``): D first,
    P with what D posted; D's time to its first token after P's prefill returned."""
    def sample(p: EngineChild, d: EngineChild, prompt: list[int], key: str
               ) -> tuple[dict[str, Any], dict[str, Any], float]:
        rid = f"lw-{key}-{uuid.uuid4().hex[:8]}"
        p.call("reset_prefix_cache")  # P computes the prompt (and pushes as it goes)
        got: dict[str, Any] = {}

        def decode() -> None:
            try:
                got["d"] = d.generate([prompt], kv_params=[{
                    "do_remote_prefill": True, "do_remote_decode": False,
                    "metaserver": meta.url, "request_id": rid}])
            except BaseException as exc:  # raised below, on the benchmark's thread
                got["error"] = exc

        started = time.time()
        t = threading.Thread(target=decode, name="bench-layerwise-d", daemon=True)
        t.start()
        posted = meta.wait(rid, LAYERWISE_WAIT_S)
        if posted is None:
            t.join(LAYERWISE_WAIT_S)
            raise RuntimeError(f"D posted no blocks for {rid} within {LAYERWISE_WAIT_S:.0f}s"
                               + (f": {got['error']}" if "error" in got else ""))
        pout = p.generate([prompt], kv_params=[posted])
        t.join(LAYERWISE_WAIT_S)
        if "error" in got:
            raise got["error"]
        if "d" not in got:
            raise RuntimeError(f"D did not answer {rid} within {LAYERWISE_WAIT_S:.0f}s "
                               "after P's prefill")
        dout: dict[str, Any] = got["d"]
        dout["pd_total_s"] = dout["ended_at"] - started
        # D's scheduler held the request from its arrival, before P began: that wait is
        # P's prefill, not a transfer (the pull's figure); D's time after P stands for it
        dout["kv_wait_s"] = None
        return pout, dout, dout["ended_at"] - pout["ended_at"]

    return sample


def sc_pd_layerwise(run: Run) -> dict[str, Any]:
    """MooncakeLayerwiseConnector: D first, P pushes each layer into D's blocks."""
    meta = run.memo.get("pd/ours-layerwise:metaserver")
    if meta is None:
        meta = run.memo["pd/ours-layerwise:metaserver"] = Metaserver()
        run.on_close(meta.close)
    return run_pd(run, "pd/ours-layerwise",
                  _kv("MooncakeLayerwiseConnector", "kv_producer", "bench-lw-p"),
                  _kv("MooncakeLayerwiseConnector", "kv_consumer", "bench-lw-d"), None,
                  sample=layerwise_sample(meta))


def _versus(peer: str, label: str, ttft_goal: Goal | None) -> tuple[Comparison, ...]:
    return (Comparison(f"P/D decode TTFT: ours / {label}", TTFT, peer, ttft_goal),
            # bytes / D TTFT: the inverse of the TTFT ratio, with the issue's own goal
            Comparison(f"P/D KV throughput: ours / {label}", TTFT, peer,
                       Goal(">= 1.2", at_least=1.2), inverse=True))


def scenarios() -> list[Scenario]:
    """The scenarios of this package (the ``vllm_ascend_kv.serve`` entry point of ascend-kv-bench)."""
    return [Scenario(
        "pd/ours", "pd", "ours", "MooncakeConnectorV1",
        "D pulls P's blocks (same host: from P's memory; else Mooncake TE, tcp)",
        ["mooncake"], sc_pd_ours, quick=True,
        comparisons=(*_versus("pd/vllm-nixl", "NixlConnector", Goal("<= 0.8", at_most=0.8)),
                     *_versus("pd/vllm-mooncake", "vLLM MooncakeConnector", Goal("")),
                     # what the same-host path gives (no goal of its own)
                     Comparison("P/D decode TTFT: ours / ours over TCP", TTFT, "pd/ours-tcp",
                                overhead_goal=Goal("")),
                     # P's prefill and the whole request (every P computes its prompts)
                     Comparison("P/D request: ours / NixlConnector", PD_REQUEST,
                                "pd/vllm-nixl"),
                     Comparison("P/D request: ours / vLLM MooncakeConnector", PD_REQUEST,
                                "pd/vllm-mooncake"))),
        Scenario(
        "pd/ours-tcp", "pd", "ours", "MooncakeConnectorV1",
        "D pulls P's blocks over the Mooncake TE (tcp), same-host reads off",
        ["mooncake"], sc_pd_ours_tcp,
        # the path of a P on another host, against the peer whose bytes go over the same
        # transport (no goal of its own: the goals are the pull's as deployed, above)
        comparisons=(Comparison("P/D decode TTFT: ours over TCP / vLLM MooncakeConnector",
                                TTFT, "pd/vllm-mooncake", overhead_goal=Goal("")),)),
        Scenario(
        "pd/ours-layerwise", "pd", "ours", "MooncakeLayerwiseConnector",
        "D first; P pushes each layer into D's blocks as it computes (Mooncake TE, tcp)",
        ["mooncake"], sc_pd_layerwise,
        comparisons=(
            Comparison("P/D decode TTFT after P: ours-layerwise / NixlConnector", TTFT,
                       "pd/vllm-nixl"),
            Comparison("P/D decode TTFT after P: ours-layerwise / vLLM MooncakeConnector",
                       TTFT, "pd/vllm-mooncake"),
            # how much of the pull's wait the push takes off (no goal of its own)
            Comparison("P/D decode TTFT after P: ours-layerwise / ours (pull)", TTFT,
                       "pd/ours", overhead_goal=Goal("")),
            # and what it costs P, and the client: P's prefill with the pushes, the whole
            # request, against the pull under the same binding
            Comparison("P/D request: ours-layerwise / ours (pull)", PD_REQUEST,
                       "pd/ours")))]
