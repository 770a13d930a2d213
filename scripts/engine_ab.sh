#!/usr/bin/env bash
# Engine speed of two kvq builds side by side: `kvq generate` with a ~1000-token prompt, one
# thread pinned to core 0, the builds alternated three times per cache (take the best of each).
#   scripts/engine_ab.sh OLD_KVQ [NEW_KVQ]        (NEW_KVQ defaults to build/kvq)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
old="$1"; new="${2:-$repo/build/kvq}"
prompt="$(head -c 5000 "$repo/data/sotu_sample.txt")"; prompt="${prompt% *}"
for round in 1 2 3; do
  for m in fp16 kivi; do
    for b in old new; do
      bin=$old; [[ $b == new ]] && bin=$new
      echo "round $round $b $m: $(taskset -c 0 "$bin" generate --threads 1 --method "$m" \
        --prompt "$prompt" -n 32 2>&1 >/dev/null | tail -1)"
    done
  done
done
