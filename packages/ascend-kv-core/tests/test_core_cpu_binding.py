# SPDX-License-Identifier: Apache-2.0
"""What a value of ``VLLM_CPU_OMP_THREADS_BIND`` pins (``core.tooling.cpu_binding``): the
rule the p2p doctor's OpenMP check and ``bench serve``'s engines share."""

from __future__ import annotations

import pytest

from vllm_ascend.distributed.kv_transfer.core.tooling.cpu_binding import bound_cpus, parse_cpu_list


def test_cpu_lists_parse_as_vllm_writes_them() -> None:
    assert parse_cpu_list("1") == [1]
    assert parse_cpu_list("5,2-4") == [2, 3, 4, 5]
    assert parse_cpu_list("0-1,1") == [0, 1]
    for bad in ("", "a", "1-", "-2", "1,,2", "0-x"):
        with pytest.raises(ValueError, match="not a CPU list"):
            parse_cpu_list(bad)


def test_only_a_cpu_list_pins_and_the_first_rank_s_is_taken() -> None:
    for free in ("", " ", "auto", "nobind", " nobind "):
        assert bound_cpus(free) is None
    assert bound_cpus("2-3") == [2, 3]
    assert bound_cpus("0,1|2,3") == [0, 1]  # one list per rank: the first
    for bad in ("cores", "1-", "|0"):
        with pytest.raises(ValueError, match="not a CPU list"):
            bound_cpus(bad)
