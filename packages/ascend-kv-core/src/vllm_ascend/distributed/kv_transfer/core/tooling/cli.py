# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv``: the project's command line.

Core provides ``version``, ``config`` and ``doctor``; every installed package
adds to them through the entry-point groups of :mod:`.plugins` (its config
section, its doctor checks; ascend-kv-bench the ``bench`` subcommands, and without it
``bench`` says to install it) and can add subcommands through the ``vllm_ascend_kv.cli``
group. Such an entry point names a callable
``add_commands(subparsers)`` that adds parsers whose ``func`` default is called
with the parsed arguments and returns an exit code.

Run it as ``vllm-ascend-kv`` or ``python -m vllm_ascend.distributed.kv_transfer.core.tooling.cli``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from ..__about__ import __version__
from ..errors import KVTransferError
from . import plugins
from .doctor import add_parser as add_doctor

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = plugins.CLI_GROUP
#: Entry points adding ``vllm-ascend-kv bench <name>`` subcommands.
BENCH_ENTRY_POINT_GROUP = plugins.BENCH_GROUP


def config_sections() -> dict[str, str]:
    """Known configuration sections, including those other packages add."""
    return plugins.config_sections()


def _cmd_version(args: argparse.Namespace) -> int:
    rows = list(plugins.installed_distributions().items())
    try:
        import vllm

        rows.append(("vllm", getattr(vllm, "__version__", "?")))
    except ImportError:
        rows.append(("vllm", "not installed"))
    if args.json:
        print(json.dumps(dict(rows), indent=2))
    else:
        width = max(len(r[0]) for r in rows)
        for name, ver in rows:
            print(f"{name:<{width}}  {ver}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    sections = config_sections()
    names = [args.connector] if args.connector else sorted(sections)
    out: dict[str, list[dict[str, object]]] = {}
    for name in names:
        if name not in sections:
            print(f"unknown connector {name!r}; known: {', '.join(sorted(sections))}",
                  file=sys.stderr)
            return 2
        cls = plugins.load(sections[name])
        out[name] = [d.__dict__ for d in cls.describe()]  # type: ignore[attr-defined]
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    for name, docs in out.items():
        print(f"{name} (kv_connector_extra_config)")
        for d in docs:
            print(f"  {d['key']}: {d['type']} = {d['default']}")
            print(f"      {d['doc']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with the subcommands of every installed package."""
    parser = argparse.ArgumentParser(
        prog="vllm-ascend-kv",
        description="Tools of vllm-ascend-distributed: versions, configuration reference, "
                    "and the subcommands of the installed packages (bench, doctor, ...).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("version", help="versions of the installed packages and of vLLM")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_version)

    p = sub.add_parser("config", help="every kv_connector_extra_config key: type, default, "
                                      "meaning")
    p.add_argument("connector", nargs="?", help="connector name (default: all)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_config)

    add_doctor(sub)

    _add_bench(sub)
    _add_plugins(ENTRY_POINT_GROUP, sub)
    return parser


#: What ``vllm-ascend-kv bench`` says when no distribution brings a benchmark.
BENCH_MISSING = ("the benchmarks are not installed: they are the ascend-kv-bench "
                 "distribution (pip install ascend-kv-bench), a tool that no runtime package "
                 "and not the meta-package installs")


def _add_bench(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``bench <name>``: the ``vllm_ascend_kv.bench`` entry points (ascend-kv-bench's); with
    none installed, ``bench`` and anything after it print :data:`BENCH_MISSING`."""
    if not plugins.entry_points(BENCH_ENTRY_POINT_GROUP):
        missing = sub.add_parser("bench", help="benchmarks (pip install ascend-kv-bench)",
                                 description=BENCH_MISSING)
        missing.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

        def _missing(_args: argparse.Namespace) -> int:
            print(f"vllm-ascend-kv bench: {BENCH_MISSING}", file=sys.stderr)
            return 2

        missing.set_defaults(func=_missing)
        return
    bench = sub.add_parser("bench", help="benchmarks: each path against its raw baseline, "
                                         "measured in the same run")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCHMARK")

    def _bench_help(_args: argparse.Namespace) -> int:
        bench.print_help()
        return 2

    bench.set_defaults(func=_bench_help)
    _add_plugins(BENCH_ENTRY_POINT_GROUP, bench_sub)


def _add_plugins(group: str, sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    for ep in plugins.entry_points(group):
        try:
            ep.load()(sub)
        except Exception as exc:  # one broken plugin must not take the CLI down
            logger.warning("%s %s unavailable: %s", group, ep.name, exc)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``vllm-ascend-kv``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, KVTransferError) as exc:
        # bad input (a missing file, a bad config, a missing dependency): one clear line
        print(f"vllm-ascend-kv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
