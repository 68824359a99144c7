# SPDX-License-Identifier: Apache-2.0
"""What a value of ``VLLM_CPU_OMP_THREADS_BIND`` pins: the one home of that rule.

It serves the p2p ``doctor``'s OpenMP check and the engines ``bench serve`` (ascend-kv-bench)
binds itself."""

from __future__ import annotations


def parse_cpu_list(text: str) -> list[int]:
    """CPU ids of a list like ``"5,2-4"`` (as ``VLLM_CPU_OMP_THREADS_BIND`` gives them).

    Raises:
        ValueError: not such a list.
    """
    cpus: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r}")
        cpus.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    if not cpus:
        raise ValueError(f"not a CPU list: {text!r}")
    return sorted(set(cpus))


#: vLLM's CPU thread binding: ``auto`` (its default: the cores of a NUMA node, the same
#: ones for every engine of the host), ``nobind`` (none), else a CPU list per rank,
#: ``|``-separated.
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def bound_cpus(value: str) -> list[int] | None:
    """The CPUs a value of :data:`OMP_BIND_ENV` pins an engine in the calling process to
    (the first rank's list); ``None`` for ``auto``, ``nobind`` or nothing, which pin no
    engine apart from another on the same host.

    Raises:
        ValueError: neither of those nor a CPU list.
    """
    value = value.strip()
    if value in ("", "auto", "nobind"):
        return None
    return parse_cpu_list(value.split("|")[0])
