#!/usr/bin/env bash
# Cache speed of two kvq builds side by side (kvq's own method against KIVI), pinned to core 1,
# one thread, the builds alternated per measurement; best of the rounds is what to read.
#   scripts/kvq_speed_ab.sh OLD_KVQ [NEW_KVQ] [ROUNDS]      (NEW_KVQ defaults to build/kvq)
# Prints one JSON line per run: {"side", "round", "what": "bench" | "ppl", "spec", "r": output}.
#   bench: kvq bench --input $KVQ_KV (a dump-kv file of real K/V; default
#          /work/runs/kv_test2048.safetensors) --min-time 0.5 --json
#   ppl:   kvq ppl --ctx 1024 --windows 1 --method kvq --method kivi --json (fp16, kvq, KIVI 2/2
#          over one window of data/sotu_sample.txt; tokens_per_s per cache)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
old="$1"; new="${2:-$repo/build/kvq}"; rounds="${3:-3}"
kv="${KVQ_KV:-/work/runs/kv_test2048.safetensors}"
cd "$repo"
for round in $(seq "$rounds"); do
  for m in kvq kvq:k_bits=2,v_bits=2 kivi:k_bits=2,v_bits=2 kivi:k_bits=3,v_bits=3; do
    for b in old new; do
      bin=$old; [[ $b == new ]] && bin=$new
      r=$(taskset -c 1 "$bin" bench --method "$m" --input "$kv" --min-time 0.5 --json | tr -d '\n')
      echo "{\"side\":\"$b\",\"round\":$round,\"what\":\"bench\",\"spec\":\"$m\",\"r\":$r}"
    done
  done
  for b in old new; do
    bin=$old; [[ $b == new ]] && bin=$new
    r=$(taskset -c 1 "$bin" ppl --threads 1 --quiet --json --ctx 1024 --windows 1 \
      --method kvq --method kivi | tr -d '\n')
    echo "{\"side\":\"$b\",\"round\":$round,\"what\":\"ppl\",\"spec\":\"kvq,kivi\",\"r\":$r}"
  done
done
