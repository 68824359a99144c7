# SPDX-License-Identifier: Apache-2.0
"""MLA with uneven TP on real vLLM CPU engines (the tiny DeepSeek-V3 of
``test_mla_e2e``, bfloat16, TP ranks as worker processes on gloo), real Mooncake over TCP.

MLA's KV is one latent a token, the same on every TP rank: nothing is split by heads.

* pull, P TP=2 to D TP=1: D reads each block from one P rank, so the bytes moved are one
  copy of the latent, not one per P rank;
* layerwise, P TP=1 to D TP=2: P writes the latent into each D rank's blocks, one copy per
  D rank (each rank has its own cache), none more.

Checked: every full block on every rank holds P's bytes, layer by layer; the bytes moved
are those copies and no more; and D's tokens equal D serving the prompt again from its own
prefix cache, which now holds the loaded blocks (``k * block + 1`` tokens: both paths
compute the last prompt token on D over the same bytes).

Unlike ``test_mla_e2e``, the tokens are not compared with a single instance: with bf16,
P's KV computed at TP=2 is not bit-identical to what a TP=1 engine computes (the partial
sums of the tensor-parallel layers are reduced in another order), and measured here D's
tokens over P's KV differ from D's own at the first or a later token. The byte checks are
what shows the transfer right; the repeat shows D decoded from exactly those bytes.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import start_in_parallel
from ascend_kv_testing.models import make_tiny_deepseek, mla_engine
from ascend_kv_testing.pd import LAYERWISE, Metaserver, kv_config, prefill, prompts_of

KB = "ascend_kv_testing.kv_bytes"
KEEP_PREFIX_CACHE = "ascend_kv_testing.mla_prefix_cache"
ENGINE = mla_engine()
BS = int(ENGINE["block_size"])
LATENT_BYTES = (512 + 64) * 2
LAYERS = 2
LENGTH = BS + 1 if BS >= 128 else 8 * BS + 1


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_deepseek(tmp_path_factory.mktemp("mla-tp-model"))


def start_pair(model: Path, p_cfg: dict[str, Any], p_tp: int, d_cfg: dict[str, Any],
               d_tp: int) -> tuple[EngineProcess, EngineProcess]:
    """P and D side by side (a TP=2 engine takes a minute on 2 cores)."""
    def engine(cfg: dict[str, Any], tp: int) -> Callable[[], EngineProcess]:
        return functools.partial(EngineProcess, model, cfg, pre_import=[KEEP_PREFIX_CACHE],
                                 tensor_parallel_size=tp, startup_timeout=600,
                                 env={"VLLM_CPU_OMP_THREADS_BIND": "nobind"}, **ENGINE)

    out = start_in_parallel({"p": engine(p_cfg, p_tp), "d": engine(d_cfg, d_tp)})
    return out["p"], out["d"]


def served_again(engine: EngineProcess, prompt: list[int], n: int = 8) -> list[int]:
    """The tokens ``engine`` gives ``prompt`` from its own prefix cache (the loaded blocks);
    the prefix cache is reset afterwards."""
    again = engine.generate([prompt], max_tokens=n)[0]
    assert again.num_cached_tokens == (len(prompt) - 1) // BS * BS, again
    assert engine.wait_idle(30) and engine.reset_prefix_cache()
    return again.token_ids


def rank_digests(engine: EngineProcess, block_ids: list[int], tp: int) -> dict[str, list[str]]:
    """Layer -> digest of each block; every rank holds the same latent bytes."""
    ranks = engine.call(f"{KB}:block_digests", block_ids=block_ids)
    assert len(ranks) == tp
    for r in ranks[1:]:
        assert r["layers"] == ranks[0]["layers"]  # MLA: the same KV on every rank
    return ranks[0]["layers"]


def moved(engine: EngineProcess) -> float:
    return sum(t.get("p2p_transfer_bytes", 0.0)
               for t in engine.call(f"{KB}:worker_connector_totals"))


@pytest.fixture(scope="class")
def pull_p2_d1(model: Path) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    tps = {"prefill": {"tp_size": 2}, "decode": {"tp_size": 1}}
    p, d = start_pair(model, kv_config("kv_producer", "mla-tp-p2", lease_ttl_s=60, **tps), 2,
                      kv_config("kv_consumer", "mla-tp-d1", **tps), 1)
    yield p, d
    d.close()
    p.close()


class TestPullPrefillWider:
    def test_mla_p_tp2_to_d_tp1_moves_one_copy(self, pull_p2_d1: Any) -> None:
        p, d = pull_p2_d1
        prompt = prompts_of([LENGTH], seed=301)[0]
        before = moved(d)
        params = prefill(p, [prompt])[0]
        assert params["remote_tp_size"] == 2
        remote = list(params["remote_block_ids"])
        p_bytes = rank_digests(p, remote, 2)
        got = d.generate([prompt], max_tokens=8, kv_params=[params])[0]
        assert got.finish_reason == "length"
        full = (LENGTH - 1) // BS
        d_blocks = d.call(f"{KB}:cached_blocks", prompt=prompt)
        assert len(d_blocks) == full
        d_bytes = rank_digests(d, d_blocks, 1)
        for layer, blocks in p_bytes.items():
            assert d_bytes[layer] == blocks[:full], layer
        # D read every block from one P rank: one copy of the latent
        assert moved(d) - before == len(remote) * BS * LATENT_BYTES * LAYERS
        assert p.wait_idle(30) and d.wait_idle(30)
        assert got.token_ids == served_again(d, prompt)


@pytest.fixture(scope="class")
def lw_p1_d2(model: Path) -> Iterator[Any]:
    tps = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 2}}
    p, d = start_pair(model, kv_config("kv_producer", "mla-tp-lw-p1", connector=LAYERWISE,
                                       **tps), 1,
                      kv_config("kv_consumer", "mla-tp-lw-d2", connector=LAYERWISE, **tps), 2)
    meta = Metaserver()
    yield SimpleNamespace(p=p, d=d, meta=meta)
    meta.close()
    d.close()
    p.close()


class TestLayerwiseDecodeWider:
    def test_mla_p_tp1_to_d_tp2_fills_each_rank_once(self, lw_p1_d2: Any) -> None:
        lw = lw_p1_d2
        prompt = prompts_of([LENGTH], seed=302)[0]
        before = moved(lw.p)
        out: dict[str, Any] = {}
        t = threading.Thread(target=lambda: out.update(d=lw.d.generate(
            [prompt], max_tokens=8, kv_params=[lw.meta.params("mla-tp-lw")])[0]))
        t.start()
        posted = lw.meta.wait(["mla-tp-lw"])
        assert posted[0]["remote_tp_size"] == 2
        lw.p.generate([prompt], max_tokens=1, kv_params=posted)
        t.join(300)
        got = out["d"]
        assert got.finish_reason == "length"
        full = (LENGTH - 1) // BS
        p_blocks = lw.p.call(f"{KB}:cached_blocks", prompt=prompt)
        d_blocks = lw.d.call(f"{KB}:cached_blocks", prompt=prompt)
        assert len(p_blocks) == len(d_blocks) == full
        assert rank_digests(lw.d, d_blocks, 2) == rank_digests(lw.p, p_blocks, 1)
        # one copy into each of D's two ranks, nothing more
        assert moved(lw.p) - before == 2 * -(-LENGTH // BS) * BS * LATENT_BYTES * LAYERS
        assert lw.p.wait_idle(30) and lw.d.wait_idle(30)
        assert got.token_ids == served_again(lw.d, prompt)
