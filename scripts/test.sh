#!/usr/bin/env bash
# Builds kvq and runs the whole test suite (unit, property, engine and CLI tests, then the Python
# package's tests with pytest; the prefix-store tests of both start real redis-server processes,
# which setup.sh installs, and say so when they skip without one). The C++ suite runs twice: at the SIMD level the CPU supports, then
# with KVQ_SIMD=scalar, so that the same binaries are tested with every vector path on and with
# none (src/core/cpu.h; tests/simd_test.cc compares the levels directly as well).
#   scripts/test.sh             the suite
#   KVQ_HF=1 scripts/test.sh    the same with torch and transformers installed, so the kvq.hf
#                               tests run (CI does this); without it they are skipped
#   KVQ_SANITIZE=1 scripts/test.sh   the C++ suite under AddressSanitizer + UBSan (build-asan/)
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
echo "test.sh: the suite at the CPU's SIMD level (KVQ_SIMD=${KVQ_SIMD:-auto})" >&2
ctest --test-dir "$dir" --output-on-failure -j"$(nproc)"
echo "test.sh: the suite again with KVQ_SIMD=scalar" >&2
KVQ_SIMD=scalar ctest --test-dir "$dir" --output-on-failure -j"$(nproc)"
if [[ "${KVQ_SANITIZE:-0}" == 1 ]]; then
  echo "test.sh: note: the Python tests run in the plain build only (the extension is not" \
       "sanitized)" >&2
  exit 0
fi

# The Python package, built from this tree into .venv, and its tests. The module gets -Werror
# (the library's warnings are the C++ build's business, with its own flags).
KVQ_PYTHON_WERROR=ON scripts/python_env.sh install
if [[ "${KVQ_HF:-0}" != 1 ]]; then
  echo "test.sh: note: KVQ_HF is not 1: torch/transformers may be missing, and the kvq.hf tests" \
       "are then skipped" >&2
fi
# pytest exits 5 when it collected no test: a suite that ran nothing has failed.
rc=0
.venv/bin/python -m pytest python/tests -q -ra || rc=$?
if ((rc == 5)); then echo "test.sh: error: pytest collected no tests" >&2; fi
exit "$rc"
