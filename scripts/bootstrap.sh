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

if ! command -v nox >/dev/null 2>&1 || ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check "nox>=2024.10" "uv>=0.4"
fi
