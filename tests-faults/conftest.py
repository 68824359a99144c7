# SPDX-License-Identifier: Apache-2.0
"""Fault tests: real processes killed, networks cut, every socket fuzzed.

Each fault test fills one row of the reliability table (``docs/reliability.md``)
through the ``fault_report`` fixture: it records what it measured as it goes
(``fault_report.check("deadline" | "survivor" | "zero", fact, note)``: every
request ended within its deadline, the survivor served new requests, held blocks
and pending entries went back to zero) and names the fault, what happened and
what the client got. The verdict cells are computed from those observations, so
a check that came out false, or that a failed test never reached, reads **no**.
The rows are printed at the end of the run; ``VLLM_ASCEND_KV_FAULTS_REPORT=<path>``
also writes them as Markdown.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
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
#: check name (``FaultReport.check``) -> its column
CHECKS = {"deadline": "deadline respected", "survivor": "survivor serving",
          "zero": "held/pending back to zero"}
_rows: list[dict[str, str]] = []
_OUTCOME = pytest.StashKey[pytest.TestReport]()


def _cell(value: Any) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "**no**"
    if value is None:
        return "n/a"
    return str(value).replace("|", "\\|").replace("\n", " ")


class FaultReport:
    """One row of the reliability table, computed from what the test observed.

    The test measures each fact once and hands it to :meth:`check` (which returns it, so the
    test asserts on the same value); :meth:`__call__` adds the words. The row is written when
    the test ends, passed or failed: a check that came out false, or one the test never
    reached, shows as **no**.
    """

    def __init__(self, test: str) -> None:
        self.test = test
        self.observed: dict[str, list[tuple[bool, str]]] = {c: [] for c in CHECKS}
        self.words: dict[str, Any] | None = None

    def check(self, check: str, ok: Any, note: str = "") -> bool:
        """Record one measured fact of ``check`` (``deadline``, ``survivor`` or ``zero``);
        returns it as a bool, for the test to assert."""
        if check not in CHECKS:
            raise KeyError(f"unknown check {check!r}; one of {sorted(CHECKS)}")
        self.observed[check].append((bool(ok), note))
        return bool(ok)

    def __call__(self, *, fault: str, happened: str, client: str, deadline: Any = "",
                 survivor: Any = "", zero: Any = "") -> None:
        """The row's words. ``deadline``/``survivor``/``zero``: ``None`` where the check does
        not apply, else an optional text shown in place of "yes" when every observation of
        it held; never a literal verdict (observe it with :meth:`check`)."""
        given = {"deadline": deadline, "survivor": survivor, "zero": zero}
        for name, value in given.items():
            if isinstance(value, bool):
                raise TypeError(f"{self.test}: {name}={value!r} is a verdict; record the "
                                f"measured fact with fault_report.check({name!r}, ...)")
            if value is not None and not self.observed[name]:
                raise ValueError(f"{self.test}: nothing observed for {name!r}; call "
                                 f"fault_report.check({name!r}, ...) or pass {name}=None")
        self.words = {"fault": fault, "what happened": happened, "client answer": client,
                      **given}

    def verdict(self, check: str, text: Any) -> str:
        """The cell of ``check``: n/a, yes (or ``text``), or **no** with what failed."""
        if text is None:
            return _cell(None)
        seen = self.observed[check]
        failed = [note or "failed" for ok, note in seen if not ok]
        if failed:
            return "**no** (" + _cell("; ".join(failed)) + ")"
        if not seen:
            return "**no** (not reached)"
        return _cell(text) if text else _cell(True)

    def row(self, failure: str | None) -> dict[str, str]:
        words = self.words or {"fault": self.test, "client answer": "n/a",
                               "what happened": "", "deadline": "", "survivor": "",
                               "zero": ""}
        happened = words["what happened"]
        if failure:
            happened = f"{happened} (test failed: {failure})" if happened else (
                f"test failed: {failure}")
        row = {"test": self.test, "fault": words["fault"], "what happened": happened,
               "client answer": words["client answer"]}
        for check, column in CHECKS.items():
            row[column] = self.verdict(check, words[check])
        return row


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    report = yield
    if report.when == "call":
        item.stash[_OUTCOME] = report
    return report


@pytest.fixture
def fault_report(request: pytest.FixtureRequest) -> Iterator[FaultReport]:
    """The test's :class:`FaultReport`; its row joins the table when the test ends."""
    report = FaultReport(request.node.name)
    yield report
    outcome = request.node.stash.get(_OUTCOME, None)
    failure = None
    if outcome is not None and outcome.failed:
        crash = getattr(outcome.longrepr, "reprcrash", None)
        failure = crash.message.splitlines()[0] if crash is not None else "see the log"
    if report.words is not None or failure is not None:
        _rows.append(report.row(failure))


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
