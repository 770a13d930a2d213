#!/usr/bin/env bash
# One call on the GPU machine: GPU tests, benchmark next to torch SDPA, compute-sanitizer.
#   bench/cuda/gpu_run.sh BIN_DIR OUT_DIR
# BIN_DIR holds kvq_cuda_tests and kvq_cuda_bench (built with -DKVQ_CUDA=ON) and, if the machine
# lacks it, libxxhash.so.0; OUT_DIR receives the logs. Every step has its own time limit.
# BASE=DIR: DIR's kvq_cuda_bench (another build: the version before a change) runs right after,
# with BASE_ARGS, and the table gets its times as "before" columns (same call, same card); so
# does DIR's kvq_cuda_rans_bench, where both builds have one (same RANS_ARGS).
set -uo pipefail
bin="$1"; out="$2"; here="$(cd "$(dirname "$0")" && pwd)"
export LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv; } | tee "$out/env.txt"
timeout 240 "$bin/kvq_cuda_tests" --gtest_brief=1 2>&1 | tee "$out/tests.log" | grep -v "^decode error" | tail -25
echo "tests rc=$?"
# The decode kernel's error against the CPU backend, largest over the test's appends, per case
# (sorted by the figure after the last ': ', specs hold colons too).
grep "^decode error" "$out/tests.log" | awk -F': ' '{print $NF "\t" $0}' | sort -g | tail -3 | cut -f2-
timeout 200 "$bin/kvq_cuda_bench" ${BENCH_ARGS:-} > "$out/bench.jsonl" 2>> "$out/env.txt"
echo "bench rc=$?"
base_arg=()
if [[ -n "${BASE:-}" ]]; then
  timeout 200 "$BASE/kvq_cuda_bench" ${BASE_ARGS:-} > "$out/bench_base.jsonl" 2>> "$out/env.txt"
  echo "base bench rc=$?"
  base_arg=(--base "$out/bench_base.jsonl")
fi
python3 "$here/sdpa_compare.py" "$out/bench.jsonl" "${base_arg[@]}" 2>&1 | tee "$out/table.md"
# The GPU decoder of the symbol streams (CacheGen's rANS) against the CPU's, when built.
if [[ -x "$bin/kvq_cuda_rans_bench" ]]; then
  timeout 150 "$bin/kvq_cuda_rans_bench" ${RANS_ARGS:-} > "$out/rans.jsonl" 2>> "$out/env.txt"
  echo "rans bench rc=$?"
  rans_base=()
  if [[ -n "${BASE:-}" && -x "$BASE/kvq_cuda_rans_bench" ]]; then
    timeout 150 "$BASE/kvq_cuda_rans_bench" ${RANS_ARGS:-} > "$out/rans_base.jsonl" 2>> "$out/env.txt"
    echo "base rans bench rc=$?"
    rans_base=("$out/rans_base.jsonl")
  fi
  python3 - "$out/rans.jsonl" "${rans_base[@]}" <<'PY' | tee "$out/rans.md"
import json, sys
def rows(path):
    return [json.loads(l) for l in open(path) if l.startswith("{")]
def key(r):
    return (r["bench"], r["bits"], r["part"], r["tables"], r["order"])
