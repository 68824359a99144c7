# SPDX-License-Identifier: Apache-2.0
"""Functions run inside an engine process (``EngineProcess.call``) to look at its state.

Each takes the ``vllm.LLM`` as first argument and returns plain data.
"""

from __future__ import annotations

from typing import Any


def connector_totals(llm: Any) -> dict[str, float]:
    """Running totals of the worker-side connector's counters (in-process engines only)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    recorder = getattr(connector, "recorder", None)
    return recorder.totals() if recorder is not None else {}


def scheduler_state(llm: Any) -> dict[str, int]:
    """Requests the scheduler still tracks and its free KV blocks."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    return {
        "requests": len(sched.requests),
        "waiting": len(sched.waiting),
        "running": len(sched.running),
        "free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
        "total_blocks": sched.kv_cache_manager.block_pool.num_gpu_blocks,
    }


def kv_cache_groups(llm: Any) -> list[str]:
    """The engine's KV cache groups, ``"<spec class>/<sliding window or 0>"`` each (several
    when vLLM's hybrid KV cache manager is on for a hybrid model)."""
    cfg = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return [f"{type(g.kv_cache_spec).__name__}/{getattr(g.kv_cache_spec, 'sliding_window', 0) or 0}"
            for g in cfg.kv_cache_groups]


def step_for(llm: Any, seconds: float) -> dict[str, int]:
    """Keep stepping the engine for ``seconds`` (lets leases lapse), then report its state."""
    import time

    engine = llm.llm_engine
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        engine.step()
        time.sleep(0.01)
    return scheduler_state(llm)


