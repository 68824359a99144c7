# SPDX-License-Identifier: Apache-2.0
"""AscendStoreConnector on a real Mooncake Store when a pool client or the master dies.

(The master killed for good is in tests-e2e/test_pool_e2e.py.)

* a pool client killed half-way through a put: the objects it finished are valid hits for
  another instance, the one it did not finish is never a hit;
* a pool client whose own segment held the objects killed: the master still lists them
  for a while, loads from the dead segment fail and are recomputed;
* ``mooncake_master`` killed and restarted mid-run: lookups miss and saves are dropped
  while it is down (no request waits on it), the pool works again once it is back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import POOL_STATE, holds_nothing, start_in_parallel, wait_for
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.mooncake import MooncakeMaster, MooncakeSegmentHolder
from ascend_kv_testing.pd import PROBES, prompts_of

HOOKS = "ascend_kv_testing.fault_hooks"
BS = 32
RETRY_S = 2.0


def pool(engine: EngineProcess) -> dict[str, float]:
    return engine.call(f"{PROBES}:pool_totals")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A master with a segment holder, a model, a plain engine for reference tokens, and
    ``kv(segment)``: the pool config of an engine mounting ``segment`` of its own."""
    work = tmp_path_factory.mktemp("pool-faults")
    master = MooncakeMaster(work / "mc").start()
    holder = MooncakeSegmentHolder(master, segment_size="64MB").start()
    model = make_tiny_llama(work / "model")

    def kv(segment: str | int = 0) -> dict[str, Any]:
        # a pool is a cache: a load that fails is recomputed (vLLM's default policy fails
        # the request instead)
        return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {
                    "backend": "mooncake", "store_retry_interval_s": RETRY_S,
                    "mooncake": master.config(global_segment_size=segment,
                                              local_buffer_size="16MB")}}

    made = start_in_parallel({
        "a1": lambda: EngineProcess(model, kv()),
        "a2": lambda: EngineProcess(model, kv("32MB")),
        "b": lambda: EngineProcess(model, kv()),
        "plain": lambda: EngineProcess(model),
    })
    state = type("Store", (), {"master": master, "holder": holder, "work": work, **made})
    yield state
    for engine in made.values():
        engine.close()
    state.holder.stop()
    state.master.stop()


def test_client_killed_mid_put(store: Any, fault_report: Any) -> None:
    a1, b, plain = store.a1, store.b, store.plain
    prompt = prompts_of([4 * BS + 5], seed=401)
    want = plain.generate(prompt, max_tokens=8)[0].token_ids
    assert a1.call(f"{HOOKS}:die_mid_put", after_keys=1)
    try:  # the save runs behind the forward pass: A may die before or after answering
        a1.generate(prompt, max_tokens=8, timeout=60)
        a1.wait_idle(30)
    except (RuntimeError, EOFError, OSError):
        pass
    a1.proc.join(30)
    assert not a1.proc.is_alive()
    before = pool(b)
    start = time.monotonic()
    got = b.generate(prompt, max_tokens=8)[0]
    took = time.monotonic() - start
    after = pool(b)
    assert fault_report.check("deadline", took < 30, f"the survivor's request took {took:.1f}s")
    # exactly the one object A finished is a hit; the rest was recomputed and saved by B
    assert fault_report.check("survivor", got.token_ids == want, "the survivor's answer")
    assert got.num_cached_tokens == BS
    assert after.get("pool_loaded_blocks", 0) - before.get("pool_loaded_blocks", 0) == 1
    assert after.get("pool_failed_load_blocks", 0) == before.get("pool_failed_load_blocks", 0)
    holds_nothing(b, fault_report, zero=POOL_STATE)
    b.reset_prefix_cache()
    again = b.generate(prompt, max_tokens=8)[0]
    assert fault_report.check("survivor", again.token_ids == want, "the survivor's next answer")
    assert again.num_cached_tokens == 4 * BS
    holds_nothing(b, fault_report, zero=POOL_STATE)
    fault_report(fault="pool client killed (SIGKILL) half-way through a put",
                 happened="the object it had finished was a hit for another instance, the "
                          "unfinished ones were never hits (recomputed, saved by the survivor)",
                 deadline=f"yes ({took:.1f}s)",
                 client="survivor: the right tokens; killed client: connection lost")


