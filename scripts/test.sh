#!/usr/bin/env bash
# Builds kvq and runs the whole test suite (unit, property, engine and CLI tests).
#   scripts/test.sh             the suite
#   KVQ_SANITIZE=1 scripts/test.sh   the same under AddressSanitizer + UBSan (build-asan/)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/setup.sh --no-build
if [[ "${KVQ_SANITIZE:-0}" == 1 ]]; then
  dir=build-asan
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVQ_SANITIZE=ON -DKVQ_WERROR=ON -DKVQ_BUILD_BENCH=OFF
else
  dir=build
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DKVQ_WERROR=ON
fi
cmake --build "$dir" -j"$(nproc)"
shared="${KVQ_SHARED_DIR:-$repo/../shared}"
if [[ ! -d "$shared/models/stories260K" ]]; then
  echo "test.sh: note: $shared/models/stories260K not found: the stories260K engine tests will be" \
       "skipped (set KVQ_SHARED_DIR to the shared data directory)" >&2
fi
ctest --test-dir "$dir" --output-on-failure -j"$(nproc)"
