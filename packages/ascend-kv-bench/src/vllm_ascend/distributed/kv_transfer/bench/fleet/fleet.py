# SPDX-License-Identifier: Apache-2.0
"""A fleet of simulated instances in one process, and its control endpoint.

``python -m vllm_ascend.distributed.kv_transfer.bench.fleet.fleet --prefill 8 --decode 8``
starts the instances (one listening port each on 127.0.0.1, each P with its KV events PUB
and replay sockets), prints one JSON line (the control URL and every instance) and serves
until killed. The driver runs it as a child, so its own client does not share the fleet's
event loop. Control (JSON):

* ``GET /fleet``: every instance (name, role, url, events, state);
* ``POST /fleet/reset``: every cache emptied (``AllBlocksCleared`` published), counters 0;
* ``POST /fleet/add`` ``{"role": "prefill"}``: a new instance, started, as listed;
* ``POST /fleet/drain`` ``{"name": ...}``: ``/health`` answers 503, requests still served;
* ``POST /fleet/kill`` ``{"name": ...}``: dead (connections reset, events stop);
* ``GET /fleet/stats``: each instance's counters, first and last request time, death time
  and the requests after it (health probes counted apart) (``time.monotonic`` of this host).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import zmq.asyncio

from .events import Publisher
from .http import Request, Response, Server
from .instance import BLOCK_SIZE, BlockHashes, SimInstance
from .model import CostModel

#: Blocks a simulated instance caches by default (131,072 tokens of 16).
CAPACITY = 8192


class Fleet:
    """The instances and their control server.

    Args:
        cost: the cost model.
        capacity: blocks each instance's prefix cache holds.
        events: whether P instances publish KV events.
    """

    def __init__(self, cost: CostModel, capacity: int = CAPACITY, events: bool = True,
                 block_size: int = BLOCK_SIZE) -> None:
        self.cost = cost
        self.capacity = capacity
        self.events = events
        self.block_size = block_size
        self.hashes = BlockHashes()
        self.ctx = zmq.asyncio.Context()
        self.instances: dict[str, SimInstance] = {}
        self.roles: dict[str, str] = {}
        self.control = Server(self.handle)

    async def add(self, role: str) -> SimInstance:
        """A new instance of ``role`` (``prefill`` publishes KV events), started."""
        name = f"{role[0]}{sum(1 for r in self.roles.values() if r == role)}"
        pub = Publisher(self.ctx) if self.events and role == "prefill" else None
        inst = await SimInstance(name, self.cost, self.hashes, pub, self.capacity,
                                 self.block_size).start()
        self.instances[name] = inst
        self.roles[name] = role
        return inst

    def describe(self, name: str) -> dict[str, Any]:
        inst = self.instances[name]
        pub = inst.publisher
        return {"name": name, "role": self.roles[name], "url": inst.url, "state": inst.state,
                "events": pub.endpoint if pub else None,
                "replay": pub.replay_endpoint if pub else None}

    async def start(self, n_prefill: int, n_decode: int) -> Fleet:
        for _ in range(n_prefill):
            await self.add("prefill")
        for _ in range(n_decode):
            await self.add("decode")
        await self.control.start()
        return self

    async def stop(self) -> None:
        await self.control.close()
        for inst in self.instances.values():
            await inst.close()
        self.ctx.destroy(linger=0)

    def stats(self) -> dict[str, Any]:
        return {name: {**self.describe(name), **inst.counts,
                       "first_request": inst.first_request, "last_request": inst.last_request,
                       "died": inst.died, "attempts_after_death": inst.attempts_after_death,
                       "probes_after_death": len(inst.probes_after_death),
                       "running": inst.running, "cached_blocks": len(inst.cache)}
                for name, inst in self.instances.items()}

    async def handle(self, req: Request) -> Response:
        if req.method == "GET" and req.path == "/fleet":
            return Response.of_json([self.describe(n) for n in self.instances])
        if req.method == "GET" and req.path == "/fleet/stats":
            return Response.of_json(self.stats())
        if req.method == "POST" and req.path == "/fleet/reset":
            for inst in self.instances.values():
                inst.reset()
            return Response.of_json({"reset": len(self.instances)})
        if req.method == "POST" and req.path == "/fleet/add":
            inst = await self.add(str(req.json().get("role", "prefill")))
            return Response.of_json(self.describe(inst.name))
        if req.method == "POST" and req.path in ("/fleet/drain", "/fleet/kill"):
            name = str(req.json()["name"])
            if name not in self.instances:
                return Response.of_json({"error": f"no instance {name}"}, 404)
            if req.path.endswith("drain"):
                self.instances[name].state = "draining"
            else:
                await self.instances[name].kill()
            return Response.of_json(self.describe(name))
        return Response.of_json({"error": f"no route {req.path}"}, 404)


async def serve(args: argparse.Namespace) -> None:
    cost = CostModel.load(Path(args.cost_model) if args.cost_model else None, args.time_scale)
    fleet = await Fleet(cost, args.capacity, not args.no_events).start(args.prefill,
                                                                        args.decode)
    print(json.dumps({"control": fleet.control.url,
                      "instances": [fleet.describe(n) for n in fleet.instances]}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await fleet.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ...bench.fleet.fleet", description=__doc__)
    p.add_argument("--prefill", type=int, required=True, help="P instances")
    p.add_argument("--decode", type=int, required=True, help="D instances")
    p.add_argument("--capacity", type=int, default=CAPACITY, help="blocks a prefix cache")
    p.add_argument("--time-scale", type=float, default=1.0, help="modelled times times this")
    p.add_argument("--cost-model", default=None, help="a fit of costfit (default: committed)")
    p.add_argument("--no-events", action="store_true", help="no KV events")
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
