#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install what a fresh machine needs to build, test and demo the project:
# Debian libraries of the Mooncake wheel, then nox and uv. Idempotent.
set -euo pipefail

need_apt=()
for pkg in libibverbs1 libnuma1; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# nox and uv: on PATH already, else pip into this Python; where the system Python is
# externally managed (PEP 668) or pip is missing, into a tools venv under .venv/tools,
# which scripts/test.sh and scripts/demo.sh put on PATH.
TOOLS="$(cd "$(dirname "$0")/.." && pwd)/.venv/tools"
if [ -x "$TOOLS/bin/nox" ]; then
  export PATH="$TOOLS/bin:$PATH"
fi
if ! command -v nox >/dev/null 2>&1 || ! command -v uv >/dev/null 2>&1; then
  if ! python3 -m pip install --quiet --disable-pip-version-check "nox>=2024.10" "uv>=0.4" \
      2>/dev/null; then
    python3 -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install --quiet --disable-pip-version-check \
      "nox>=2024.10" "uv>=0.4"
  fi
fi
