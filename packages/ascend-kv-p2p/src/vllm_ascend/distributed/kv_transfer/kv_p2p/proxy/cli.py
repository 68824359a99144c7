# SPDX-License-Identifier: Apache-2.0
"""Command line of ``vllm-ascend-pd-proxy``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .app import ProxyConfig, build_app
from .balancer import POLICIES


def _url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        value = "http://" + value
    return value.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-ascend-pd-proxy",
        description="OpenAI-compatible proxy in front of prefill (P) and decode (D) vLLM "
                    "instances using MooncakeConnectorV1: each request is prefilled on a P "
                    "instance, then decoded on a D instance that pulls P's KV cache.")
    parser.add_argument("--prefill", action="append", required=True, type=_url,
                        metavar="URL", help="a prefill instance (repeat for several)")
    parser.add_argument("--decode", action="append", required=True, type=_url,
                        metavar="URL", help="a decode instance (repeat for several)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument("--policy", choices=POLICIES, default="round_robin",
                        help="how an instance is chosen (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for an instance's answer (default: %(default)s)")
    parser.add_argument("--health-interval", type=float, default=5.0,
                        help="seconds between health checks (default: %(default)s)")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    cfg = ProxyConfig(prefill=args.prefill, decode=args.decode, policy=args.policy,
                      timeout_s=args.timeout, health_interval_s=args.health_interval)
    uvicorn.run(build_app(cfg), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
