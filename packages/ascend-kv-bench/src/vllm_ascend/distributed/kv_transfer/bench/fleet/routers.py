# SPDX-License-Identifier: Apache-2.0
"""The routers ``bench fleet`` puts in front of the simulated fleet, as child processes.

* ``ours``: ``vllm-ascend-pd-proxy`` (pull mode) with a policy (``round_robin``,
  ``least_loaded``, ``kv_aware``: the P instances' KV event streams, with replay); instances
  added and removed through its ``/admin/instances``;
* ``vllm-router``: vLLM's router (``vllm-router --vllm-pd-disaggregation``, the executable
  beside this interpreter or on ``PATH``) with a policy for P and D (``round_robin``,
  ``cache_aware``, ``kv_aware`` fed by ``--pd-kv-events``); instances added and removed
  through its ``/add_worker`` and ``/remove_worker``;
* ``none``: no router process; the driver sends each request to a P and then a D itself, in
  turn (the baseline of what the client, loopback and the fleet's event loop cost).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..procs import spawn, stop

HOST = "127.0.0.1"
PROXY_MODULE = "vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.cli"
#: Policies of each router (``none`` has one: round robin by the client).
POLICIES: dict[str, tuple[str, ...]] = {
    "ours": ("round_robin", "least_loaded", "kv_aware"),
    "vllm-router": ("round_robin", "cache_aware", "kv_aware"),
    "none": ("round_robin",),
}


def vllm_router_binary() -> str | None:
    """``vllm-router`` beside this interpreter, else on ``PATH``."""
    beside = Path(sys.executable).with_name("vllm-router")
    return str(beside) if beside.exists() else shutil.which("vllm-router")


def _call(url: str, method: str = "GET", body: bytes | None = None,
          timeout: float = 10.0) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except OSError as exc:
        return 0, str(exc)


class Router:
    """One router process in front of ``prefill`` and ``decode`` (fleet instance dicts).

    Args:
        kind: ``ours``, ``vllm-router`` or ``none``.
        policy: one of :data:`POLICIES` of ``kind``.
        logs: where its output goes.
    """

    def __init__(self, kind: str, policy: str, prefill: Sequence[dict[str, Any]],
                 decode: Sequence[dict[str, Any]], logs: Path, port: int) -> None:
        if policy not in POLICIES[kind]:
            raise ValueError(f"{kind} has no policy {policy!r}")
        self.kind, self.policy = kind, policy
        self.port = port
        self.log = logs / f"router-{kind}-{policy}.log"
        self.proc: Any = None
        self.cmd = self._command(list(prefill), list(decode), port)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _command(self, prefill: list[dict[str, Any]], decode: list[dict[str, Any]],
                 port: int) -> list[str]:
        if self.kind == "none":
            return []
        if self.kind == "ours":
            cmd = [sys.executable, "-m", PROXY_MODULE, "--host", HOST, "--port", str(port),
                   "--policy", self.policy, "--health-interval", "1",
                   "--lease-renew-interval", "0", "--log-level", "warning"]
            for p in prefill:
                cmd += ["--prefill", p["url"]]
            for d in decode:
                cmd += ["--decode", d["url"]]
            if self.policy == "kv_aware":
                cmd += ["--kv-block-size", "16"]
                for p in prefill:
                    cmd += ["--prefill-events", f"{p['events']},{p['replay']}"]
            return cmd
        exe = vllm_router_binary()
        if exe is None:
            raise FileNotFoundError("vllm-router is not installed (pip install vllm-router)")
        from vllm_ascend.distributed.kv_transfer.core.net import free_port

        cmd = [exe, "--vllm-pd-disaggregation", "--host", HOST, "--port", str(port),
               "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
               "--policy", self.policy, "--worker-startup-check-interval", "1",
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--log-level", "warning"]
        for p in prefill:
            cmd += ["--prefill", p["url"]]
        for d in decode:
            cmd += ["--decode", d["url"]]
        if self.policy == "kv_aware":
            for p in prefill:
                cmd += ["--pd-kv-events", f"{p['url']}={p['events']}"]
        return cmd

    def start(self, timeout: float = 120.0) -> Router:
        """Start it and wait until ``/health`` answers 200 (and, for our ``kv_aware``, until
        every event stream is live)."""
        if self.kind == "none":
            return self
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = spawn(self.cmd, log=self.log, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                raise RuntimeError(f"{self.kind} exited with {code}: {self.tail()}")
            if _call(self.url + "/health", timeout=2)[0] == 200 and self._streams_live():
                return self
            time.sleep(0.5)
        tail = self.tail()
        self.stop()  # a router left running would load every later run
        raise RuntimeError(f"{self.kind} {self.policy} not ready after {timeout:.0f}s: {tail}")

    def _streams_live(self) -> bool:
        if not (self.kind == "ours" and self.policy == "kv_aware"):
            return True
        import json

        status, text = _call(self.url + "/status")
        if status != 200:
            return False
        prefill = json.loads(text).get("prefill") or []
        return all((p.get("events") or {}).get("state") == "live" for p in prefill)

    def tail(self, chars: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def add_prefill(self, inst: dict[str, Any]) -> tuple[bool, str]:
        """Take a new P into routing; (done, the router's answer)."""
        if self.kind == "ours":
            import json

            body = {"role": "prefill", "url": inst["url"]}
            if self.policy == "kv_aware":
                body["events"] = f"{inst['events']},{inst['replay']}"
            status, text = _call(self.url + "/admin/instances", "POST",
                                 json.dumps(body).encode())
        elif self.kind == "vllm-router":
            q = urllib.parse.urlencode({"url": inst["url"], "worker_type": "prefill"})
            status, text = _call(f"{self.url}/add_worker?{q}", "POST")
        else:
            return True, ""
        return 200 <= status < 300, text[:300]

    def remove_prefill(self, inst: dict[str, Any]) -> tuple[bool, str]:
        """Stop routing to a P; (done, the router's answer)."""
        if self.kind == "ours":
            q = urllib.parse.urlencode({"role": "prefill", "url": inst["url"]})
            status, text = _call(f"{self.url}/admin/instances?{q}", "DELETE")
        elif self.kind == "vllm-router":
            q = urllib.parse.urlencode({"url": inst["url"]})
            status, text = _call(f"{self.url}/remove_worker?{q}", "POST")
        else:
            return True, ""
        return 200 <= status < 300, text[:300]

    def cpu_seconds(self) -> float | None:
        """CPU seconds (user and system) the router process has used so far (Linux's
        ``/proc``; None: no process or not readable)."""
        if self.proc is None:
            return None
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, timeout=10)
            self.proc = None