def test_client_holding_the_segment_killed(store: Any, fault_report: Any) -> None:
    a2, b, plain = store.a2, store.b, store.plain
    # the holder goes: A2's own segment is the only live one (the master may still place
    # a replica in the holder's dead segment for a while: that put fails and is dropped)
    store.holder.stop()
    # until the master drops the dead segment, puts placed there fail and are dropped (and
    # the store guard then drops saves for its retry interval): new prompts until A2 saves
    give_up = time.monotonic() + 60
    seed, dropped_puts = 402, 0
    while True:
        prompt = prompts_of([3 * BS + 2], seed=seed)
        want = plain.generate(prompt, max_tokens=8)[0].token_ids
        saved0 = pool(a2).get("pool_saved_blocks", 0)
        assert a2.generate(prompt, max_tokens=8)[0].token_ids == want
        holds_nothing(a2, zero=POOL_STATE)
        if pool(a2).get("pool_saved_blocks", 0) - saved0 >= 1:
            break
        dropped_puts += 1
        assert time.monotonic() < give_up, "A2 never saved into a live segment in 60 s"
        seed += 1000
        time.sleep(2)
    a2.kill()
    before = pool(b)
    start = time.monotonic()
    got = b.generate(prompt, max_tokens=8)[0]
    took = time.monotonic() - start
    after = pool(b)
    assert fault_report.check("survivor", got.token_ids == want
                              and got.finish_reason == "length", "the survivor's answer")
    lookups_hit = after.get("pool_hit_tokens", 0) - before.get("pool_hit_tokens", 0)
    failed = after.get("pool_failed_load_blocks", 0) - before.get("pool_failed_load_blocks", 0)
    # the master may still list A2's objects: every hit lives in a dead segment, its load
    # fails and is recomputed
    assert failed * BS == lookups_hit, (lookups_hit, failed)
    assert fault_report.check("deadline", took < 30, f"the survivor's request took {took:.1f}s")
    assert fault_report.check("survivor", len(b.generate(prompts_of([70], seed=403),
                                                         max_tokens=8)[0].token_ids) == 8,
                              "the survivor's next answer")
    holds_nothing(b, fault_report, zero=POOL_STATE)
    store.holder = MooncakeSegmentHolder(store.master, segment_size="64MB").start()
    fault_report(fault="pool client holding the objects' segment killed",
                 happened=("the master still listed its objects; loading them from the dead "
                           f"segment failed ({failed} blocks) and the survivor recomputed them"
                           if failed else "the master had dropped its objects: a miss, "
                           "recomputed") + f" ({took:.1f}s)"
                          + (f"; before that, {dropped_puts} prompt(s) of A2's saves were "
                             "dropped (placed in the dead segment), never an error to the client"
                             if dropped_puts else ""),
                 deadline=f"yes ({took:.1f}s)", client="the right tokens")


def test_master_killed_and_restarted_mid_run(store: Any, fault_report: Any) -> None:
    b, plain = store.b, store.plain
    first, during, after = (prompts_of([2 * BS + 9], seed=s) for s in (404, 405, 406))
    want = {tuple(p[0]): plain.generate(p, max_tokens=8)[0].token_ids
            for p in (first, during, after)}
    assert b.generate(first, max_tokens=8)[0].token_ids == want[tuple(first[0])]
    holds_nothing(b, zero=POOL_STATE)
    old = store.master
    store.master.kill()
    # while it is down: misses and dropped saves, no request waits on the master
    start = time.monotonic()
    outs = [b.generate(p, max_tokens=8)[0] for p in (first, during)]
    down_s = time.monotonic() - start
    assert fault_report.check("survivor", [o.token_ids for o in outs]
                              == [want[tuple(first[0])], want[tuple(during[0])]],
                              "answers while the master was down")
    assert fault_report.check("deadline", down_s < 10,
                              f"2 requests took {down_s:.1f}s while down")
    holds_nothing(b, fault_report, zero=POOL_STATE)
    dropped = pool(b).get("pool_dropped_save_blocks|cause=store_unavailable", 0)
    assert dropped > 0
    # the same ports again: the clients find it, the holder mounts its segment again
    store.master = MooncakeMaster(old.workdir, rpc_port=old.rpc_port, http_port=old.http_port,
                                  metrics_port=old.metrics_port).start()
    back = time.monotonic()

    def pool_hits_again() -> bool:
        b.reset_prefix_cache()
        b.generate(after, max_tokens=8)
        assert b.wait_idle(30)
        b.reset_prefix_cache()
        return (b.generate(after, max_tokens=8)[0].num_cached_tokens or 0) >= 2 * BS

    assert wait_for(pool_hits_again, 60, interval_s=RETRY_S)
    recovered_s = time.monotonic() - back
    assert fault_report.check("survivor", b.generate(after, max_tokens=8)[0].token_ids
                              == want[tuple(after[0])], "the answer after the restart")
    holds_nothing(b, fault_report, zero=POOL_STATE)
    fault_report(fault="mooncake_master killed and restarted mid-run",
                 happened=f"while down, lookups missed and saves were dropped at once "
                          f"({dropped:.0f} blocks); once restarted on the same ports the pool "
                          f"served hits again after {recovered_s:.1f}s",
                 deadline=f"yes (2 requests in {down_s:.1f}s while down)",
                 client="the right tokens")
