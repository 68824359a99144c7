# SPDX-License-Identifier: Apache-2.0
"""HostBlockManager: allocation, eviction, prefix match, pins, save jobs, leases."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.block_manager import (
    BlockState,
    HostBlockManager,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.errors import OffloadProtocolError


def chain(name: str, n: int) -> list[bytes]:
    """``n`` chained hashes of a sequence called ``name`` (like core.hashing does)."""
    out, prev = [], hashlib.sha256(name.encode()).digest()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev)
    return out


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def saved(m: HostBlockManager, hashes: list[bytes], ranks: tuple[int, ...] = (0,)) -> list[int]:
    job = m.start_save(hashes, ranks=ranks, owner="test")
    for r in ranks:
        m.finish_save(job.job_id, r)
    return job.block_ids


def test_allocation_uses_lowest_free_ids_in_runs() -> None:
    m = HostBlockManager(8)
    job = m.start_save(chain("a", 3), owner="test")
    assert job.block_ids == [0, 1, 2] and job.positions == [0, 1, 2]
    assert m.match(chain("a", 3)) == 0, "a pending block must never be matched"
    assert m.finish_save(job.job_id, 0) is True
    assert m.match(chain("a", 3)) == 3
    m.check()


@pytest.mark.parametrize("owner", ["", "   "])
def test_nothing_is_held_without_an_owner(owner: str) -> None:
    """An ownerless pin or save is refused before a block is taken (its death could never
    release them early)."""
    m = HostBlockManager(4)
    saved(m, chain("c", 2))
    free, evictable = m.num_free, m.num_evictable
    with pytest.raises(OffloadProtocolError, match="an owner is required"):
        m.start_save(chain("a", 2), owner=owner)
    with pytest.raises(OffloadProtocolError, match="an owner is required"):
        m.pin("k", chain("c", 2), owner=owner)
    assert (m.num_free, m.num_evictable) == (free, evictable)
    assert m.pin_keys() == []
    m.check()


def test_prefix_match_stops_at_the_first_missing_block() -> None:
    m = HostBlockManager(8)
    a = chain("a", 5)
    saved(m, a[:2])
    assert m.match(a) == 2
    assert m.match(a[2:]) == 0
    assert m.match([]) == 0


def test_save_skips_blocks_already_cached_or_pending() -> None:
    m = HostBlockManager(8)
    a = chain("a", 4)
    saved(m, a[:2])
    pending = m.start_save([a[2]], owner="test")
    job = m.start_save(a, owner="test")
    assert job.positions == [3], "only the block neither cached nor pending is new"
    m.finish_save(pending.job_id, 0)
    m.finish_save(job.job_id, 0)
    assert m.match(a) == 4
    m.check()


def test_eviction_takes_least_recently_used_and_tails_before_heads() -> None:
    m = HostBlockManager(4)
    a, b = chain("a", 2), chain("b", 2)
    saved(m, a)
    saved(m, b)
    job = m.start_save(chain("c", 1), owner="test")
    # a is the oldest chain; its tail goes first, its head survives
    assert m.match(a) == 1
    assert m.match(b) == 2
    assert m.stats.evictions == 1 and len(job.block_ids) == 1
    m.check()


def test_pins_protect_blocks_from_eviction() -> None:
    m = HostBlockManager(2)
    a = chain("a", 2)
    saved(m, a)
    assert m.pin("load-1", a, owner="test") == [0, 1]
    job = m.start_save(chain("b", 2), owner="test")
    assert job.job_id == 0 and job.block_ids == [], "everything is pinned: no room"
    assert m.stats.allocation_failures == 1
    assert m.unpin("load-1") == 2
    assert m.start_save(chain("b", 1), owner="test").block_ids
    m.check()


def test_pin_returns_the_cached_prefix_only() -> None:
    m = HostBlockManager(8)
    a = chain("a", 4)
    saved(m, a[:2])
    assert m.pin("p", a, owner="test") == [0, 1]
    assert m.pin("q", chain("zzz", 2), owner="test") == []
    with pytest.raises(OffloadProtocolError, match="'p' is already held"):
        m.pin("p", a, owner="test")
    m.check()


def test_saving_a_chain_never_evicts_its_own_cached_head() -> None:
    m = HostBlockManager(3)
    a = chain("a", 5)
    saved(m, a[:2])
    job = m.start_save(a, owner="test")  # needs 3 blocks, 1 free: allocation stops, a[0:2] survive
    assert job.positions == [2]
    m.finish_save(job.job_id, 0)
    assert m.match(a) == 3
    m.check()


def test_commit_needs_every_rank_and_ignores_late_or_unknown_confirmations() -> None:
    m = HostBlockManager(4)
    job = m.start_save(chain("a", 2), ranks=(0, 1, 2), owner="test")
    assert m.finish_save(job.job_id, 1) is False
    assert m.finish_save(job.job_id, 1) is False, "a repeated confirmation changes nothing"
    assert m.match(chain("a", 2)) == 0
    with pytest.raises(OffloadProtocolError, match="rank 7 is not part of save job"):
        m.finish_save(job.job_id, 7)
    m.finish_save(job.job_id, 0)
    assert m.finish_save(job.job_id, 2) is True
    assert m.finish_save(job.job_id, 2) is None
    assert m.finish_save(12345, 0) is None
    m.check()


def test_expired_save_job_frees_its_blocks_and_late_confirmation_is_ignored() -> None:
    clock = FakeClock()
    m = HostBlockManager(4, save_ttl=10.0, clock=clock)
    job = m.start_save(chain("a", 3), ranks=(0, 1), owner="test")
    m.finish_save(job.job_id, 0)  # renews: rank 1 is the one that died
    clock.now = 5.0
    assert m.expire() == (0, 0)
    clock.now = 20.0
    assert m.expire() == (1, 0)
    assert m.num_free == 4 and m.match(chain("a", 3)) == 0
    assert m.finish_save(job.job_id, 1) is None
    m.check()


def test_lapsed_pin_is_released() -> None:
    clock = FakeClock()
    m = HostBlockManager(4, pin_ttl=1.0, clock=clock)
    saved(m, chain("a", 2))
    m.pin("k", chain("a", 2), owner="sched")
    clock.now = 2.0
    assert m.expire() == (0, 1)
    assert m.num_evictable == 2 and m.unpin("k") == 0
    m.check()


def test_drop_rank_and_owner() -> None:
    m = HostBlockManager(8)
    j1 = m.start_save(chain("a", 2), ranks=(0, 1), owner="s")
    j2 = m.start_save(chain("b", 2), ranks=(0, 1), owner="s")
    m.finish_save(j2.job_id, 1)
    assert m.drop_rank(1) == 1, "only the job still waiting for rank 1 is dropped"
    assert m.match(chain("a", 2)) == 0
    assert all(m.state_of(b) is BlockState.FREE for b in j1.block_ids)
    m.finish_save(j2.job_id, 0)
    assert m.match(chain("b", 2)) == 2
    saved(m, chain("c", 1))
    m.pin("p", chain("c", 1), owner="gone")
    assert m.drop_owner("gone") == (0, 1)
    assert m.num_evictable == 3
    m.check()


def test_fail_save_and_reset() -> None:
    m = HostBlockManager(6)
    job = m.start_save(chain("a", 2), owner="test")
    assert m.fail_save(job.job_id) == 2 and m.fail_save(job.job_id) == 0
    saved(m, chain("b", 3))
    m.pin("p", chain("b", 1), owner="test")
    assert m.reset() == 2, "the pinned block stays"
    assert m.match(chain("b", 3)) == 1
    m.check()


def test_zero_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="num_blocks=0"):
        HostBlockManager(0)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=16), st.lists(st.integers(0, 5), max_size=40))
def test_prefix_match_is_a_prefix_of_what_was_committed(num_blocks: int, lengths: list[int]) -> None:
    m = HostBlockManager(num_blocks)
    for i, n in enumerate(lengths):
        hashes = chain(f"s{i % 4}", n)
        saved(m, hashes)
        matched = m.match(hashes)
        assert all(m.contains(h) for h in hashes[:matched])
        m.check()


class ManagerMachine(RuleBasedStateMachine):
    """Random interleavings of every operation; no block is ever counted twice or lost."""

    jobs = Bundle("jobs")
    pins = Bundle("pins")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.m = HostBlockManager(7, save_ttl=5.0, pin_ttl=3.0, clock=self.clock)
        self.n_pins = 0

    @rule(target=jobs, seq=st.integers(0, 5), n=st.integers(0, 6),
          ranks=st.sampled_from([(0,), (0, 1)]))
    def start_save(self, seq: int, n: int, ranks: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
        before_used = self.m.num_used
        job = self.m.start_save(chain(f"s{seq}", n), ranks=ranks, owner="test")
        assert len(set(job.block_ids)) == len(job.block_ids)
        assert self.m.num_used >= before_used or self.m.stats.evictions
        for b in job.block_ids:
            assert self.m.state_of(b) is BlockState.PENDING
        return job.job_id, ranks

    @rule(job=consumes(jobs))
    def finish(self, job: tuple[int, tuple[int, ...]]) -> None:
        job_id, ranks = job
        results = [self.m.finish_save(job_id, r) for r in ranks]
        assert results[-1] in (True, None)

    @rule(job=consumes(jobs))
    def fail(self, job: tuple[int, tuple[int, ...]]) -> None:
        self.m.fail_save(job[0])

    @rule(target=pins, seq=st.integers(0, 5), n=st.integers(0, 6))
    def pin(self, seq: int, n: int) -> str:
        self.n_pins += 1
        key = f"pin{self.n_pins}"
        hashes = chain(f"s{seq}", n)
        expected = self.m.match(hashes)
        assert len(self.m.pin(key, hashes, owner="test")) == expected
        return key

    @rule(key=consumes(pins))
    def unpin(self, key: str) -> None:
        self.m.unpin(key)

    @rule(dt=st.floats(0.0, 4.0))
    def tick(self, dt: float) -> None:
        self.clock.now += dt
        self.m.expire()

    @precondition(lambda self: self.m.num_evictable > 0)
    @rule()
    def reset(self) -> None:
        assert self.m.reset() >= 1

    @rule(rank=st.integers(0, 1))
    def drop_rank(self, rank: int) -> None:
        self.m.drop_rank(rank)

    @invariant()
    def consistent(self) -> None:
        self.m.check()
        m = self.m
        assert m.num_free + m.num_pending + m.num_cached == m.num_blocks


ManagerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40,
                                            deadline=None)
test_manager_state_machine = ManagerMachine.TestCase
