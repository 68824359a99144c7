# SPDX-License-Identifier: Apache-2.0
"""``bench serve``'s P/D flow: D's time to its first token with P's KV.

A P and a D engine, kept up across the rounds (:func:`pd_flow`, :func:`run_pd`).

A connector where P goes first hands :func:`pd_flow` the ``kv_transfer_params`` of each
side; one where D gets the request first (the layerwise push) hands it a
:data:`PDSample` of its own flow. Either way D's figure is its time to the first token
once P had finished, with D's device-hit floor measured right after.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..benchutil import median
from .child import EngineChild
from .scenarios import Run, binding_env, first_output, last_token_floor

#: One P/D request of :func:`pd_flow`: ``(P, D, prompt, key)`` -> P's and D's answers and
#: D's time to its first token once P had finished (seconds).
PDSample = Callable[[EngineChild, EngineChild, list[int], str],
                    tuple[dict[str, Any], dict[str, Any], float]]


def pd_flow(run: Run, p: EngineChild, d: EngineChild, name: str,
            params: Callable[[str], tuple[dict[str, Any], Callable[[dict[str, Any] | None],
                                                                 dict[str, Any]]]] | None,
            *, sample: PDSample | None = None, fresh_p: bool = False) -> dict[str, Any]:
    """P prefills each prompt (max_tokens=1) and holds it; D's TTFT with P's KV is timed.

    Each prompt is sent ``repeats`` times (P's own prefix cache makes the repeats
    cheap on P; D's cache is reset after every request, so D always transfers);
    the median D TTFT is kept. Right after each, the same prompt again on D (now in
    D's own device cache: vLLM computes only the last token, :func:`last_token_floor`)
    is D's floor, and
    vLLM's count of external tokens says whether D loaded P's KV at all.
    ``params(key)`` gives P's ``kv_transfer_params`` and a function turning P's
    output params into D's: P first, then D, whose TTFT is the figure. A connector whose
    D gets the request first passes ``sample`` instead (one request of its own flow, and
    D's time to its first token after P finished). ``pd_total_s``: from the first
    request sent to D's first token (what a client behind a proxy waits, less the proxy).
    ``fresh_p``: P's prefix cache is reset before each of its requests, so P computes the
    prompt every time (else the repeats hit P's own cache). Each row keeps how many tokens
    P's requests found cached (``p_cached_samples``): a P prefill or a whole request is
    compared only where P computed the prompt (``compare.PD_REQUEST``).
    """
    def pull_sample(p: EngineChild, d: EngineChild, prompt: list[int], key: str
                    ) -> tuple[dict[str, Any], dict[str, Any], float]:
        assert params is not None
        p_in, to_d = params(key)
        if fresh_p:  # after the last request's blocks were freed (the call settles first)
            p.call("reset_prefix_cache")
        pout = p.generate([prompt], kv_params=[p_in])
        d_in = to_d(first_output(pout)["kv_transfer_params"])
        dout = d.generate([prompt], kv_params=[d_in])
        dout["pd_total_s"] = pout["seconds"] + dout["seconds"]
        return pout, dout, dout["seconds"]

    one = sample or pull_sample
    rows = []
    for i, prompt in enumerate([run.warmup, *run.pd_prompts]):
        samples, floors, external, waits, d_after_p = [], [], [], [], []
        for r in range(1 if i == 0 else run.cfg.repeats):
            pout, dout, after = one(p, d, prompt, f"{run.binding or '-'}-{run.round}-{i}-{r}")
            d_after_p.append(after)
            external.append(dout.get("external_tokens"))
            waits.append((dout.get("kv_wait_s") or [None])[0])
            floors.append(last_token_floor(d, prompt, run.cfg.block_size))
            d.call("reset_prefix_cache")
            samples.append((pout, dout))
        if i == 0:
            continue  # warm-up: connections, bootstrap queries
        outs = [first_output(dout) for _p, dout in samples]
        bad = [o for o in outs if o["finish_reason"] not in ("length", "stop")]
        d_ttft = median(d_after_p)
        known = [e for e in external if isinstance(e, int)]
        rows.append({"tokens": len(prompt), "prefill_s": samples[0][0]["seconds"],
                     "prefill_samples": [x[0]["seconds"] for x in samples],
                     "pd_total_s": median(x[1].get("pd_total_s") for x in samples),
                     "pd_total_samples": [x[1].get("pd_total_s") for x in samples],
                     # tokens P's request found in its own cache (0: P computed the prompt)
                     "p_cached_samples": [first_output(x[0]).get("cached") for x in samples],
                     "d_ttft_s": d_ttft, "d_samples": d_after_p,
                     "d_floor_s": median(floors), "d_floor_samples": floors,
                     # D's wait for the KV: first scheduled - added (None: not tracked)
                     "d_kv_wait_s": median(waits),
                     "d_kv_wait_samples": waits,
                     "d_external": min(known) if known else None,
                     "d_cached": outs[-1]["cached"],
                     "d_token": (outs[-1]["tokens"] or [None])[0],
                     "d_tokens_all": [(o["tokens"] or [None])[0] for o in outs],
                     "finish": bad[0]["finish_reason"] if bad else outs[-1]["finish_reason"]})
        run.steps.note(f"{name}: {len(prompt)} tokens: P {samples[0][0]['seconds']:.3f}s, "
                       f"D TTFT {d_ttft:.3f}s, floor {rows[-1]['d_floor_s']:.3f}s (median of "
                       f"{len(samples)}; {rows[-1]['d_external']} external tokens; "
                       f"{rows[-1]['finish']})")
    return {"prompts": rows}


def run_pd(run: Run, name: str, p_kv: dict[str, Any], d_kv: dict[str, Any],
           params: Callable[..., Any] | None, *, p_env: dict[str, str] | None = None,
           d_env: dict[str, str] | None = None, python: str | None = None,
           pre_import: list[str] | None = None,
           sample: PDSample | None = None, fresh_p: bool = False) -> dict[str, Any]:
    """P and D under the run's thread binding (:func:`binding_env`), through
    :func:`pd_flow` (``params`` or ``sample``, ``fresh_p``); both kept up for the next
    rounds of the same binding."""
    binding = run.binding if run.binding is not None else (
        f"bind={run.cfg.pd_threads_bind}" if run.cfg.pd_threads_bind else None)
    p_bind, d_bind = binding_env(binding)
    key = f"{name}[{binding}]" if binding else name
    tag = f"{name}-{binding.replace('=', '')}" if binding else name

    def start() -> list[EngineChild]:
        # side by side: a pinned binding puts P and D on cores of their own, so the pair is
        # up in about the slower one's start (20-50 s each here), not in both one after the
        # other; neither needs the other until the first request
        with ThreadPoolExecutor(max_workers=2) as pool:
            started = [pool.submit(run.engine, f"{tag}-{role}", kv, env=env, python=python,
                                   pre_import=pre_import)
                       for role, kv, env in (("prefill", p_kv, {**p_bind, **(p_env or {})}),
                                             ("decode", d_kv, {**d_bind, **(d_env or {})}))]
        up = [f.result() for f in started if f.exception() is None]
        failed = [exc for f in started if (exc := f.exception()) is not None]
        if failed:
            for eng in reversed(up):
                eng.close()
            raise failed[0]
        return up

    p, d = run.kept(key, start, pause_others=True)
    try:
        return pd_flow(run, p, d, name, params, sample=sample, fresh_p=fresh_p)
    except BaseException:
        run.drop(key)
        raise


def require_params(p_out: dict[str, Any] | None) -> dict[str, Any]:
    """P's ``kv_transfer_params`` for D (a P/D flow's usual hand-over).

    Raises:
        RuntimeError: P returned none.
    """
    if not isinstance(p_out, dict) or not p_out.get("do_remote_prefill"):
        raise RuntimeError(f"P returned no kv_transfer_params for D: {p_out!r}")
    return p_out
