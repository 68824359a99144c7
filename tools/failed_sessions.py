#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Repeat the end of each failed nox session's output, after nox's own summary.

A CI log is often read from its end only: when ``lint`` fails early and ``faults`` fails
last, the end shows ``faults`` and nothing of why ``lint`` failed. ``scripts/test.sh``
pipes nox's output to a file and runs this on it when nox fails.

Usage: ``failed_sessions.py LOG [LINES]`` (LINES per failed session, default 30).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

START = re.compile(r"^nox > Running session (\S+)")
END = re.compile(r"^nox > Ran \d+ sessions?")
FAILED = re.compile(r"^nox > \* (\S+): failed")


def sessions(lines: list[str]) -> dict[str, list[str]]:
    """Each session's lines, by name (a session run twice keeps its last run)."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines:
        m = START.match(line)
        if m:
            current = out[m.group(1)] = []
        elif END.match(line):  # nox's summary: no session's output
            current = None
        elif current is not None:
            current.append(line)
    return out


def failed(lines: list[str]) -> list[str]:
    return [m.group(1) for line in lines if (m := FAILED.match(line))]


def main() -> int:
    lines = Path(sys.argv[1]).read_text(errors="replace").splitlines()
    keep = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    runs = sessions(lines)
    for name in failed(lines):
        body = runs.get(name, [])
        print(f"\n===== failed session {name}: its last {min(keep, len(body))} lines =====")
        print("\n".join(body[-keep:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
