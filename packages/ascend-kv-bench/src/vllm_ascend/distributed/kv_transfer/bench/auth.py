# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench auth``: what the deployment key costs the control plane.

Round trips of one request and its reply between core's :class:`~.channel.RpcClient` and
:class:`~.channel.RpcServer` on loopback TCP (the path of every side-channel, lookup and
metadata message), without a key and with one (``core.auth``: every frame sealed, opened,
its nonce put in the replay cache), in the same run; and the envelope alone (seal + open of
one frame, no socket). The ratio keyed / unkeyed messages per second is the figure to quote.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.auth import Authenticator
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, RpcServer
from vllm_ascend.distributed.kv_transfer.core.wire import Codec, ErrorReply, Message

from .benchutil import add_common_args, format_table, ratio, write_results

#: A bench-only key (never a deployment's).
BENCH_KEY = b"vllm-ascend-kv-bench-auth-key-0123456789"


class Request(Message):
    """A claim-sized request (ids and a token, as the pull connector's ``Claim``)."""

    request_id: str
    block_ids: list[int]
    token: str


class Reply(Message):
    """A grant-sized reply."""

    lease_s: float
    addrs: list[int]


CODEC: Codec[Message] = Codec([Request, Reply])


def _handler(msg: Any) -> Message:
    if isinstance(msg, Request):
        return Reply(lease_s=30.0, addrs=[0x7F00_0000_0000 + i for i in range(4)])
    return ErrorReply(code="unsupported", message=type(msg).__name__)


def _request() -> Request:
    return Request(request_id="cmpl-0123456789abcdef-0", block_ids=list(range(16)),
                   token="x" * 32)


def round_trips(auth: Authenticator | None, seconds: float, repeats: int) -> dict[str, Any]:
    """Best messages per second over ``repeats`` samples of ``seconds``, and latencies."""
    server = RpcServer("tcp://127.0.0.1:0", CODEC, _handler, name="bench-auth",
                       auth=auth, poll_interval_ms=10).start()
    client = RpcClient(server.endpoint, CODEC, timeout_s=10.0, auth=auth)
    msg = _request()
    lat: list[float] = []
    best = 0.0
    try:
        for _ in range(20):  # warm up the connection
            client.call(msg)
        for _ in range(repeats):
            n = 0
            start = time.perf_counter()
            while True:
                t0 = time.perf_counter()
                client.call(msg)
                lat.append(time.perf_counter() - t0)
                n += 1
                elapsed = time.perf_counter() - start
                if elapsed >= seconds:
                    break
            best = max(best, n / elapsed)
    finally:
        client.close()
        server.stop()
    lat.sort()
    return {"msgs_per_s": best, "p50_us": statistics.median(lat) * 1e6,
            "p99_us": lat[int(0.99 * (len(lat) - 1))] * 1e6, "samples": len(lat)}


def envelope_us(iterations: int) -> float:
    """Microseconds to seal and open one request frame (the key's CPU cost, no socket)."""
    auth = Authenticator([BENCH_KEY])
    frame = CODEC.encode(_request())
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iterations):
            sealed, _nonce = auth.seal(frame)
            auth.open(sealed)
        best = min(best, (time.perf_counter() - start) / iterations)
    return best * 1e6


def run(args: argparse.Namespace) -> int:
    """Run ``bench auth``; print the table and write ``auth.json``."""
    seconds = args.seconds if args.seconds is not None else (0.3 if args.quick else 2.0)
    repeats = 2 if args.quick else 3
    rows = []
    for mode, auth in (("no key", None), ("key", Authenticator([BENCH_KEY]))):
        rows.append({"mode": mode, **round_trips(auth, seconds, repeats)})
    plain, keyed = rows
    env_us = envelope_us(2000 if args.quick else 20000)
    payload = {
        "description": "control-plane round trips (a claim-sized request, a grant-sized "
                       "reply) between RpcClient and RpcServer on loopback TCP, without and "
                       "with the deployment key",
        "config": {"seconds": seconds, "repeats": repeats, "transport": "tcp 127.0.0.1"},
        "results": rows,
        "ratio": ratio(keyed["msgs_per_s"], plain["msgs_per_s"]),
        "added_p50_us": keyed["p50_us"] - plain["p50_us"],
        "envelope_us": env_us,
    }
    print(format_table(rows, ["mode", "msgs_per_s", "p50_us", "p99_us", "samples"]))
    print(f"\nkeyed / unkeyed messages per second: {payload['ratio']:.3f}; "
          f"p50 +{payload['added_p50_us']:.1f} us; seal + open of one frame: {env_us:.1f} us")
    path = write_results("auth", payload, args.out, args=args)
    print(f"results: {path}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Register ``vllm-ascend-kv bench auth``."""
    p = subparsers.add_parser(
        "auth", help="control-plane messages per second with and without the deployment key")
    add_common_args(p)
    p.add_argument("--seconds", type=float, default=None,
                   help="seconds per sample (default 2, quick 0.3)")
    p.set_defaults(func=run)
