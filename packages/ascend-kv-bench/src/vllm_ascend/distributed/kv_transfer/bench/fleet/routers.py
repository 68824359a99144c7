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

``ours*N`` (a router spec of ``bench fleet``, :func:`parse_spec`): N replicas of our proxy
with the same options, sharing nothing but the instances (each its own health rounds, each
``kv_aware`` replica its own subscription to every P's KV events); the driver spreads the
requests over them in turn, as a TCP load balancer in front of them would.
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


def parse_spec(spec: str) -> tuple[str, str, int]:
    """``kind:policy`` or ``ours*N:policy`` -> (kind, policy, replicas).

    Raises:
        ValueError: an unknown kind or policy, replicas of another router than ours, or a
            count below 1.
    """
    kind, sep, policy = spec.partition(":")
    base, star, count = kind.partition("*")
    try:
        replicas = int(count) if star else 1
    except ValueError:
        raise ValueError(f"{spec!r}: replicas are a number (ours*2:kv_aware)") from None
    if not sep or base not in POLICIES or policy not in POLICIES[base]:
        raise ValueError(f"unknown router:policy {spec!r}; known: " + ", ".join(
            f"{k}:{p}" for k, ps in POLICIES.items() for p in ps) + " (ours*N: N replicas)")
    if star and (base != "ours" or replicas < 1):
        raise ValueError(f"{spec!r}: only ours runs as replicas, at least 1")
    return base, policy, replicas


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
        port: the (first) router's port.
        replicas: processes of our proxy with the same options (``ours`` only), the others
            on free ports.
    """

    def __init__(self, kind: str, policy: str, prefill: Sequence[dict[str, Any]],
                 decode: Sequence[dict[str, Any]], logs: Path, port: int,
                 replicas: int = 1) -> None:
        if policy not in POLICIES[kind]:
            raise ValueError(f"{kind} has no policy {policy!r}")
        if replicas < 1 or (replicas > 1 and kind != "ours"):
            raise ValueError(f"{kind} cannot run {replicas} replicas (ours only, at least 1)")
        self.kind, self.policy, self.replicas = kind, policy, replicas
        from vllm_ascend.distributed.kv_transfer.core.net import free_port

        self.ports = [port, *(free_port() for _ in range(replicas - 1))]
        name = kind if replicas == 1 else f"{kind}x{replicas}"
        self.logs = [logs / (f"router-{name}-{policy}.log" if i == 0
                             else f"router-{name}-{policy}-{i}.log") for i in range(replicas)]
        self.procs: list[Any] = []
        self.cmds = [self._command(list(prefill), list(decode), p) for p in self.ports]

    @property
    def cmd(self) -> list[str]:
        """The (first) router's command line."""
        return self.cmds[0]

    @cmd.setter
    def cmd(self, cmd: list[str]) -> None:
        self.cmds[0] = cmd

    @property
    def name(self) -> str:
        """The router as runs name it: ``ours``, ``vllm-router``, ``none``, ``ours*2``."""
        return self.kind if self.replicas == 1 else f"{self.kind}*{self.replicas}"

    @property
    def proc(self) -> Any:
        """The (first) router's process, None when not started."""
        return self.procs[0] if self.procs else None

    @property
    def url(self) -> str:
        return self.urls[0]

    @property
    def urls(self) -> list[str]:
        """Every replica's URL (one for a single router)."""
        return [f"http://{HOST}:{p}" for p in self.ports]

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
        """Start it (every replica) and wait until each ``/health`` answers 200 (and, for our
        ``kv_aware``, until each has every event stream live)."""
        if self.kind == "none":
            return self
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.procs = [spawn(cmd, log=log, env=env) for cmd, log in zip(self.cmds, self.logs,
                                                                        strict=True)]
        waiting = set(range(len(self.procs)))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in sorted(waiting):
                if self.procs[i].poll() is not None:
                    code = self.procs[i].returncode
                    tail = self.tail()
                    self.stop()
                    raise RuntimeError(f"{self.name} exited with {code}: {tail}")
                url = self.urls[i]
                if _call(url + "/health", timeout=2)[0] == 200 and self._streams_live(url):
                    waiting.discard(i)
            if not waiting:
                return self
            time.sleep(0.1)  # a start is about 2 s: every run waits for it
        tail = self.tail()
        self.stop()  # a router left running would load every later run
        raise RuntimeError(f"{self.name} {self.policy} not ready after {timeout:.0f}s: {tail}")

    def _streams_live(self, url: str) -> bool:
        if not (self.kind == "ours" and self.policy == "kv_aware"):
            return True
        import json

        status, text = _call(url + "/status")
        if status != 200:
            return False
        prefill = json.loads(text).get("prefill") or []
        return all((p.get("events") or {}).get("state") == "live" for p in prefill)

    def tail(self, chars: int = 2000) -> str:
        out = []
        for log in self.logs:
            try:
                out.append(log.read_text(errors="replace")[-chars:])
            except OSError:
                pass
        return "\n".join(out)[-chars:]

    def add_prefill(self, inst: dict[str, Any]) -> tuple[bool, str]:
        """Take a new P into routing (every replica); (done, the router's answer)."""
        if self.kind == "ours":
            import json

            body = {"role": "prefill", "url": inst["url"]}
            if self.policy == "kv_aware":
                body["events"] = f"{inst['events']},{inst['replay']}"
            answers = [_call(u + "/admin/instances", "POST", json.dumps(body).encode())
                       for u in self.urls]
            status, text = max(answers, key=lambda a: not 200 <= a[0] < 300)
        elif self.kind == "vllm-router":
            q = urllib.parse.urlencode({"url": inst["url"], "worker_type": "prefill"})
            status, text = _call(f"{self.url}/add_worker?{q}", "POST")
        else:
            return True, ""
        return 200 <= status < 300, text[:300]

    def remove_prefill(self, inst: dict[str, Any]) -> tuple[bool, str]:
        """Stop routing to a P (every replica); (done, the router's answer)."""
        if self.kind == "ours":
            q = urllib.parse.urlencode({"role": "prefill", "url": inst["url"]})
            answers = [_call(f"{u}/admin/instances?{q}", "DELETE") for u in self.urls]
            status, text = max(answers, key=lambda a: not 200 <= a[0] < 300)
        elif self.kind == "vllm-router":
            q = urllib.parse.urlencode({"url": inst["url"]})
            status, text = _call(f"{self.url}/remove_worker?{q}", "POST")
        else:
            return True, ""
        return 200 <= status < 300, text[:300]

    def cpu_seconds(self) -> float | None:
        """CPU seconds (user and system) the router's processes have used so far, every
        replica's (Linux's ``/proc``; None: no process or not readable)."""
        if not self.procs:
            return None
        total = 0.0
        for proc in self.procs:
            try:
                fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                return None
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def stop(self) -> None:
        for proc in self.procs:
            stop(proc, timeout=10)
        self.procs = []
