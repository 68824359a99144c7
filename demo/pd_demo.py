#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The P/D demo: prefill and decode on two vLLM servers, KV moved by MooncakeConnectorV1.

What it does, on a CPU machine with nothing downloaded:

1. builds a tiny random-weight Llama and a small tokenizer trained locally;
2. starts one plain ``vllm serve`` and records its greedy completions of a batch of
   text prompts (less than one block, exactly one block, one block + 1, several
   blocks, not a multiple of the block size);
3. starts a prefill (``kv_producer``) and a decode (``kv_consumer``) ``vllm serve``
   with ``MooncakeConnectorV1`` over TCP, and ``vllm-ascend-pd-proxy`` in front;
4. sends the same prompts through the proxy (some at once) and checks that every
   completion equals the single instance's, token for token;
5. prints a report (requests, prompt tokens, KV bytes moved, transfer throughput,
   time to first token through P/D) and exits non-zero on any mismatch.

Every process it starts is stopped, whatever happens.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
MAX_TOKENS = 16
HOST = "127.0.0.1"

ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": HOST,
    "VLLM_ASCEND_KV_HOST": HOST,
    "MC_TCP_BIND_ADDRESS": HOST,
    "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": HOST,
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}

SENTENCES = [
    "KV cache transfer moves attention keys and values between instances.",
    "Prefill computes the prompt; decode generates one token at a time.",
    "A pool keeps prefix blocks so that a repeated prompt skips its prefill.",
    "The quick brown fox jumps over the lazy dog, again and again, in many sentences.",
    "Ascend NPUs, CUDA GPUs and CPUs all run the same connector code behind a device layer.",
]


def log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    from vllm_ascend.distributed.kv_transfer.core.net import free_port as core_free_port

    return core_free_port(HOST)


def build_model(workdir: Path) -> Path:
    """Tokenizer first, then a model whose vocabulary is exactly the tokenizer's."""
    from ascend_kv_testing.models import make_served_llama

    return make_served_llama(workdir / "tiny-llama")[0]


def make_prompts(model_dir: Path) -> list[str]:
    """Texts whose token counts hit the interesting cases around the block size."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = " ".join(SENTENCES * 40)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    targets = [7, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, BLOCK_SIZE + 2, 3 * BLOCK_SIZE + 5,
               5 * BLOCK_SIZE, 9 * BLOCK_SIZE + 17]
    prompts = []
    for i, n in enumerate(targets):
        start = (i * 37) % (len(ids) - n)
        prompts.append(tok.decode(ids[start:start + n]))
    return prompts


class Server:
    """A child process with its output in a log file."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, port: int) -> None:
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> Server:
        env = {**os.environ, **ENV}
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log_path, "wb"),  # noqa: SIM115
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; last log "
                                   f"lines:\n{tail(self.log_path)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout}s:\n{tail(self.log_path)}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(20)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def vllm_serve(name: str, model: Path, port: int, logs: Path,
               kv: dict[str, Any] | None = None) -> Server:
    # `python -m vllm.entrypoints.openai.api_server` is what `vllm serve` runs; the `vllm`
    # command of vllm-cpu looks up the distribution "vllm" for --version and fails.
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", HOST, "--port", str(port), "--dtype", "float32",
           "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048", "--enforce-eager",
           "--seed", "0", "--max-num-seqs", "8", "--served-model-name", "tiny-llama"]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    return Server(name, cmd, logs / f"{name}.log", port)


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def completion_body(prompt: str, stream: bool = False) -> dict[str, Any]:
    return {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": stream,
            "return_token_ids": True}


def complete(base: str, prompt: str) -> dict[str, Any]:
    out = post(base + "/v1/completions", completion_body(prompt))
    choice = out["choices"][0]
    return {"text": choice["text"], "token_ids": choice.get("token_ids"),
            "prompt_tokens": out["usage"]["prompt_tokens"]}


