# SPDX-License-Identifier: Apache-2.0
"""The interval math of ``bench serve``'s repeated rounds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.bench.stats import (
    RatioStats,
    bootstrap_interval,
    compare,
    paired,
    ratio_of_medians,
    spread,
    verdict,
)


def test_paired_drops_rounds_missing_on_either_side() -> None:
    assert paired([1.0, None, 3.0, float("nan")], [2.0, 2.0, None, 1.0]) == ([1.0], [2.0])


def test_ratio_of_medians() -> None:
    assert ratio_of_medians([1.0, 2.0, 9.0], [4.0, 4.0, 4.0]) == pytest.approx(0.5)
    assert ratio_of_medians([], [1.0]) is None
    assert ratio_of_medians([1.0], [0.0]) is None


def test_a_steady_win_has_a_tight_interval_on_the_right_side() -> None:
    ours = [0.50, 0.52, 0.49, 0.51, 0.50]
    peer = [1.00, 1.01, 0.99, 1.02, 1.00]
    s = compare(ours, peer)
    assert s.rounds == 5 and s.ratio == pytest.approx(0.5)
    assert s.low is not None and s.high is not None
    assert s.min is not None and s.max is not None
    assert s.low <= s.ratio <= s.high < 0.6
    assert s.min <= s.ratio <= s.max
    assert verdict(s, at_most=0.8) is True
    assert verdict(s, at_least=1.0) is False


def test_a_noisy_comparison_is_not_met_even_when_its_median_is() -> None:
    # the median ratio is 0.7, but two rounds of five are far worse
    ours = [0.7, 0.7, 0.7, 1.5, 1.6]
    peer = [1.0, 1.0, 1.0, 1.0, 1.0]
    s = compare(ours, peer)
    assert s.ratio == pytest.approx(0.7)
    assert s.high is not None and s.high > 0.8
    assert verdict(s, at_most=0.8) is False


def test_inverse_compares_the_peer_over_ours() -> None:
    s = compare([1.0, 1.0], [2.0, 2.0], inverse=True)
    assert s.ratio == pytest.approx(2.0) and s.low == pytest.approx(2.0)


def test_one_round_has_its_point_as_the_interval_and_nothing_is_not_measured() -> None:
    s = compare([1.0], [2.0])
    assert (s.rounds, s.ratio, s.low, s.high) == (1, 0.5, 0.5, 0.5)
    none = compare([None], [1.0])
    assert none.rounds == 0 and none.ratio is None
    assert verdict(none, at_most=1.0) is None
    assert verdict(s) is None  # no bound
    assert verdict(s.as_dict(), at_most=0.6) is True


@given(st.lists(st.tuples(st.floats(0.01, 10), st.floats(0.01, 10)), min_size=2, max_size=9))
def test_the_interval_holds_the_point_and_lies_within_the_resampled_range(
        pairs: list[tuple[float, float]]) -> None:
    ours, peer = [p[0] for p in pairs], [p[1] for p in pairs]
    iv = bootstrap_interval(ours, peer, resamples=300)
    point = ratio_of_medians(ours, peer)
    assert iv is not None and point is not None
    lo, hi = iv
    assert lo <= hi
    # every resampled median lies between the extreme values of each side
    assert min(ours) / max(peer) - 1e-9 <= lo and hi <= max(ours) / min(peer) + 1e-9


def test_the_bootstrap_is_reproducible() -> None:
    a, b = [1.0, 1.2, 0.9, 1.4], [1.1, 1.0, 1.3, 1.2]
    assert bootstrap_interval(a, b, seed=3) == bootstrap_interval(a, b, seed=3)


def test_spread() -> None:
    assert spread([3.0, None, 1.0, 2.0]) == {"n": 3, "median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([])["median"] is None
    assert isinstance(compare([1.0], [1.0]), RatioStats)


def test_a_peer_within_the_noise_of_zero_gives_no_ratio_and_no_interval() -> None:
    s = compare([0.1, 0.1, 0.1], [-0.01, 0.0, 0.01])  # the peer's median is 0
    assert s.ratio is None and s.low is None and s.high is None
    assert verdict(s, at_most=0.8) is None
    # a peer at zero in some rounds: the interval widens to +inf rather than dropping them
    s = compare([0.1, 0.1, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, -0.1, -0.1])
    assert s.ratio == pytest.approx(0.5) and s.high == float("inf")
    assert verdict(s, at_most=0.8) is False
