# SPDX-License-Identifier: Apache-2.0
"""Command line of ``vllm-ascend-pd-proxy``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from .app import ProxyConfig, build_app
from .events import EventsEndpoint
from .model import MODES
from .policies import policy_class, policy_names
from .prefix_index import HASH_ALGOS, POOL_MAX_BLOCKS, POOL_MEDIUM, PREFIX_MAX_BLOCKS
from .router import KvAwareSettings


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
    parser.add_argument("--prefill", action="append", type=_url,
                        metavar="URL", help="a prefill instance (repeat for several; required)")
    parser.add_argument("--decode", action="append", type=_url,
                        metavar="URL", help="a decode instance (repeat for several; required)")
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
    parser.add_argument("--policy", choices=policy_names(), default="round_robin",
                        help="how an instance is chosen (default: %(default)s); kv_aware: the "
                             "P instance with the longest cached prefix of the prompt, traded "
                             "against its requests in flight (see docs/quickstart-pd.md)")
    kv = parser.add_argument_group("kv_aware policy")
    kv.add_argument("--prefill-events", action="append", default=[],
                    metavar="ENDPOINT[,REPLAY]",
                    help="the KV events endpoint of the --prefill instance in the same "
                         "position (its --kv-events-config endpoint as reachable from here, "
                         "and optionally its replay_endpoint), e.g. "
                         "tcp://10.0.0.1:5557,tcp://10.0.0.1:5558; '-' for none")
    kv.add_argument("--kv-events-topic", default="",
                    help="the instances' kv-events topic (default: none)")
    kv.add_argument("--kv-hash-algo", choices=HASH_ALGOS, default="sha256",
                    help="the instances' --prefix-caching-hash-algo (default: %(default)s)")
    kv.add_argument("--kv-hash-seed", default=None,
                    help="the instances' PYTHONHASHSEED (default: this process's "
                         "PYTHONHASHSEED, else vLLM's fixed default seed)")
    kv.add_argument("--kv-block-size", type=int, default=None,
                    help="the instances' block size (default: read from their events)")
    kv.add_argument("--kv-load-weight", type=float, default=0.25,
                    help="score = cached fraction of the prompt - WEIGHT * requests in "
                         "flight (default: %(default)s)")
    kv.add_argument("--pool-shared", action="store_true",
                    help="the --prefill instances run AscendStoreConnector with one KV pool "
                         "they share (Mooncake Store, Memcache): a block the pool's events "
                         "announce on any instance's stream counts for every instance (score: "
                         "the longer prefix of its device cache or the pool; the device on a "
                         "tie). Not with the embedded 'local' backend: each instance has its "
                         "own (its pool events then count for it alone, the default)")
    kv.add_argument("--prefill-pool", action="append", default=[], metavar="NAME",
                    help="several shared pools: the pool of the --prefill instance in the "
                         "same position ('-' for none); instances with the same NAME share "
                         "one pool")
    kv.add_argument("--pool-medium", default=POOL_MEDIUM,
                    help="the 'medium' of the pool's KV events (default: %(default)s, "
                         "AscendStoreConnector's)")
    kv.add_argument("--pool-max-blocks", type=int, default=POOL_MAX_BLOCKS,
                    help="blocks a pool index keeps at most, the most recently stored "
                         "(Mooncake Store and Memcache do not announce their evictions; "
                         "default: %(default)s)")
    kv.add_argument("--kv-index-max-blocks", type=int, default=PREFIX_MAX_BLOCKS,
                    help="blocks the index of one P instance keeps at most, the most "
                         "recently stored (an instance whose removals never come cannot "
                         "grow it further; default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for an instance's answer (default: %(default)s)")
    parser.add_argument("--lease-renew-interval", type=float, default=5.0,
                        help="pull mode: renew P's lease on a request's blocks this often "
                             "while D has the request, so a request queued on a busy D keeps "
                             "its KV; keep it at most a third of P's lease_ttl_s; 0 turns it "
                             "off (default: %(default)s s)")
    parser.add_argument("--no-kv-error-fallback", dest="kv_error_fallback",
                        action="store_false",
                        help="pull mode: pass D's KV-load errors to the client instead of "
                             "re-sending the request once as a plain request (D prefills it)")
    parser.add_argument("--health-interval", type=float, default=5.0,
                        help="seconds between health checks (an instance that answered a "
                             "request since the round before is not probed; default: "
                             "%(default)s)")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--print-admin-token", action="store_true",
                        help="print the operator's bearer token (/status, /metrics, "
                             "/admin/instances) under the deployment key "
                             "(VLLM_ASCEND_KV_AUTH_KEY[_FILE]) and exit")
    return parser


def kv_settings(parser: argparse.ArgumentParser, args: argparse.Namespace) -> KvAwareSettings:
    """The kv_aware settings of the command line (events endpoints by --prefill position)."""
    if len(args.prefill_events) > len(args.prefill):
        parser.error("more --prefill-events than --prefill instances")
    events: dict[str, EventsEndpoint] = {}
    for url, spec in zip(args.prefill, args.prefill_events, strict=False):
        if spec.strip() in ("", "-"):
            continue
        try:
            events[url] = EventsEndpoint.parse(spec, args.kv_events_topic)
        except ValueError as exc:
            parser.error(str(exc))
    if args.kv_block_size is not None and args.kv_block_size <= 0:
        parser.error("--kv-block-size must be positive")
    if len(args.prefill_pool) > len(args.prefill):
        parser.error("more --prefill-pool than --prefill instances")
    pools = {url: name.strip() for url, name in zip(args.prefill, args.prefill_pool,
                                                     strict=False)
             if name.strip() not in ("", "-")}
    if args.pool_max_blocks <= 0:
        parser.error("--pool-max-blocks must be positive")
    if args.kv_index_max_blocks <= 0:
        parser.error("--kv-index-max-blocks must be positive")
    return KvAwareSettings(hash_algo=args.kv_hash_algo, hash_seed=args.kv_hash_seed,
                           block_size=args.kv_block_size, load_weight=args.kv_load_weight,
                           topic=args.kv_events_topic, events=events,
                           pool_shared=args.pool_shared, pools=pools,
                           pool_medium=args.pool_medium, pool_max_blocks=args.pool_max_blocks,
                           index_max_blocks=args.kv_index_max_blocks)


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
    if args.print_admin_token:
        from vllm_ascend.distributed.kv_transfer.core import auth

        from .routes import PURPOSE_ADMIN

        authn = auth.from_env()
        if authn is None:
            parser.error("no deployment key set (VLLM_ASCEND_KV_AUTH_KEY or "
                         "VLLM_ASCEND_KV_AUTH_KEY_FILE)")
        print(authn.bearer_token(PURPOSE_ADMIN))
        return 0
    if not args.prefill or not args.decode:
        parser.error("the following arguments are required: --prefill, --decode")
    follows_events = policy_class(args.policy).follows_kv_events
    if args.prefill_events and not follows_events:
        parser.error("--prefill-events is for --policy kv_aware")
    if (args.pool_shared or args.prefill_pool) and not follows_events:
        parser.error("--pool-shared and --prefill-pool are for --policy kv_aware")
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        parser.error("--ssl-certfile and --ssl-keyfile go together")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    cfg = ProxyConfig(prefill=args.prefill, decode=args.decode, policy=args.policy,
                      timeout_s=args.timeout, health_interval_s=args.health_interval,
                      lease_renew_interval_s=args.lease_renew_interval,
                      kv_error_fallback=args.kv_error_fallback,
                      kv=kv_settings(parser, args) if follows_events else None,
                      mode=args.mode,
                      metaserver_url=metaserver_url(args) if args.mode == "layerwise" else None)
    uvicorn.run(build_app(cfg), host=args.host, port=args.port, log_level=args.log_level,
                ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
