#!/usr/bin/env bash
# Speed of kvq's model engine on SmolLM2-135M (docs/engine.md reports these figures):
#   1. prefill and decode tokens/s of one sequence with the fp16 cache (kvq generate, a
#      ~2000-token prompt, 128 new tokens);
#   2. the wall time of a 4 x 2048-token teacher-forced evaluation of fp16 + KIVI (kvq ppl).
# The machine's load average is printed first: figures taken while other jobs run are slower.
#
#   scripts/bench_engine.sh [path/to/kvq]        (default build/kvq)
# Environment: TEXT (default data/sotu_sample.txt), THREADS (default: all cores).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
kvq="${1:-$repo/build/kvq}"
text="${TEXT:-$repo/data/sotu_sample.txt}"
threads=()
[[ -n "${THREADS:-}" ]] && threads=(--threads "$THREADS")

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"

# A prompt of about 2000 tokens: the first ~9000 bytes of the text, cut at a space.
prompt="$(head -c 9000 "$text")"
prompt="${prompt% *}"
echo
echo "== kvq generate (fp16 cache), ~2000-token prompt, 128 new tokens"
"$kvq" generate "${threads[@]}" --prompt "$prompt" -n 128 2>&1 >/dev/null | tail -1

echo
echo "== kvq ppl, 4 windows x 2048 tokens (1920 prefill + 128 decode), fp16 + kivi"
start=$(date +%s%N)
"$kvq" ppl "${threads[@]}" --text "$text" --ctx 2048 --windows 4 --method kivi --quiet
end=$(date +%s%N)
ms=$(( (end - start) / 1000000 ))
printf "wall time: %d.%d s\n" $((ms / 1000)) $(((ms % 1000) / 100))
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
