# SPDX-License-Identifier: Apache-2.0
"""ascend-kv-bench plugs every benchmark into ``vllm-ascend-kv bench`` and our connectors'
scenarios into ``bench serve`` through the entry points of its ``pyproject.toml``."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.core.tooling import cli, plugins

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
DECLARED = PYPROJECT["project"]["entry-points"]
#: Every ``vllm-ascend-kv bench`` subcommand of the project (``nox -s bench`` runs them all
#: but ``fleet``, run by hand: docs/fleet-simulation.md).
BENCHMARKS = {"auth", "client", "control", "engine", "fleet", "hybrid", "index", "kernels", "layerwise", "offload", "p2p",
              "pool", "router", "serve", "trace"}


def _declared(group: str) -> list[metadata.EntryPoint]:
    return [metadata.EntryPoint(name, value, group)
            for name, value in sorted(DECLARED[group].items())]


def test_every_benchmark_is_declared_here() -> None:
    assert set(DECLARED[plugins.BENCH_GROUP]) == BENCHMARKS
    assert set(DECLARED[plugins.SERVE_GROUP]) == {"offload", "p2p", "pool"}


def test_the_command_lists_every_declared_benchmark(monkeypatch: pytest.MonkeyPatch) -> None:
    """The declared entry points load, and each adds its subcommand to ``bench``."""
    monkeypatch.setattr(plugins, "entry_points", lambda group: _declared(group)
                        if group in (plugins.BENCH_GROUP, plugins.SERVE_GROUP) else [])
    parser = cli.build_parser()
    for name in BENCHMARKS:  # each parses its --quick run into its own function
        args = parser.parse_args(["bench", name, "--quick", "--out", "somewhere"])
        assert args.bench == name and callable(args.func) and args.quick
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "no-such-benchmark"])


def test_serve_scenarios_load_from_their_entry_points() -> None:
    names = []
    for ep in _declared(plugins.SERVE_GROUP):
        names += [sc.name for sc in ep.load()()]
    assert {"pd/ours", "pool/ours-mooncake", "offload/ours"} <= set(names)
