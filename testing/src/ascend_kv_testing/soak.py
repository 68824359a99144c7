# SPDX-License-Identifier: Apache-2.0
"""Many requests inside an engine process, some aborted by their "client" half-way.

:func:`run_requests` runs in the engine process (``EngineProcess.call``): it adds every
request to vLLM's engine, steps it, aborts each request that has an ``abort_after``
count after that many engine steps (what vLLM's API server does when a client goes
away), and reports one outcome per request: ``answered`` (with its tokens and
``kv_transfer_params``), ``failed`` (vLLM's ``finish_reason`` ``error``, with the reason)
or ``aborted``. Nothing is lost: every request id comes back exactly once.
"""

from __future__ import annotations

import time
from typing import Any


def run_requests(llm: Any, requests: list[dict[str, Any]], timeout_s: float = 600.0
                 ) -> list[dict[str, Any]]:
    """Run ``requests`` (dicts with ``id``, ``prompt``, ``max_tokens``, optional ``kv``
    params and ``abort_after`` steps) to the end; one outcome dict per request, in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    aborts: dict[int, list[str]] = {}
    for req in requests:
        extra = {"kv_transfer_params": req["kv"]} if req.get("kv") is not None else None
        params = SamplingParams(max_tokens=req["max_tokens"], temperature=0.0, ignore_eos=True,
                                detokenize=False, extra_args=extra)
        engine.add_request(req["id"], TokensPrompt(prompt_token_ids=req["prompt"]), params)
        if req.get("abort_after") is not None:
            aborts.setdefault(int(req["abort_after"]), []).append(req["id"])
    outcomes: dict[str, dict[str, Any]] = {}
    step = 0
    end = time.monotonic() + timeout_s
    while engine.has_unfinished_requests() and time.monotonic() < end:
        due = [rid for rid in aborts.pop(step, []) if rid not in outcomes]
        if due:
            engine.abort_request(due)
            for rid in due:
                outcomes[rid] = {"outcome": "aborted", "reason": f"client abort at step {step}"}
        for out in engine.step():
            if not out.finished or out.request_id in outcomes:
                continue
            reason = out.outputs[0].finish_reason if out.outputs else None
            if reason == "error":
                outcomes[out.request_id] = {"outcome": "failed",
                                            "reason": "finish_reason=error (KV load failed)"}
            else:
                outcomes[out.request_id] = {
                    "outcome": "answered", "tokens": list(out.outputs[0].token_ids),
                    "kv_transfer_params": out.kv_transfer_params,
                    "cached": out.num_cached_tokens}
        step += 1
    for req in requests:
        outcomes.setdefault(req["id"], {"outcome": "lost", "reason": "still running at the "
                                        f"{timeout_s:.0f}s timeout"})
    return [{"id": req["id"], **outcomes[req["id"]]} for req in requests]