# ---------------------------------------------------------------------- fault and soak tests
def _worker_connectors(llm: Any) -> list[Any]:
    """The worker-side connectors of the engine (a MultiConnector's children flattened)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return []
    todo, out = [get_kv_transfer_group()], []
    while todo:
        conn = todo.pop(0)
        kids = getattr(conn, "_connectors", None)
        if kids is not None:
            todo += list(kids)
        else:
            out.append(conn)
    return out


def _worker_of(conn: Any) -> Any:
    """The worker-side object of a connector (its attribute name differs per connector)."""
    for attr in ("connector_worker", "_worker"):
        worker = getattr(conn, attr, None)
        if worker is not None:
            return worker
    return None


def _listeners(llm: Any) -> dict[str, Any]:
    """This engine's connectors' servers, by role (each has an ``endpoint``)."""
    out: dict[str, Any] = {}
    for conn in _worker_connectors(llm):
        worker = _worker_of(conn)
        name = type(conn).__name__
        server = getattr(worker, "server", None)
        if name == "MooncakeConnector" and server is not None:
            out["p2p_side_channel"] = server
        elif name == "MooncakeLayerwiseConnector" and server is not None:
            out["layerwise_side_channel"] = server
        elif name == "AscendStoreConnector":
            lookup = getattr(worker, "lookup_server", None)
            if lookup is not None:
                out["pool_lookup"] = lookup
        elif name == "CPUOffloadingConnector" and server is not None:
            out["offload_metadata"] = server
    return out


def kv_endpoints(llm: Any) -> dict[str, str]:
    """Every endpoint this engine's connectors listen on, by role, and the transfer engine's
    session (``host:rpc_port``)."""
    from vllm_ascend.distributed.kv_transfer.core.transfer_engine import peek_transfer_engine

    out = {role: server.endpoint for role, server in _listeners(llm).items()}
    te = peek_transfer_engine()
    if te is not None:
        out["transfer_engine"] = te.session_id
    return out


def transfer_stats(llm: Any) -> dict[str, Any]:
    """This process's transfer engine: its protocol, the ports it opened, its counters
    (``local_reads``: reads copied from a same-host peer's memory); ``{}`` without one."""
    import dataclasses

    from vllm_ascend.distributed.kv_transfer.core.transfer_engine import peek_transfer_engine

    te = peek_transfer_engine()
    if te is None:
        return {}
    return {"protocol": te.protocol, "session": te.session_id,
            "listen_ports": sorted(te.listen_ports), **dataclasses.asdict(te.stats)}


def kv_audiences(llm: Any) -> dict[str, str]:
    """What a keyed frame to each endpoint of :func:`kv_endpoints` must be sealed for: a
    server's ``audience`` (the P/D side channels bind this instance's engine id too), else
    its socket (the pool's lookup, on this instance's own host)."""
    from vllm_ascend.distributed.kv_transfer.core.auth import audience_of

    return {role: getattr(server, "audience", None) or audience_of(server.endpoint)
            for role, server in _listeners(llm).items()}


def leak_state(llm: Any) -> dict[str, int]:
    """What must go back to zero once an engine is idle: scheduler requests and used
    blocks, blocks P holds for D, loads D waits for, pushes in flight, pending pool saves;
    and the transfer engine's registered bytes (constant while the engine lives)."""
    from vllm_ascend.distributed.kv_transfer.core.transfer_engine import peek_transfer_engine

    state = dict(scheduler_state(llm))
    # vLLM keeps one null block out of the free list
    state["used_blocks"] = state["total_blocks"] - 1 - state["free_blocks"]
    held = pending = pushes = saves = 0
    for conn in _worker_connectors(llm):
        worker = _worker_of(conn)
        if worker is None:
            continue
        # the pull worker keeps P's leases in its holder and D's loads in its load tracker
        for part in (worker, getattr(worker, "holder", None), getattr(worker, "loads", None)):
            held_table = getattr(part, "held", None)
            if held_table is not None:
                held += len(held_table)
            pending += len(getattr(part, "_pending", {}) or {}) if isinstance(
                getattr(part, "_pending", None), dict) else 0
        # the layerwise worker keeps D's waiting requests in its receiver, P's in its sender
        pending += len(getattr(getattr(worker, "receiver", None), "incoming", {}) or {})
        pushes += len(getattr(getattr(worker, "sender", None), "sessions", {}) or {})
        pool_pending = getattr(worker, "_pending", None)
        if pool_pending is not None and hasattr(pool_pending, "total"):
            saves += int(pool_pending.total())
    state.update(p2p_held=held, p2p_pending=pending, p2p_pushes=pushes, pool_pending_saves=saves)
    te = peek_transfer_engine()
    state["registered_bytes"] = te.registered_bytes if te is not None else 0
    return state


def pool_totals(llm: Any) -> dict[str, float]:
    """Running totals of the pool connector's scheduler-side and worker-side counters
    (``AscendStoreConnector``, alone or inside a MultiConnector)."""
    totals: dict[str, float] = {}
    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    for conn in [*getattr(sched, "_connectors", [sched]), *_worker_connectors(llm)]:
        if type(conn).__name__ != "AscendStoreConnector":
            continue
        for side in (getattr(conn, "connector_scheduler", None), _worker_of(conn)):
            recorder = getattr(side, "recorder", None)
            if recorder is None:
                continue
            for key, value in recorder.totals().items():
                totals[key] = totals.get(key, 0.0) + value
    return totals


def auth_refused(llm: Any) -> dict[str, float]:
    """Control-plane frames this process refused, by reason (``core.auth``'s
    ``auth_refused`` counter summed over its sockets)."""
    from vllm_ascend.distributed.kv_transfer.core import auth
    from vllm_ascend.distributed.kv_transfer.core.metrics import split_key

    out: dict[str, float] = {}
    for key, value in auth.RECORDER.totals().items():
        name, labels = split_key(key)
        if name == "auth_refused":
            reason = labels.get("reason", "")
            out[reason] = out.get(reason, 0.0) + value
    return out


def published_rank_hosts(llm: Any) -> dict[int, str] | None:
    """TP rank -> host as the workers published them to the scheduler-side connector
    (vLLM's handshake-metadata path); ``None`` if vLLM never passed them."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    conn = sched.get_kv_connector()
    inner = getattr(conn, "connector_scheduler", None)
    hosts = getattr(inner, "published_hosts", None)
    return None if hosts is None else {int(k): str(v) for k, v in hosts.items()}


def spec_decode_totals(llm: Any) -> dict[str, float]:
    """vLLM's speculative-decoding counters of this engine (``vllm:spec_decode_*``; needs
    an engine with ``disable_log_stats=False``): drafts proposed and accepted so far."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        name = getattr(metric, "name", "")
        if name.startswith("vllm:spec_decode_num_") and hasattr(metric, "value"):
            out[name.removeprefix("vllm:spec_decode_")] = float(metric.value)
    return out
