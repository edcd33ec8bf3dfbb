# Sourced by the device scripts (gpu-check.sh, gpu-tcp-check.sh); defines `gpu_env MODULES CALLER`.
#
# With ROOT set, it picks the Python (PY: $PYTHON, else a checkout's .venv, else the device image's
# python3), installs the carried wheels (.whl/, scripts/gpu-wheels.sh) into /tmp/site where that
# Python cannot import MODULES (comma-separated, as `import` takes them), and makes this checkout
# importable under the names pyproject.toml maps (nixl_async, nixl_async_benchmarks, nixl_async_vllm)
# without installing it: SRC, a folder of links, first on PYTHONPATH (the caller removes it).
# Returns 1 where a module is missing and no wheels were carried.

gpu_env() {
    local modules="$1" caller="$2"
    if [[ -n "${PYTHON:-}" ]]; then
        PY="$PYTHON"
    elif [[ -x "$ROOT/.venv/bin/python" ]]; then
        PY="$ROOT/.venv/bin/python"  # a developer's checkout
    else
        PY=python3  # the device: the image's Python, with CUDA torch
    fi
    if ! "$PY" -c "import $modules" 2>/dev/null; then
        if ! compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
            echo "$caller: $PY cannot import $modules and no wheels were carried:" \
                "run scripts/gpu-wheels.sh here and carry .whl" >&2
            return 1
        fi
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site "$ROOT"/.whl/*.whl || return 1
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    SRC="$(mktemp -d /tmp/nixl-async-src.XXXXXX)"
    ln -s "$ROOT/nixl_async" "$SRC/nixl_async"
    ln -s "$ROOT/benchmarks" "$SRC/nixl_async_benchmarks"
    ln -s "$ROOT/adapters/vllm" "$SRC/nixl_async_vllm"
    export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
}
