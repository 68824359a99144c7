#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's test command: set up a fresh machine, then run every nox session
# a change must pass (lint, types, namespace guard, build, install matrix,
# each package's tests, end-to-end tests). Extra arguments go to nox.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
# where bootstrap had to put nox and uv into a tools venv
[ -x .venv/tools/bin/nox ] && export PATH="$PWD/.venv/tools/bin:$PATH"
# nox's output is kept too: when a session fails, the end of its output is repeated
# after nox's summary (a log read from its end then shows every failure, not the last)
log=$(mktemp -t nox-XXXXXX.log)
trap 'rm -f "$log"' EXIT
set +e
nox "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then
    python3 tools/failed_sessions.py "$log" 40 || true
fi
exit "$rc"
