# SPDX-License-Identifier: Apache-2.0
"""A pipeline-parallel P on a real vLLM CPU engine: ``pipeline_parallel_size=2`` (two worker
processes, one per stage, on gloo) with an uneven layer split (1 + 3 of 4 layers, vLLM's
``VLLM_PP_LAYER_PARTITION`` and the connector's ``prefill.pp_layer_partition``), under
``MooncakeConnectorV1``.

What runs here: the engine starts with the connector on both stages; vLLM hands the
scheduler every stage's handshake metadata keyed by (pp rank, tp rank), which its base
class refuses above stage 0 (the connector takes it: ``set_xfer_handshake_metadata_pp_aware``);
each stage registers only its own layers and answers ``GetMeta`` on its own side channel
(``base + pp_rank * tp_size + tp_rank``) with the stage's place in the model, as D reads it.

What does not: vLLM CPU 0.32 does not generate at ``pipeline_parallel_size=2`` on this
machine, with or without a connector: a plain engine fails its first step with ``KeyError``
in ``Scheduler.update_from_output`` (``req_id_to_index`` of the batch queue's output; the
multiprocess engine core) or spins without an output (in-process). So P cannot prefill
here, and D's pull from a PP P (each layer from the stage that holds it, every stage
released) is tested at worker level with a real Mooncake engine per stage
(``packages/ascend-kv-p2p/tests/test_p2p_pipeline_parallel.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import kv_config
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import (
    CODEC,
    AgentMeta,
    GetMeta,
    worker_port,
)

KB = "ascend_kv_testing.kv_bytes"
LAYERS = 4
PARTITION = [1, 3]
NOBIND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@pytest.fixture(scope="module")
def p(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, int]]:
    model = make_tiny_llama(tmp_path_factory.mktemp("pp-model"), num_hidden_layers=LAYERS)
    kv = kv_config("kv_producer", "pp2-prefill",
                   prefill={"pp_size": 2, "pp_layer_partition": PARTITION})
    engine = EngineProcess(model, kv, pipeline_parallel_size=2,
                           distributed_executor_backend="mp", startup_timeout=600,
                           env={**NOBIND,
                                "VLLM_PP_LAYER_PARTITION": ",".join(map(str, PARTITION))})
    try:
        yield engine, int(kv["kv_port"])
    finally:
        engine.close()


def test_each_stage_registers_its_own_layers(p: Any) -> None:
    engine, _port = p
    stages = [r["layers"] for r in engine.call(f"{KB}:block_digests", block_ids=[0])]
    assert [len(s) for s in stages] == PARTITION
    assert all(".layers.0." in name for name in stages[0])
    assert not any(".layers.0." in name for name in stages[1])


def test_each_stage_answers_getmeta_with_its_place_in_the_model(p: Any) -> None:
    _engine, port = p
    first = 0
    for pp_rank, n_layers in enumerate(PARTITION):
        endpoint = tcp_endpoint("127.0.0.1", worker_port(port, tp_rank=0, tp_size=1,
                                                         pp_rank=pp_rank))
        client: RpcClient[Any] = RpcClient(endpoint, CODEC, timeout_s=10.0)
        try:
            meta = client.call(GetMeta(requester="test"))
        finally:
            client.close()
        assert isinstance(meta, AgentMeta), meta
        assert (meta.pp_rank, meta.pp_size, meta.first_layer, meta.total_num_layers) == (
            pp_rank, 2, first, LAYERS)
        assert meta.layout.num_layers == n_layers
        assert meta.engine_id == "pp2-prefill" and meta.tp_size == 1
        first += n_layers
