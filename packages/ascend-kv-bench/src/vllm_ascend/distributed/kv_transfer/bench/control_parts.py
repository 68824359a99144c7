# SPDX-License-Identifier: Apache-2.0
"""``bench control``'s measures beside the steps: P's lease holder, a request's params.

Beside the scheduler's steps (:mod:`.control`): P's lease holder through its side-channel
handler, and what one request's params cost, part by part, where P issues them and where D
checks them."""

from __future__ import annotations

import itertools
import os
import statistics
import time
import types
from collections import deque
from collections.abc import Callable
from typing import Any

from .benchutil import environ

# ---------------------------------------------------------------------- a request's params
#: What P's ``request_finished`` does for each request it holds for D (beside the hook's own
#: bookkeeping), and what D's scheduler checks of the params it gets, each timed apart.
PARTS = {"P": ("capability token", "read window tag", "params", "params MAC"),
         "D": ("params MAC check", "params parse", "read window check")}
#: Without a deployment key (protected mode) and with one.
KEY_MODES = ("no key", "key")
#: Calls a part is timed over in a round (full run, --quick).
PART_CALLS, QUICK_PART_CALLS = 2000, 200


def measure_parts(*, rounds: int, calls: int, prompt_tokens: int, block_size: int
                  ) -> dict[tuple[str, str, str], list[float]]:
    """Each part of one request's params (:data:`PARTS`), on P where they are issued and
    on D where they are checked, timed apart with the functions the schedulers call, as
    they call them (the process's authenticator looked up once, as a scheduler does when
    it is built, from a key in the environment): per (key mode, side,
    part), each round's mean µs a call over ``calls`` calls, the parts in turns (reversed
    every other round), without a deployment key and with one (set in this process's
    environment for its turns only); the modes in turns as well."""
    import uuid

    from vllm_ascend.distributed.kv_transfer.core import auth
    from vllm_ascend.distributed.kv_transfer.kv_p2p.params import (
        params_for_decode,
        parse_remote_prefill,
    )
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import stamp, window_end
    from vllm_ascend.distributed.kv_transfer.kv_p2p.signed_params import (
        FROM_ENV,
        resolve,
        sign,
        verify,
    )

    blocks = list(range(-(-prompt_tokens // block_size)))
    rid, instance = f"cmpl-{uuid.uuid4().hex}-0", f"control-p/{uuid.uuid4().hex}"
    keys = {"no key": None, "key": uuid.uuid4().hex + uuid.uuid4().hex}

    def use(mode: str) -> None:
        if keys[mode] is None:
            os.environ.pop(auth.ENV_KEY, None)
        else:
            os.environ[auth.ENV_KEY] = str(keys[mode])

    def parts_of(mode: str) -> dict[tuple[str, str], Callable[[], Any]]:
        """The calls of one request's params, on params issued under ``mode``'s key."""
        use(mode)
        a = resolve(FROM_ENV)  # the scheduler's, looked up once when it is built
        assert (a is None) == (mode == "no key")
        token = auth.capability_token()
        window = stamp(instance=instance, request_id=rid, block_ids=blocks, token=token,
                       hold_s=5.0, authn=a)

        def issue() -> dict[str, Any]:
            return params_for_decode(
                block_ids=blocks, engine_id="control-p", host="127.0.0.1", port=5600,
                request_id=rid, tp_size=1, last_token_id=7, num_prompt_blocks=len(blocks),
                claim_token=token, window=window)

        signed = sign(issue(), ttl_s=600.0, authn=a)
        remote = parse_remote_prefill(signed, prompt_len=prompt_tokens, block_size=block_size)
        assert window_end(remote, a) > 0, "the read window's tag did not check"
        verify(signed, authn=a)  # raises if the MAC does not check
        return {
            ("P", "capability token"): auth.capability_token,
            ("P", "read window tag"): lambda: stamp(
                instance=instance, request_id=rid, block_ids=blocks, token=token, hold_s=5.0,
                authn=a),
            ("P", "params"): issue,
            ("P", "params MAC"): lambda: sign(signed, ttl_s=600.0, authn=a),
            ("D", "params MAC check"): lambda: verify(signed, authn=a),
            ("D", "params parse"): lambda: parse_remote_prefill(
                signed, prompt_len=prompt_tokens, block_size=block_size),
            ("D", "read window check"): lambda: window_end(remote, a),
        }

    out: dict[tuple[str, str, str], list[float]] = {}
    with environ({auth.ENV_KEY: None, auth.ENV_KEY_FILE: None}):
        fns = {mode: parts_of(mode) for mode in KEY_MODES}
        for r in range(rounds):
            modes = KEY_MODES if r % 2 == 0 else KEY_MODES[::-1]
            for mode in modes:
                use(mode)
                order = list(fns[mode]) if r % 2 == 0 else list(reversed(fns[mode]))
                for side, part in order:
                    fn = fns[mode][(side, part)]
                    t0 = time.perf_counter_ns()
                    for _ in range(calls):
                        fn()
                    us = (time.perf_counter_ns() - t0) / 1e3 / calls
                    out.setdefault((mode, side, part), []).append(us)
    return out


# ---------------------------------------------------------------------- P's holder
def measure_holder(n: int, *, batch: int, rounds: int, prompt_blocks: int) -> dict[str, Any]:
    """P's :class:`LeaseHolder` with ``n`` held: per round, claims, Dones and lease sweeps
    per second (each over ``batch`` requests, the held count kept at ``n``)."""
    from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
    from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
    from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
    from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import Claim, Done
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import SendMeta
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.holder import LeaseHolder

    cfg = MooncakeP2PConfig.from_dict({"lease_ttl_s": 600.0, "max_hold_s": 1200.0,
                                       "read_window_s": 0.0}, source="bench control")
    shared: Any = types.SimpleNamespace(cfg=cfg, recorder=MetricsRecorder(P2P_METRICS))
    holder = LeaseHolder(shared)
    ids = itertools.count()
    live: deque[tuple[str, str]] = deque()

    def hold(count: int) -> None:
        metas = []
        for _ in range(count):
            rid, token = f"held-{next(ids)}", f"tok-{len(live)}"
            metas.append(SendMeta(rid, list(range(prompt_blocks)), token))
            live.append((rid, token))
        holder.hold(metas)

    hold(n)
    holder.collect_finished()
    rates: dict[str, list[float]] = {"claims_per_s": [], "dones_per_s": [],
                                     "sweeps_per_s": [], "idle_sweeps_per_s": [],
                                     "holds_per_s": []}
    half = list(range(prompt_blocks // 2, prompt_blocks))
    for _ in range(rounds):
        t_claim = t_done = t_sweep = t_hold = 0.0
        count = 0
        while count < 16 * batch:
            victims = [live.popleft() for _ in range(batch)]
            t0 = time.perf_counter()
            for rid, token in victims:
                claimed = holder.handle(Claim(request_id=rid, block_ids=half, reader="d",
                                            num_readers=1, token=token))
            t1 = time.perf_counter()
            for rid, token in victims:
                released = holder.handle(Done(request_id=rid, reader="d", token=token))
            t2 = time.perf_counter()
            freed = holder.collect_finished()
            t3 = time.perf_counter()
            hold(batch)
            t4 = time.perf_counter()
            assert len(freed) == batch, (claimed, released, len(freed))
            t_claim, t_done = t_claim + t1 - t0, t_done + t2 - t1
            t_sweep, t_hold = t_sweep + t3 - t2, t_hold + t4 - t3
            count += batch
        rates["claims_per_s"].append(count / t_claim)
        rates["dones_per_s"].append(count / t_done)
        rates["sweeps_per_s"].append(count / batch / t_sweep)
        rates["holds_per_s"].append(count / t_hold)
        # sweeps with nothing due, the table full (vLLM's get_finished of a quiet step)
        t0 = time.perf_counter()
        for _ in range(200):
            holder.collect_finished()
        rates["idle_sweeps_per_s"].append(200 / (time.perf_counter() - t0))
    assert len(holder.held) == n
    return {"held": n, "batch": batch, "rounds": rates,
            **{k: statistics.median(v) for k, v in rates.items()}}
