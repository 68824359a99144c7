# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.core.leases import LeaseTable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_complete_expire_renew_exactly_once() -> None:
    clock = Clock()
    table: LeaseTable[str, list[int]] = LeaseTable(10.0, clock=clock)
    table.add("r1", [1, 2], owner="d0")
    table.add("r2", [3], owner="d0")
    table.add("r3", [4], owner="d1", ttl=1.0)
    with pytest.raises(KeyError):
        table.add("r1", [9], owner="d0")
    clock.now = 5.0
    assert table.renew("r1")
    assert table.complete("r2") == [3]
    assert table.complete("r2") is None  # twice: ignored, counted
    clock.now = 12.0
    expired = dict(table.expire())
    assert expired == {"r3": [4]}  # r1 was renewed at t=5 so it lives until 15
    assert table.expire() == []
    clock.now = 15.0
    assert dict(table.expire()) == {"r1": [1, 2]}
    assert table.complete("r1") is None  # late completion after expiry
    assert len(table) == 0
    s = table.stats
    assert (s.added, s.completed, s.expired, s.late_completions, s.renewed) == (3, 1, 2, 2, 1)
    assert not table.renew("r1")


def test_expire_owner_and_next_deadline() -> None:
    clock = Clock()
    table: LeaseTable[int, str] = LeaseTable(3.0, clock=clock)
    assert table.next_deadline() is None
    for i in range(4):
        table.add(i, f"p{i}", owner="a" if i % 2 else "b")
    assert table.next_deadline() == 3.0
    assert sorted(k for k, _ in table.expire_owner("a")) == [1, 3]
    assert table.owners() == {"b"}
    assert table.keys_of("b") == [0, 2]
    assert table.drop(0) == "p0" and table.stats.dropped == 1


def test_owner_is_required() -> None:
    table: LeaseTable[str, int] = LeaseTable(1.0, name="held")
    for owner in ("", "  ", None):
        with pytest.raises(ValueError, match=r"held: 'r1' needs an owner"):
            table.add("r1", 1, owner=owner)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        table.add("r1", 1)  # type: ignore[call-arg]
    assert len(table) == 0 and table.stats.added == 0  # nothing was held
    table.add("r1", 1, owner="d0")
    assert table.lease("r1").owner == "d0"  # type: ignore[union-attr]


ops = st.lists(st.tuples(st.sampled_from(["add", "complete", "renew", "tick", "drop"]),
                         st.integers(0, 5), st.floats(0, 3)), max_size=60)


@settings(max_examples=200)
@given(ops)
def test_every_entry_leaves_exactly_once(seq: list[tuple[str, int, float]]) -> None:
    clock = Clock()
    table: LeaseTable[int, int] = LeaseTable(2.0, clock=clock)
    added = left = 0
    for op, key, dt in seq:
        if op == "add":
            if key not in table:
                table.add(key, key, owner=f"o{key % 2}")
                added += 1
        elif op == "complete":
            left += table.complete(key) is not None
        elif op == "drop":
            left += table.drop(key) is not None
        elif op == "renew":
            table.renew(key)
        else:
            clock.now += dt
            left += len(table.expire())
    left += len(table.expire(now=clock.now + 100))
    assert added == left
    assert len(table) == 0


model_ops = st.lists(st.tuples(st.sampled_from(["add", "complete", "renew", "renew_ttl", "tick",
                                                "drop", "expire_owner", "peek"]),
                               st.integers(0, 7), st.floats(0, 3)), max_size=80)


@settings(max_examples=300)
@given(model_ops)
def test_expiry_matches_a_scan_of_the_deadlines(seq: list[tuple[str, int, float]]) -> None:
    """Expiry in deadline order gives what a scan of every lease would: the same entries,
    each once, with renewals (also to a new ttl), drops and re-adds between."""
    clock = Clock()
    table: LeaseTable[int, int] = LeaseTable(2.0, clock=clock)
    model: dict[int, tuple[float, float, str]] = {}  # key -> (expires_at, ttl, owner)
    for op, key, dt in seq:
        if op == "add" and key not in model:
            table.add(key, key * 10, owner=f"o{key % 3}", ttl=dt or None)
            ttl = dt or 2.0
            model[key] = (clock.now + ttl, ttl, f"o{key % 3}")
        elif op == "complete":
            assert (table.complete(key) is not None) == (key in model)
            model.pop(key, None)
        elif op == "drop":
            assert (table.drop(key) is not None) == (key in model)
            model.pop(key, None)
        elif op in ("renew", "renew_ttl"):
            ttl = dt + 0.5 if op == "renew_ttl" else None
            assert table.renew(key, ttl) == (key in model)
            if key in model:
                _, old_ttl, owner = model[key]
                new_ttl = old_ttl if ttl is None else ttl
                model[key] = (clock.now + new_ttl, new_ttl, owner)
        elif op == "expire_owner":
            owner = f"o{key % 3}"
            got = sorted(k for k, _ in table.expire_owner(owner))
            assert got == sorted(k for k, v in model.items() if v[2] == owner)
            model = {k: v for k, v in model.items() if v[2] != owner}
        elif op == "peek":
            want = min((v[0] for v in model.values()), default=None)
            assert table.next_deadline() == want
        else:
            clock.now += dt
            got = sorted(table.expire())
            due = sorted(k for k, v in model.items() if v[0] <= clock.now)
            assert got == [(k, k * 10) for k in due]
            for k in due:
                del model[k]
        assert sorted(table.keys()) == sorted(model)


def test_renewals_do_not_grow_the_deadlines_without_bound() -> None:
    clock = Clock()
    table: LeaseTable[int, int] = LeaseTable(5.0, clock=clock)
    for i in range(10):
        table.add(i, i, owner="d0")
    for _ in range(2000):
        clock.now += 0.001
        for i in range(10):
            assert table.renew(i)
    assert len(table._deadlines) <= max(64, 4 * 10) + 1  # rebuilt once mostly stale
    clock.now += 5.0
    assert sorted(k for k, _ in table.expire()) == list(range(10))
    assert table.next_deadline() is None
