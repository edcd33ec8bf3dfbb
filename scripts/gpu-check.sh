#!/usr/bin/env bash
# The GPU check (issue 15, docs/gpu.md) in one command, on the lent GPU machine:
#
#   here:       bash scripts/gpu-wheels.sh        # once: NIXL, msgspec, pyzmq wheels into .whl/
#   device run: carry [".whl"], command "bash scripts/gpu-check.sh"
#
# Installs the carried wheels into /tmp/site when the Python there lacks them, makes this
# checkout importable under the names pyproject.toml maps (nixl_async, nixl_async_benchmarks,
# nixl_async_vllm) without installing it, puts the CUDA runtime pip installed with torch on the
# library path (UCX's CUDA memory hooks need libcudart), and runs
# `python -m nixl_async_benchmarks.gpu_check`. Results: $OUT (the device's output folder), else
# ./out: gpu-check.md, gpu-check.json, gpu-check.log, nvidia-smi.txt. Extra arguments go to the
# check (--quick, --cpu-dry-run, --tput-mib N, ...). On a machine without CUDA the check stops
# before the GPU part: exit 0 with --cpu-dry-run, 2 without.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$ROOT/out}"
mkdir -p "$OUT_DIR"
# shellcheck source=scripts/gpu-env.sh
source "$ROOT/scripts/gpu-env.sh"
gpu_env nixl,msgspec,zmq gpu-check.sh || exit 1

# NVIDIA's pip-installed CUDA libraries (nvidia/<pkg>/lib, nvidia/cu13/lib): UCX's CUDA modules
# link libcudart by name. Only folders that hold a libcudart are added.
NV_LIBS="$("$PY" - <<'EOF'
import glob, os, sys
dirs = []
for base in sys.path:
    for d in sorted(glob.glob(os.path.join(base or ".", "nvidia", "*", "lib"))):
        if glob.glob(os.path.join(d, "libcudart.so*")) and d not in dirs:
            dirs.append(d)
print(":".join(dirs))
EOF
)"
if [[ -n "$NV_LIBS" ]]; then
    export LD_LIBRARY_PATH="$NV_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

export PYTHONUNBUFFERED=1
export GPU_CHECK_INVOKED_AS="bash scripts/gpu-check.sh${*:+ $*}"  # recorded in the summary
# UCX prints each protocol it selects (look for cuda_ipc / cuda_copy in gpu-check.log).
export UCX_PROTO_INFO="${UCX_PROTO_INFO:-y}"

if command -v nvidia-smi >/dev/null; then
    # the topology and NVLink state decide whether UCX offers cuda_ipc GET (docs/gpu.md)
    { nvidia-smi; nvidia-smi topo -m; nvidia-smi nvlink -s; } >"$OUT_DIR/nvidia-smi.txt" 2>&1 || true
fi
echo "gpu-check.sh: $("$PY" -V 2>&1) at $(command -v "$PY"), out: $OUT_DIR"

timeout -k 10 570 "$PY" -m nixl_async_benchmarks.gpu_check --out "$OUT_DIR" "$@" 2>&1 | tee "$OUT_DIR/gpu-check.log"
rc=${PIPESTATUS[0]}
rm -rf "$SRC"
echo "gpu-check.sh: exit $rc"
exit "$rc"