def ttft_stream(base: str, prompt: str) -> float:
    """Seconds from sending a streaming request to its first token."""
    req = urllib.request.Request(base + "/v1/completions",
                                 data=json.dumps(completion_body(prompt, stream=True)).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: ") and b'"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("stream ended without a token")


def scrape(base: str, name: str) -> float:
    """Sum of a Prometheus series (all label sets) from ``base/metrics``."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the model and logs go (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pd-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    servers: list[Server] = []
    try:
        log(f"building a tiny random-weight Llama and a tokenizer in {workdir}")
        model = build_model(workdir)
        prompts = make_prompts(model)

        log("starting a single vLLM instance for the reference completions")
        single = vllm_serve("single", model, free_port(), logs).start()
        servers.append(single)
        single.wait_ready()
        reference = [complete(single.url, p) for p in prompts]
        single_ttft = min(ttft_stream(single.url, p) for p in prompts[-2:])
        single.stop()
        log(f"reference: {len(reference)} completions, prompt tokens "
            f"{[r['prompt_tokens'] for r in reference]}")

        log("starting prefill and decode instances with MooncakeConnectorV1 and the proxy")
        kv_p = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_producer",
                "kv_port": free_port(), "engine_id": "demo-prefill",
                "kv_connector_extra_config": {"prefill": {"tp_size": 1},
                                              "decode": {"tp_size": 1}}}
        kv_d = {"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_consumer",
                "kv_port": free_port(), "engine_id": "demo-decode",
                "kv_connector_extra_config": {"prefill": {"tp_size": 1},
                                              "decode": {"tp_size": 1}}}
        prefill = vllm_serve("prefill", model, free_port(), logs, kv_p).start()
        decode = vllm_serve("decode", model, free_port(), logs, kv_d).start()
        servers += [prefill, decode]
        proxy_port = free_port()
        proxy_cmd = [sys.executable, "-m", "vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.cli",
                     "--prefill", prefill.url, "--decode", decode.url, "--port",
                     str(proxy_port), "--log-level", "warning"]
        proxy = Server("proxy", proxy_cmd, logs / "proxy.log", proxy_port).start()
        servers.append(proxy)
        prefill.wait_ready()
        decode.wait_ready()
        proxy.wait_ready()

        log(f"sending {len(prompts)} prompts through the proxy (4 at a time)")
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: complete(proxy.url, p), prompts))
        wall = time.perf_counter() - start
        pd_ttft = min(ttft_stream(proxy.url, p) for p in prompts[-2:])

        mismatches = 0
        for i, (ref, got) in enumerate(zip(reference, results, strict=True)):
            same = (ref["text"] == got["text"]
                    and (ref["token_ids"] is None or ref["token_ids"] == got["token_ids"]))
            if not same:
                mismatches += 1
                log(f"MISMATCH prompt {i} ({ref['prompt_tokens']} tokens): single instance "
                    f"{ref['token_ids'] or ref['text']!r} != P/D {got['token_ids'] or got['text']!r}")

        moved = scrape(decode.url, "vllm:ascend_kv_p2p_transfer_bytes_total")
        seconds = scrape(decode.url, "vllm:ascend_kv_p2p_transfer_seconds_sum")
        loaded = scrape(decode.url, "vllm:ascend_kv_p2p_requests_loaded_total")
        failures = scrape(decode.url, "vllm:ascend_kv_p2p_failures_total")
        served = scrape(prefill.url, "vllm:ascend_kv_p2p_requests_served_total")
        tokens = sum(r["prompt_tokens"] for r in reference)
        report = {
            "requests": len(prompts),
            "identical_to_single_instance": len(prompts) - mismatches,
            "prompt_tokens": tokens,
            "prompt_lengths": [r["prompt_tokens"] for r in reference],
            "kv_requests_loaded_by_decode": int(loaded),
            "kv_requests_served_by_prefill": int(served),
            "kv_load_failures": int(failures),
            "kv_bytes_moved": int(moved),
            "kv_transfer_seconds": round(seconds, 4),
            "kv_transfer_MiB_per_s": round(moved / seconds / 2**20, 1) if seconds else None,
            "pd_wall_seconds_for_batch": round(wall, 3),
            "ttft_single_instance_s": round(single_ttft, 3),
            "ttft_through_pd_proxy_s": round(pd_ttft, 3),
        }
        print("\nP/D demo report (MooncakeConnectorV1 over TCP, CPU, tiny random Llama)")
        width = max(map(len, report))
        for k, v in report.items():
            print(f"  {k:<{width}}  {v}")
        (workdir / "report.json").write_text(json.dumps(report, indent=2))
        ok = mismatches == 0 and failures == 0 and loaded >= len(prompts)
        if not ok:
            log("FAILED: outputs differ from the single instance or KV was not moved; logs in "
                f"{logs}")
            for s in servers:
                print(f"--- {s.name} log tail ---\n{tail(s.log_path, 15)}")
            return 1
        log("OK: every P/D completion equals the single instance's")
        return 0
    finally:
        for s in reversed(servers):
            s.stop()
        if not args.keep and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
