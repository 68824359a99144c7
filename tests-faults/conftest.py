# SPDX-License-Identifier: Apache-2.0
"""Fault tests: real processes killed, networks cut, every socket fuzzed.

Each fault test ends by recording one row of the reliability table
(``docs/reliability.md``) through the ``fault_report`` fixture: the fault, what
happened, whether every request ended within its deadline, whether the
survivor served new requests, whether held blocks and pending entries went
back to zero, and what the client got. The rows are printed at the end of the
run; ``VLLM_ASCEND_KV_FAULTS_REPORT=<path>`` also writes them as Markdown.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.requires import require_installed

for _k, _v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_HOST_IP": "127.0.0.1", "VLLM_ASCEND_KV_HOST": "127.0.0.1",
               "MC_TCP_BIND_ADDRESS": "127.0.0.1",
               "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1"}.items():
    os.environ.setdefault(_k, _v)

# This session installs them (noxfile.py): one missing is a broken install, which must fail
# the session, not turn the tests that need it into skips.
require_installed("vllm", "transformers", "mooncake.engine", "mooncake.store")

REPORT_ENV = "VLLM_ASCEND_KV_FAULTS_REPORT"
COLUMNS = ("fault", "what happened", "deadline respected", "survivor serving",
           "held/pending back to zero", "client answer")
_rows: list[dict[str, str]] = []


def _cell(value: Any) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "**no**"
    if value is None:
        return "n/a"
    return str(value).replace("|", "\\|").replace("\n", " ")


@pytest.fixture
def fault_report(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``record(fault=..., happened=..., deadline=..., survivor=..., zero=..., client=...)``:
    one row of the reliability table (call it once the test's checks passed)."""

    def record(*, fault: str, happened: str, deadline: Any, survivor: Any, zero: Any,
               client: str) -> None:
        _rows.append({"test": request.node.name, "fault": fault, "what happened": happened,
                      "deadline respected": _cell(deadline), "survivor serving": _cell(survivor),
                      "held/pending back to zero": _cell(zero), "client answer": client})

    return record


def render_rows(rows: list[dict[str, str]]) -> str:
    """The rows as a Markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row[c]) if c in ("fault", "what happened",
                                                                "client answer") else row[c]
                                       for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _rows:
        return
    table = render_rows(_rows)
    terminalreporter.write_sep("=", "reliability table (docs/reliability.md)")
    terminalreporter.write(table)
    path = os.environ.get(REPORT_ENV)
    if path:
        Path(path).write_text(table)
        terminalreporter.write_line(f"written to {path}")
