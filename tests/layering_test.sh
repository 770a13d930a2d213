#!/usr/bin/env bash
# The library's layers include only downwards (docs/architecture.md):
#   core < numerics < entropy < cache < methods < format < store < model (the engine) < tools
# (cuda, the CUDA backend, sits beside format: above methods, whose stored layouts it shares;
# the store is engine-agnostic: it may not include the engine)
# A file of layer L may include headers of layers <= L, public headers (include/kvq/*.h)
# included by the layer they belong to. Exits non-zero naming every upward include.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
declare -A rank=([core]=0 [numerics]=1 [entropy]=2 [cache]=3 [methods]=4 [format]=5 [cuda]=5 [store]=6
                 [model]=7)
# Public headers and the layer that implements them.
declare -A public=([status]=core [dtype]=core [tensor]=core [spec]=core [thread_pool]=core
                   [workspace]=core [synthetic]=core [version]=core [bitpack]=numerics
                   [group_quant]=numerics [zipcache]=numerics [cache]=cache [container]=format [cuda]=cuda
                   [safetensors]=format [store]=store)
bad=0
for layer in "${!rank[@]}"; do
  for f in "$repo"/src/"$layer"/*.cc "$repo"/src/"$layer"/*.h "$repo"/src/"$layer"/*.cu \
           "$repo"/src/"$layer"/*.cuh; do
    [[ -e "$f" ]] || continue
    while IFS= read -r inc; do
      dir="${inc%%/*}"
      name="${inc#*/}"; name="${name%.h}"
      if [[ "$dir" == kvq ]]; then
        target="${public[$name]:-}"
        if [[ -z "$target" ]]; then
          echo "layering: ${f#$repo/} includes kvq/$name.h, which has no layer in $0"; bad=1; continue
        fi
      else
        target="$dir"
      fi
      if [[ -z "${rank[$target]:-}" ]]; then
        echo "layering: ${f#$repo/} includes $inc (not a library layer)"; bad=1
      elif (( rank[$target] > rank[$layer] )); then
        echo "layering: ${f#$repo/} ($layer) includes $inc ($target): an upward include"; bad=1
      fi
    done < <(grep -ho '^#include "[a-z_]*/[a-z_0-9]*\.h"' "$f" | sed 's/#include "\(.*\)"/\1/')
  done
done
# Public headers may include only headers of their own layer or below.
for h in "$repo"/include/kvq/*.h; do
  name="$(basename "$h" .h)"
  own="${public[$name]:-}"
  [[ -n "$own" ]] || { echo "layering: include/kvq/$name.h has no layer in $0"; bad=1; continue; }
  while IFS= read -r inc; do
    dep="${public[$inc]:-}"
    if [[ -z "$dep" ]] || (( rank[$dep] > rank[$own] )); then
      echo "layering: include/kvq/$name.h ($own) includes kvq/$inc.h (${dep:-?})"; bad=1
    fi
  done < <(grep -ho '^#include "kvq/[a-z_0-9]*\.h"' "$h" | sed 's/#include "kvq\/\(.*\)\.h"/\1/')
done
if (( bad )); then exit 1; fi
echo "layering: no upward includes"
