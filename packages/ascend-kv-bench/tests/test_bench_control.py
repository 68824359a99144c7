# SPDX-License-Identifier: Apache-2.0
"""``bench control``: the P and D pipelines keep ``N`` in flight and call each connector as
vLLM would (tiny ``N``, seconds); the summary and P's holder rates."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.bench import control


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return control.model_dir(tmp_path_factory.mktemp("control"))


def _connector(model: Path, side: str, role: str) -> Any:
    return control.make_connector(control.CONNECTORS[side], control.ROLES[role], model,
                                  block_size=16, max_len=256)


@pytest.mark.parametrize("side", list(control.CONNECTORS))
def test_p_keeps_n_held_and_returns_params_for_d(model: Path, side: str) -> None:
    c = _connector(model, side, "P")
    p = control.ProducerSide(c, control.Requests("p", 100, 16), n=12, k=3)
    p.fill()
    assert len(p.held) == 12
    for _ in range(4):
        t = p.step()
        assert len(p.held) == 12  # k finished, k released
        assert t.ns["request_finished"] > 0 and t.ns["build_connector_meta"] > 0
    # what P returned is what D's pipeline hands its requests
    d = control.ConsumerSide(None, c, control.Requests("d", 100, 16),
                             control.Requests("src", 100, 16), n=4, k=1)
    params = d._params()
    assert params["do_remote_prefill"] is True
    ids = params["remote_block_ids"]  # Nixl: one list per KV cache group
    assert list(ids[0] if isinstance(ids[0], list) else ids) == list(range(7))
    c.shutdown()


@pytest.mark.parametrize("side", list(control.CONNECTORS))
def test_d_keeps_n_in_flight_and_its_connector_pulls_the_allocated(model: Path,
                                                                   side: str) -> None:
    c, src = _connector(model, side, "D"), _connector(model, side, "P")
    d = control.ConsumerSide(c, src, control.Requests("d", 100, 16),
                             control.Requests("src", 100, 16), n=16, k=2)
    d.fill()
    assert d.in_flight() == 16 and len(d.queued) == 8
    metas = []
    original = c.build_connector_meta
    c.build_connector_meta = lambda out: metas.append(original(out)) or metas[-1]
    for _ in range(3):
        d.step()
        assert d.in_flight() == 16
    # each step's metadata tells the workers to load the k requests allocated in it
    for meta in metas:
        pulled = getattr(meta, "requests", None) or getattr(meta, "reqs_to_recv", None)
        assert pulled is not None and len(pulled) == 2
    c.shutdown()
    src.shutdown()


def test_d_claimed_hands_over_requests_whose_claims_are_still_out(model: Path) -> None:
    c = control.make_connector(control.CONNECTORS["ours"], "kv_consumer", model, block_size=16,
                               max_len=256, extra=control.CLAIMED_CONFIG)
    src = control.make_connector(control.CONNECTORS["ours"], "kv_producer", model,
                                 block_size=16, max_len=256, extra=control.CLAIMED_CONFIG)
    d = control.ConsumerSide(c, src, control.Requests("d", 100, 16),
                             control.Requests("src", 100, 16), n=8, k=2)
    d.fill()
    metas = []
    original = c.build_connector_meta
    c.build_connector_meta = lambda out: metas.append(original(out)) or metas[-1]
    d.step()
    pulled = list(metas[0].requests.values())
    assert len(pulled) == 2
    assert all(m.claimed_ahead and m.early_claims is None for m in pulled)
    c.shutdown()
    src.shutdown()


def test_a_count_is_measured_in_alternating_rounds(model: Path) -> None:
    m = control.measure_count(model, "D", 8, k=2, rounds=2, steps=3, prompt_tokens=64,
                              block_size=16)
    for side in control.CONNECTORS:
        assert [len(r) for r in m[side]["steps"]] == [3, 3]
        assert all(x > 0 for r in m[side]["steps"] for x in r)
        assert m[side]["hooks"]["update_state_after_alloc"] > 0


def test_summary_ratios_and_growth() -> None:
    def side(us: float) -> dict[str, Any]:
        return {"steps": [[us, us * 1.1], [us * 0.9, us]],
                "hooks": dict.fromkeys(control.HOOKS, 1000)}

    measured = {("P", 100): {"ours": side(50.0), "peer": side(100.0)},
                ("P", 400): {"ours": side(50.0), "peer": side(400.0)}}
    rows = control.summarize(measured, steps=2)
    assert rows[0]["ours_over_peer"]["ratio"] == pytest.approx(0.5, rel=0.05)
    assert rows[0]["at_most_peer"] is True
    assert rows[0]["ours_p99_us"] == pytest.approx(55.0)
    assert rows[0]["ours_hooks_us_per_step"]["request_finished"] == pytest.approx(0.25)
    g = control.growth(rows)
    assert g["P"]["ours"] == pytest.approx(1.0) and g["P"]["peer"] == pytest.approx(4.0)
    assert g["P"]["in_flight_ratio"] == 4.0


def test_holder_rates_keep_the_table_full() -> None:
    h = control.measure_holder(64, batch=4, rounds=2, prompt_blocks=8)
    assert h["held"] == 64
    for key in ("claims_per_s", "dones_per_s", "sweeps_per_s", "idle_sweeps_per_s",
                "holds_per_s"):
        assert h[key] > 0 and len(h["rounds"][key]) == 2


def test_quick_run_writes_results(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    control.add_parser(parser.add_subparsers())
    args = parser.parse_args(["control", "--quick", "--out", str(tmp_path), "--counts", "8",
                              "--rounds", "2", "--steps", "2", "--changed", "2",
                              "--prompt-tokens", "64", "--block-size", "16"])
    assert args.func(args) == 0
    doc = json.loads((tmp_path / "control.json").read_text())
    assert [(r["role"], r["in_flight"]) for r in doc["rows"]] == [("P", 8), ("D", 8),
                                                                  ("D-claimed", 8)]
    assert doc["holder"][0]["held"] == 8 and doc["driven"] == "connector objects"
    # each hook's per-round time, and each part of a request's params, with and without a key
    assert set(doc["parts_us"]) == {f"{side}/{part} ({mode})" for mode in control.KEY_MODES
                                    for side, names in control.PARTS.items() for part in names}


def test_a_hooks_rounds_add_up_to_its_total(model: Path) -> None:
    m = control.measure_count(model, "P", 6, k=2, rounds=2, steps=3, prompt_tokens=64,
                              block_size=16)
    for side in control.CONNECTORS:
        for hook in control.HOOKS:
            per_round = m[side]["hook_rounds"][hook]
            assert len(per_round) == 2
            # µs a step over each round's 3 steps = the hook's ns over the rounds
            assert sum(per_round) * 3 * 1e3 == pytest.approx(m[side]["hooks"][hook])
        assert m[side]["hook_rounds"]["request_finished"][0] > 0


def test_the_parts_of_a_requests_params_are_timed_with_and_without_a_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.core import auth
    from vllm_ascend.distributed.kv_transfer.kv_p2p.signed_params import MAC_KEY, sign

    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    monkeypatch.delenv(auth.ENV_KEY_FILE, raising=False)
    signed_while: list[bool] = []
    real_sign = sign

    def spy(params: dict[str, Any], **kw: Any) -> dict[str, Any]:
        out = real_sign(params, **kw)
        signed_while.append(MAC_KEY in out)
        return out

    monkeypatch.setattr("vllm_ascend.distributed.kv_transfer.kv_p2p.signed_params.sign", spy)
    parts = control.measure_parts(rounds=2, calls=5, prompt_tokens=64, block_size=16)
    assert set(parts) == {(mode, side, part) for mode in control.KEY_MODES
                          for side, names in control.PARTS.items() for part in names}
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in parts.values())
    # the keyed turns really MACed the params (and the unkeyed ones did not)
    assert True in signed_while and False in signed_while
    # the process's environment is as before
    assert auth.ENV_KEY not in os.environ
