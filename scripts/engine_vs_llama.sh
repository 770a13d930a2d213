#!/usr/bin/env bash
# kvq's engine against llama.cpp's, on the same GGUF and machine, in one run (issue 15, part 4).
#
#   scripts/engine_vs_llama.sh LLAMA_BENCH [path/to/kvq] > results/raw/engine_vs_llama.txt
#
# LLAMA_BENCH: llama.cpp's llama-bench, built beside kvq (never part of kvq), e.g.
#   cmake -S llama.cpp -B build-llama -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF
#   cmake --build build-llama --target llama-bench
# Prefill: a prompt of 512 and of 8064 tokens from scratch (kvq generate's prompt figure,
# llama-bench's pp512 / pp8064). Decode: 128 new tokens after a 512- and an 8064-token prompt
# (kvq generate's new-token figure, llama-bench's tg128 at depth 512 / 8064), kvq with its fp16
# cache and with KIVI 2/2, llama.cpp with its default f16 KV cache. Rounds alternate between the
# engines (ROUNDS, default 2); every figure is printed, so the spread is visible. 8064 + 128 new
# tokens = 8192, the context SmolLM2 was trained to.
# Environment: THREADS (default: all cores), ROUNDS, TEXT (default wikitext-2 test).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bench="${1:?usage: engine_vs_llama.sh LLAMA_BENCH [KVQ]}"
kvq="${2:-$repo/build/kvq}"
model="$repo/models/SmolLM2-135M-Instruct.Q4_1.gguf"
text="${TEXT:-$repo/../shared/data/wikitext-2/test.txt}"
threads="${THREADS:-$(nproc)}"
rounds="${ROUNDS:-2}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# A prompt of exactly N tokens under kvq's tokenizer (the same vocabulary llama.cpp reads from
# the GGUF): the longest prefix of the text, cut at a space, that tokenizes to at most N.
prompt_of() {
  python3 - "$kvq" "$model" "$text" "$1" "$tmp/p$1.txt" <<'EOF'
import json, subprocess, sys
kvq, model, text, n, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
words = open(text).read().split(" ")
def count(k):
    open(out, "w").write(" ".join(words[:k]))
    r = subprocess.run([kvq, "tokenize", "--model", model, "--text", out, "--json"],
                       check=True, capture_output=True, text=True)
    return len(json.loads(r.stdout))
lo, hi = 1, n
while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if count(mid) <= n else (lo, mid - 1)
print(count(lo))
EOF
}

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); threads $threads"
echo "kvq: $("$kvq" --version 2>/dev/null || echo "$kvq"); llama-bench: $bench"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for n in 512 8064; do echo "prompt $n: $(prompt_of $n) tokens"; done

for r in $(seq "$rounds"); do
  echo
  echo "== round $r"
  for n in 512 8064; do
    for m in fp16 kivi:k_bits=2,v_bits=2; do
      echo "kvq ctx $n $m: $("$kvq" generate --threads "$threads" --method "$m" \
        --prompt-file "$tmp/p$n.txt" -n 128 2>&1 >/dev/null | tail -1)"
    done
  done
  "$bench" -m "$model" -t "$threads" -r 1 -p 512,8064 -n 0 -o md 2>/dev/null | grep -E '^\|'
  "$bench" -m "$model" -t "$threads" -r 1 -p 0 -n 128 -d 512,8064 -o md 2>/dev/null | grep -E '^\|'
  echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
done
