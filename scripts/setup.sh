#!/usr/bin/env bash
# Set up .venv in the repo root: torch's CPU build first (so nothing pulls a multi-GB CUDA
# build as a dependency of nixl), then this project with its test extra. Re-running is fast:
# a stamp of pyproject.toml skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-}
if [ -z "$python" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python=$candidate; break; fi
  done
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
venv_py=.venv/bin/python

extras=${NIXL_ASYNC_EXTRAS:-test}
stamp=".venv/.nixl-async-$(sha256sum pyproject.toml | cut -c1-16)-${extras//,/_}"
if [ -f "$stamp" ] && "$venv_py" -c "import nixl_async, nixl, torch" >/dev/null 2>&1; then
  exit 0
fi

"$venv_py" -m pip install -q --upgrade pip
if ! "$venv_py" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch 2.13.0 (CPU build) before anything that depends on it"
  "$venv_py" -m pip install -q "torch==2.13.0"
fi
echo "setup: installing nixl-async[$extras] and its dependencies"
"$venv_py" -m pip install -q -e ".[$extras]"
rm -f .venv/.nixl-async-*
touch "$stamp"
