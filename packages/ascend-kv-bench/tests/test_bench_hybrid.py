# SPDX-License-Identifier: Apache-2.0
"""``bench hybrid``: the model it builds and how it sums up its rounds (the engines themselves
run in ``bench hybrid --quick``, by hand or in ``nox -s bench``)."""

from __future__ import annotations

import argparse

from vllm_ascend.distributed.kv_transfer.bench import hybrid


def test_the_model_alternates_window_and_full_attention_untied() -> None:
    spec = hybrid.model_spec(1024, quick=False)
    layers = int(spec["num_hidden_layers"])
    assert spec["layer_types"] == ["sliding_attention", "full_attention"] * (layers // 2)
    assert spec["sliding_window"] == 1024 and spec["tie_word_embeddings"] is False
    assert spec["max_position_embeddings"] >= 8192 + 128
    assert len(hybrid.model_spec(64, quick=True)["layer_types"]) < layers


def test_summary_is_on_over_off_with_the_rounds_interval() -> None:
    samples = {}
    for n in (2048, 8192):
        samples[("on", n, "ttft")] = [0.10, 0.11, 0.12]
        samples[("off", n, "ttft")] = [0.20, 0.22, 0.24]
        samples[("on", n, "bytes")] = [1e6] * 3
        samples[("off", n, "bytes")] = [4e6] * 3
    measured = {"samples": samples, "agree": {2048: [True] * 3, 8192: [True, False, True]},
                "fit": {("on", 2048): 30.0, ("off", 2048): 20.0, ("on", 8192): 9.0,
                        ("off", 8192): 5.0}}
    rows = hybrid.summarize(measured, (2048, 8192))
    assert [r["prompt_tokens"] for r in rows] == [2048, 8192]
    first = rows[0]
    assert first["bytes_on_over_off"]["ratio"] == 0.25
    assert abs(first["ttft_on_over_off"]["ratio"] - 0.5) < 1e-9
    low, high = first["ttft_on_over_off"]["low"], first["ttft_on_over_off"]["high"]
    assert low <= 0.5 <= high
    assert first["fit_on_over_off"] == 1.5 and first["first_token_agrees"]
    assert not rows[1]["first_token_agrees"]


def test_the_command_registers_with_its_options() -> None:
    parser = argparse.ArgumentParser()
    hybrid.add_parser(parser.add_subparsers())
    args = parser.parse_args(["hybrid", "--quick", "--window", "64", "--ledger", "none"])
    assert args.func is hybrid.run and args.quick and args.window == 64
    assert args.max_batched_tokens == 2048
