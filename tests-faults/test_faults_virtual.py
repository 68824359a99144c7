# SPDX-License-Identifier: Apache-2.0
"""A virtual (``do_virtual``) layerwise request must not leave its blocks in D's prefix cache.

A virtual request moves no KV: D reports its prompt loaded at once, so its blocks hold
whatever they held before. vLLM then caches those blocks under the prompt's block hashes
like any loaded prefix, and the next request with the same prompt (or prefix) is served
from them: wrong tokens, silently. Found by the soak (``tests-soak``): an ordinary request
after a virtual one with the same prompt answered other tokens than a single instance.

Fixed in the layerwise connector (D's scheduler side): a virtual request's block hashes
are re-keyed with a per-request salt before vLLM caches its blocks
(``layerwise.scheduler.isolate_from_prefix_cache``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import PROBES, kv_config, prompts_of

LAYERWISE = "MooncakeLayerwiseConnector"
#: Never contacted: a virtual request posts nothing.
METASERVER = "http://127.0.0.1:9/v1/metaserver"


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    model: Path = make_tiny_llama(tmp_path_factory.mktemp("virtual-model"))
    with EngineProcess(model, kv_config("kv_consumer", "virt-d", policy="recompute",
                                        connector=LAYERWISE, load_timeout_s=10)) as engine:
        yield engine


def test_a_virtual_request_does_not_poison_the_prefix_cache(d: EngineProcess) -> None:
    prompt = prompts_of([205], seed=601)
    want = d.generate(prompt, max_tokens=8)[0].token_ids
    d.reset_prefix_cache()
    virtual = d.generate(prompt, max_tokens=8, kv_params=[{
        "do_remote_prefill": True, "metaserver": METASERVER, "request_id": "virt-1",
        "do_virtual": True}])[0]
    assert virtual.finish_reason == "length"
    assert d.call(f"{PROBES}:connector_totals").get("p2p_virtual_requests", 0) == 1
    # an ordinary request with the same prompt afterwards: a single instance's tokens
    again = d.generate(prompt, max_tokens=8)[0]
    assert again.token_ids == want, (f"served from the virtual request's blocks "
                                     f"({again.num_cached_tokens} cached tokens)")
