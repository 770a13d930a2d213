#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/*_fuzz.cc; clang, AddressSanitizer + UBSan) into build-fuzz/
# and runs each for a bounded time, one after the other.
#
#   scripts/fuzz.sh                       every target, 60 s each
#   scripts/fuzz.sh -t 600 container      one target for 10 minutes
#   scripts/fuzz.sh -t 20                 the CI run (.ci/run)
#   scripts/fuzz.sh --build-only | --no-build
#
# Each target reads its seed corpus fuzz/corpus/<target>/ (never written) and keeps what it finds
# in build-fuzz/corpus/<target>/, so later runs continue from there. A finding (crash, sanitizer
# report, failed property, timeout, out-of-memory) is saved in build-fuzz/crashes/<target>/ and
# makes the script fail; reproduce it with build-fuzz/<target>_fuzz FILE, or without libFuzzer
# with the <target>_fuzz_replay binary of a test build. At the end a table gives the executions
# per target (also appended to build-fuzz/fuzz-log.tsv).
#
# Seeds are generated from real caches and files: KVQ_WRITE_FUZZ_SEEDS=1 build/kvq_tests
# --gtest_filter=FuzzSeeds.Write (tests/container_golden_test.cc).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

seconds=60
build_only=0
no_build=0
targets=()
while (($#)); do
  case "$1" in
    -t) seconds="$2"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    --no-build) no_build=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if ((${#targets[@]} == 0)); then
  for f in fuzz/*_fuzz.cc; do t="$(basename "$f" .cc)"; targets+=("${t%_fuzz}"); done
fi

dir=build-fuzz
jobs="${KVQ_FUZZ_BUILD_JOBS:-$(nproc)}"
if ((!no_build)); then
  CC=clang CXX=clang++ cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVQ_FUZZ=ON \
    -DKVQ_BUILD_TESTS=OFF -DKVQ_BUILD_BENCH=OFF >/dev/null
  build_targets=()
  for t in "${targets[@]}"; do build_targets+=("${t}_fuzz"); done
  cmake --build "$dir" -j"$jobs" --target "${build_targets[@]}" >/dev/null
fi
((build_only)) && exit 0

status=0
summary=()
for t in "${targets[@]}"; do
  corpus="$dir/corpus/$t"
  crashes="$dir/crashes/$t"
  mkdir -p "$corpus" "$crashes"
  dict=()
  [[ -f "fuzz/$t.dict" ]] && dict=(-dict="fuzz/$t.dict")
  log="$dir/fuzz-$t.log"
  echo "fuzz: $t for ${seconds}s"
  set +e
  # rss/malloc limits make any unbounded allocation a finding; -timeout flags slow inputs.
  "$dir/${t}_fuzz" -max_total_time="$seconds" -rss_limit_mb=2048 -malloc_limit_mb=1024 -timeout=20 \
    -print_final_stats=1 -artifact_prefix="$crashes/" "${dict[@]}" "$corpus" "fuzz/corpus/$t" >"$log" 2>&1
  rc=$?
  set -e
  execs=$(grep -m1 'stat::number_of_executed_units' "$log" | awk '{print $2}')
  cov=$(grep -E '^#[0-9]+' "$log" | tail -1 | grep -o 'cov: [0-9]*' | awk '{print $2}')
  if ((rc != 0)); then
    status=1
    echo "fuzz: $t FAILED (exit $rc); log $log, inputs in $crashes/"
    grep -E 'ERROR|SUMMARY|fuzz property|internal check' "$log" | head -5 || true
  fi
  summary+=("$(printf '%-12s %6ss %12s execs  cov %-6s %s' "$t" "$seconds" "${execs:-?}" "${cov:-?}" \
    "$( ((rc == 0)) && echo ok || echo FINDING)")")
  printf '%s\t%s\t%s\t%s\t%s\n' "$(date -u +%FT%TZ)" "$t" "$seconds" "${execs:-?}" "$rc" >>"$dir/fuzz-log.tsv"
done
echo "fuzz summary:"
printf '  %s\n' "${summary[@]}"
exit $status
