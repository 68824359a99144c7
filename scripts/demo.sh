#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The README's main-job command: set up a fresh machine, then run the P/D demo
# (a prefill and a decode `vllm serve` on CPU with MooncakeConnectorV1 and the
# proxy, every completion checked against a single instance).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
# where bootstrap had to put nox and uv into a tools venv
[ -x .venv/tools/bin/nox ] && export PATH="$PWD/.venv/tools/bin:$PATH"
exec nox -s demo "$@"