base = {key(r): r for r in rows(sys.argv[2])} if len(sys.argv) > 2 else None
extra = " before: GB/s | after / before |" if base is not None else ""
print("| bench | bits | part | tables | output order | bits/symbol | GPU ms | GPU GB/s fp16-equiv. | coded GB/s | CPU 1 thread GB/s |" + extra)
print("|---|---:|---|---|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if base is not None else ""))
for r in rows(sys.argv[1]):
    line = (f"| {r['bench']} | {r['bits']} | {r['part']} | {r['tables']} | {r['order']}-major | "
            f"{r['bits_per_symbol']:.3f} | {r['gpu_ms']:.3f} | {r['gpu_fp16_gbps']:.0f} | "
            f"{r['gpu_coded_gbps']:.0f} | {r['cpu_1t_fp16_gbps']:.2f} |")
    if base is not None:
        b = base.get(key(r))
        line += (f" {b['gpu_fp16_gbps']:.0f} | {r['gpu_fp16_gbps'] / b['gpu_fp16_gbps']:.2f}x |"
                 if b else " | |")
    print(line)
PY
fi
# memcheck: every GPU test but the one that asks for 2^50 bytes on purpose (its cudaMalloc error is
# reported as an API error) and the 1,600-append pool test (too slow under the tool).
SAN_FILTER="${SAN_FILTER:--CudaMemory.OutOfMemoryIsAClearError:CudaMemory.DecodeAppendsDoNotCallCudaMalloc}"
timeout 240 compute-sanitizer --tool memcheck --leak-check full --error-exitcode 3 \
  "$bin/kvq_cuda_tests" --gtest_brief=1 --gtest_filter="$SAN_FILTER" > "$out/memcheck.log" 2>&1
echo "memcheck rc=$?"; tail -4 "$out/memcheck.log"
# racecheck: the kernels that share memory between threads (decode at both head dims and bit
# widths, the generic kernel, the combine; the append's sealing CTAs).
RACE_FILTER="${RACE_FILTER:-CudaRans.*:CudaAttendDtypes.*:Shapes/CudaAttend.*/c1_*:Shapes/CudaAttend.*/c13_*:Shapes/CudaAttend.*/c21_*:Shapes/CudaAttend.*/c33_*:Methods/CudaCache.StoresTheCpuBackendsBytes/m1:Methods/CudaCache.StoresTheCpuBackendsBytes/m4}"
timeout 150 compute-sanitizer --tool racecheck --error-exitcode 3 \
  "$bin/kvq_cuda_tests" --gtest_brief=1 --gtest_filter="$RACE_FILTER" > "$out/racecheck.log" 2>&1
echo "racecheck rc=$?"; tail -4 "$out/racecheck.log"
if [[ -n "${NCU:-}" ]]; then
  for shp in "16,32,8,128,32768" "1,32,8,128,131072"; do
    timeout 100 ncu --clock-control none -k regex:"fast_kernel|combine" -s 3 -c 2 --section SpeedOfLight \
      --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --section WarpStateStats \
      --metrics smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio \
      "$bin/kvq_cuda_bench" --shapes "$shp" --methods "kivi:k_bits=2,v_bits=2,group=32" \
      --iters 1 --model none > "$out/ncu_${shp%%,*}.txt" 2>&1
    echo "ncu rc=$?"; grep -E "fast_kernel|combine_kernel|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|inst_executed|issue_active|stalled|Executed Ipc A|Issue Slots Busy" "$out/ncu_${shp%%,*}.txt" | grep -v "^==PROF" | head -40
  done
fi
if [[ -n "${NCU:-}" ]]; then  # one KIVI 2/2 append chunk (2048 tokens x 16 sequences)
  timeout 100 ncu --clock-control none -k regex:append_kernel -s 2 -c 1 --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --metrics smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum \
    "$bin/kvq_cuda_bench" --shapes "16,32,8,128,32768" --methods "kivi:k_bits=2,v_bits=2,group=32" \
    --iters 1 --model none > "$out/ncu_append.txt" 2>&1
  echo "ncu append rc=$?"; grep -E "append_kernel|Duration|DRAM Throughput|Memory Throughput|inst_executed|issue_active|bank_conflicts" "$out/ncu_append.txt" | grep -v "^==PROF" | head -12
fi
if [[ -n "${SASS:-}" ]]; then  # the 2-bit head_dim-128 decode kernel's machine code
  cuobjdump -sass "$bin/kvq_cuda_bench" | awk '/Function : /{p = /fast_kernelILi128ELi1ELi2ELi2ELi0E/} p' > "$out/sass.txt"
  echo "sass lines: $(wc -l < "$out/sass.txt")"
fi
