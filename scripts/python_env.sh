#!/usr/bin/env bash
# The Python side of kvq: a virtual environment in .venv (Debian's python3), the package's build,
# runtime and test dependencies (read from pyproject.toml, the one list), and the package itself.
#
#   scripts/python_env.sh deps        the venv and the dependencies (a no-op when satisfied)
#   scripts/python_env.sh install     deps, then `pip install .` of this tree (build-py/ caches
#                                     the CMake build, so a rebuild compiles only what changed)
#
# KVQ_HF=1 adds the `hf` extra: torch and transformers, for kvq.hf and its tests. torch from PyPI
# is a CUDA build: ~5.6 GB in the venv, ~80 s to install on a fast link; once installed, later
# runs find it satisfied and download nothing.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
venv="$repo/.venv"
py="$venv/bin/python"

if [[ ! -x "$py" ]]; then
  echo "python_env: creating $venv"
  /usr/bin/python3 -m venv "$venv"
fi
pip=("$py" -m pip --disable-pip-version-check -q)

# Build requirements, runtime dependencies and the wanted extras, from pyproject.toml.
extras="test"
[[ "${KVQ_HF:-0}" == 1 ]] && extras="test,hf"
mapfile -t reqs < <("$py" - "$extras" <<'EOF'
import sys, tomllib
meta = tomllib.load(open("pyproject.toml", "rb"))
reqs = meta["build-system"]["requires"] + meta["project"]["dependencies"]
for extra in sys.argv[1].split(","):
    reqs += meta["project"]["optional-dependencies"][extra]
print("\n".join(reqs))
EOF
)
"${pip[@]}" install "${reqs[@]}"

if [[ "${1:-deps}" == install ]]; then
  # The dependencies are in place, so the build needs no isolated environment of its own (and
  # the CMake cache in build-py/ stays valid from one run to the next).
  "${pip[@]}" install --no-build-isolation --no-deps .
fi
