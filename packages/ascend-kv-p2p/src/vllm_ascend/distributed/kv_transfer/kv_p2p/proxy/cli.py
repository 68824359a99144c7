# SPDX-License-Identifier: Apache-2.0
"""Command line of ``vllm-ascend-pd-proxy``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .app import ProxyConfig, build_app
from .balancer import POLICIES
from .model import MODES


def _url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        value = "http://" + value
    return value.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-ascend-pd-proxy",
        description="OpenAI-compatible proxy in front of prefill (P) and decode (D) vLLM "
                    "instances. --mode pull (MooncakeConnectorV1): each request is prefilled "
                    "on a P instance, then decoded on a D instance that pulls P's KV cache. "
                    "--mode layerwise (MooncakeLayerwiseConnector): each request goes to a D "
                    "instance first; D posts its blocks to this proxy's /v1/metaserver and a P "
                    "instance pushes the KV into them layer by layer while it prefills.")
    parser.add_argument("--prefill", action="append", required=True, type=_url,
                        metavar="URL", help="a prefill instance (repeat for several)")
    parser.add_argument("--decode", action="append", required=True, type=_url,
                        metavar="URL", help="a decode instance (repeat for several)")
    parser.add_argument("--mode", choices=MODES, default="pull",
                        help="which P/D connector the instances run (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument("--metaserver-url", default=None,
                        help="URL of /v1/metaserver as the decode instances reach this proxy "
                             "(layerwise mode; default: built from --host and --port)")
    parser.add_argument("--ssl-certfile", default=None,
                        help="serve HTTPS with this certificate (the decode instances' "
                             "tls_config must trust it)")
    parser.add_argument("--ssl-keyfile", default=None, help="private key of --ssl-certfile")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin",
                        help="how an instance is chosen (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for an instance's answer (default: %(default)s)")
    parser.add_argument("--lease-renew-interval", type=float, default=5.0,
                        help="pull mode: renew P's lease on a request's blocks this often "
                             "while D has the request, so a request queued on a busy D keeps "
                             "its KV; 0 turns it off (default: %(default)s s)")
    parser.add_argument("--no-kv-error-fallback", dest="kv_error_fallback",
                        action="store_false",
                        help="pull mode: pass D's KV-load errors to the client instead of "
                             "re-sending the request once as a plain request (D prefills it)")
    parser.add_argument("--health-interval", type=float, default=5.0,
                        help="seconds between health checks (default: %(default)s)")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    return parser


def metaserver_url(args: argparse.Namespace) -> str:
    """The metaserver URL the decode instances are given."""
    if args.metaserver_url:
        return str(args.metaserver_url)
    scheme = "https" if args.ssl_certfile else "http"
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{scheme}://{host}:{args.port}/v1/metaserver"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        parser.error("--ssl-certfile and --ssl-keyfile go together")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    cfg = ProxyConfig(prefill=args.prefill, decode=args.decode, policy=args.policy,
                      timeout_s=args.timeout, health_interval_s=args.health_interval,
                      lease_renew_interval_s=args.lease_renew_interval,
                      kv_error_fallback=args.kv_error_fallback,
                      mode=args.mode,
                      metaserver_url=metaserver_url(args) if args.mode == "layerwise" else None)
    uvicorn.run(build_app(cfg), host=args.host, port=args.port, log_level=args.log_level,
                ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
