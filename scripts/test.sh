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
exec nox "$@"
