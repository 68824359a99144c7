# SPDX-License-Identifier: Apache-2.0
"""The reliability table is computed from what the fault tests observed: it can say no.

No engine here: a fresh ``FaultReport`` (the class behind the ``fault_report`` fixture) is
fed observations, and its row is checked. Nothing of this joins the run's table.
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def report_class(fault_report: Any) -> type:
    return type(fault_report)  # the fixture's own report is left unused: it adds no row


def test_rows_follow_the_observations(report_class: type) -> None:
    ok = report_class("t_ok")
    assert ok.check("deadline", 1.2 < 8, "1.2s") is True
    assert ok.check("survivor", [1, 2] == [1, 2])
    ok.check("zero", True)
    ok(fault="f", happened="h", client="c", deadline="yes (1.2s < 8s)")
    row = ok.row(None)
    assert row["deadline respected"] == "yes (1.2s < 8s)"
    assert row["survivor serving"] == "yes" and row["held/pending back to zero"] == "yes"

    bad = report_class("t_bad")
    assert bad.check("deadline", 9.5 < 8, "took 9.5s") is False
    bad.check("survivor", True)
    bad.check("zero", {"used_blocks": 3}["used_blocks"] == 0, "used_blocks=3")
    bad.check("zero", True)
    bad(fault="f", happened="h", client="c", deadline="yes (9.5s)")
    row = bad.row(None)
    assert row["deadline respected"] == "**no** (took 9.5s)"
    assert row["survivor serving"] == "yes"
    assert row["held/pending back to zero"] == "**no** (used_blocks=3)"


def test_a_failed_test_shows_what_it_did_not_reach(report_class: type) -> None:
    r = report_class("t_failed")
    r.check("deadline", True)
    row = r.row("AssertionError: tokens differ")
    assert row["fault"] == "t_failed" and "AssertionError: tokens differ" in row["what happened"]
    assert row["deadline respected"] == "yes"
    assert row["survivor serving"] == row["held/pending back to zero"] == "**no** (not reached)"


def test_verdicts_are_observed_not_written(report_class: type) -> None:
    r = report_class("t_literal")
    with pytest.raises(TypeError, match="is a verdict"):
        r(fault="f", happened="h", client="c", deadline=True)
    with pytest.raises(ValueError, match="nothing observed for 'survivor'"):
        r(fault="f", happened="h", client="c", deadline=None, zero=None)
    with pytest.raises(KeyError, match="unknown check"):
        r.check("speed", True)
    r(fault="f", happened="h", client="c", deadline=None, survivor=None, zero=None)
    assert set(r.row(None).values()) >= {"n/a"}
