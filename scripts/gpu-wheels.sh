#!/usr/bin/env bash
# Download the wheels the lent GPU machine lacks into .whl/ (run here, where pip reaches PyPI).
#
# The device image has Python 3.12 with CUDA torch (cu130), numpy, uvloop, anyio, tqdm and pytest,
# but no NIXL, msgspec, pyzmq or pytest-asyncio. Its command then installs them from the carried folder:
# see scripts/gpu-check.sh and docs/gpu.md. Everything that travels to the device is limited to
# 64 MiB (working tree + carried paths), so this fails when the wheels pass 60 MiB.
#
# Usage: bash scripts/gpu-wheels.sh [DEST]   (DEST defaults to .whl in the repository root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/.whl}"
LIMIT_MIB="${GPU_WHEELS_LIMIT_MIB:-60}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3

# Exactly what the device lacks, pinned to the versions this project is tested with.
# `nixl` is the meta package (pure Python, picks nixl_cuXX by torch's CUDA major: 13 there);
# nixl-cu13 carries NIXL, its plugins and UCX (cuda_ipc / cuda_copy transports included).
WHEELS=(
    "nixl==1.5.1"
    "nixl-cu13==1.5.1"
    "msgspec==0.22.0"
    "pyzmq==27.3.0"
    "pytest==9.2.0"  # with pytest-asyncio: scripts/gpu-tcp-check.sh runs real-NIXL tests there
    "pytest-asyncio==1.5.0"
)

# Keep the folder out of git (it must never be committed), once.
if [[ "$DEST" == "$ROOT/.whl" ]]; then
    exclude="$(git -C "$ROOT" rev-parse --git-path info/exclude 2>/dev/null || echo "$ROOT/.git/info/exclude")"
    [[ "$exclude" = /* ]] || exclude="$ROOT/$exclude"
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
fi

mkdir -p "$DEST"
# One version of each: a stale wheel of another version would stop the whole install there.
for spec in "${WHEELS[@]}"; do
    name="${spec%%==*}"
    stem="${name//-/_}"
    find "$DEST" -maxdepth 1 -name "${stem}-*.whl" ! -name "${stem}-${spec##*==}-*.whl" -print -delete
done

# PIP_CONSTRAINT is cleared: a machine-wide constraints file must not pin these target wheels.
PIP_CONSTRAINT="" "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$DEST" "${WHEELS[@]}"

ls -l "$DEST"/*.whl
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
total_mib=$(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "total: $total bytes (${total_mib} MiB) in $(ls "$DEST"/*.whl | wc -l) wheels; limit ${LIMIT_MIB} MiB"
if (( total > LIMIT_MIB << 20 )); then
    echo "error: the wheels exceed ${LIMIT_MIB} MiB; with the working tree they would not fit the device's 64 MiB" >&2
    exit 1
fi
