#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, benchmark next to torch SDPA, compute-sanitizer.
#   bench/cuda/gpu_run.sh BIN_DIR OUT_DIR
# BIN_DIR holds kvq_cuda_tests and kvq_cuda_bench (built with -DKVQ_CUDA=ON) and, if the machine
# lacks it, libxxhash.so.0; OUT_DIR receives the logs. Every step has its own time limit.
set -uo pipefail
bin="$1"; out="$2"; here="$(cd "$(dirname "$0")" && pwd)"
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv; } | tee "$out/env.txt"
timeout 240 "$bin/kvq_cuda_tests" --gtest_brief=1 2>&1 | tee "$out/tests.log" | tail -25
echo "tests rc=$?"
timeout 200 "$bin/kvq_cuda_bench" ${BENCH_ARGS:-} > "$out/bench.jsonl" 2> "$out/bench.err"
echo "bench rc=$?"; cat "$out/bench.err"
python3 "$here/sdpa_compare.py" "$out/bench.jsonl" 2>&1 | tee "$out/table.md"
SAN_FILTER="${SAN_FILTER:-Methods/CudaCache.*/m1:Methods/CudaCache.*/m4:Shapes/CudaAttend.*/c1_*:Shapes/CudaAttend.*/c13_*:Shapes/CudaAttend.*/c31_*:Shapes/CudaAttend.*/c33_*}"
timeout 150 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 3 \
  "$bin/kvq_cuda_tests" --gtest_brief=1 --gtest_filter="$SAN_FILTER" > "$out/memcheck.log" 2>&1
echo "memcheck rc=$?"; tail -4 "$out/memcheck.log"
timeout 90 compute-sanitizer --tool racecheck --error-exitcode 3 \
  "$bin/kvq_cuda_tests" --gtest_brief=1 --gtest_filter="Shapes/CudaAttend.*/c13_*:Methods/CudaCache.StoresTheCpuBackendsBytes/m1" > "$out/racecheck.log" 2>&1
echo "racecheck rc=$?"; tail -4 "$out/racecheck.log"
if [[ -n "${NCU:-}" ]]; then
  timeout 150 ncu --clock-control none -k regex:fast_kernel -s 3 -c 1 --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
    "$bin/kvq_cuda_bench" --shapes "16,32,8,128,32768" --methods "kivi:k_bits=2,v_bits=2,group=32" \
    --iters 1 > "$out/ncu.txt" 2>&1
  echo "ncu rc=$?"; grep -E "Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Stall|Issue" "$out/ncu.txt" | head -30
fi
