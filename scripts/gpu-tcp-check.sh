#!/usr/bin/env bash
# UCX over TCP on a GPU host (docs/gpu.md), in one device command after scripts/gpu-wheels.sh:
#
#   device run: carry [".whl"], command "bash scripts/gpu-tcp-check.sh"
#
# NIXL 1.5 refuses to start its UCX backend with UCX_TLS=tcp where the host has NVIDIA GPUs, so
# this checks, on such a host: (1) the engine's start fails with BackendStartError naming UCX_TLS
# and the fix, and starts with the TLS the test harness uses there (nixl_async.testing.TCP_TLS);
# (2) the real-NIXL tests that move bytes over TCP; (3) the engine-only TCP benchmarks (CPU per
# byte in flight, small reads, 10 k in flight, throughput), on this host's cores. Results: $OUT
# (else ./out): gpu-tcp-check.log, bench.json, bench.log. Needs pytest-asyncio among the wheels.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$ROOT/out}"
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/gpu-tcp-check.log"

# shellcheck source=scripts/gpu-env.sh
source "$ROOT/scripts/gpu-env.sh"
gpu_env nixl,msgspec,zmq,pytest_asyncio gpu-tcp-check.sh || exit 1
export PYTHONUNBUFFERED=1
cd "$ROOT" || exit 1

rc=0
gpus="$("$PY" -c 'from nixl_async._host import nvidia_gpus; print(nvidia_gpus())')"
{
    echo "== host: $(nproc) cores, $gpus NVIDIA GPU(s) on the PCI bus"
    echo "== (1) engine start under each UCX_TLS (tcp: refused, naming UCX_TLS, where there is a GPU; TCP_TLS: started)"
    tcp_tls="$("$PY" -c 'from nixl_async.testing import TCP_TLS; print(TCP_TLS)')"
    for tls in tcp "$tcp_tls"; do
        expect=started
        [[ "$tls" == tcp && "$gpus" != 0 ]] && expect=refused
        UCX_TLS="$tls" EXPECT="$expect" timeout 60 "$PY" - <<'EOF' 2>&1 | grep -v '^E[0-9]'
import asyncio, os, sys
from nixl_async import BackendStartError, EngineConfig, TransferEngine

async def main() -> str:
    engine = TransferEngine(EngineConfig())
    try:
        await engine.start()
        return "started"
    except BackendStartError as exc:
        print(f"  BackendStartError: {exc}")
        return "refused" if "UCX_TLS" in str(exc) else "refused without naming UCX_TLS"
    finally:
        await engine.close()

got = asyncio.run(main())
print(f"UCX_TLS={os.environ['UCX_TLS']}: {got} (expected: {os.environ['EXPECT']})")
sys.exit(got != os.environ["EXPECT"])
EOF
        [[ ${PIPESTATUS[0]} == 0 ]] || rc=1
    done
    echo "== (2) real-NIXL tests over TCP"
    plugin=(-p nixl_async.testing)  # the project's pytest plugin, where no install registered it
    "$PY" -c 'import importlib.metadata as m, sys
sys.exit(not any(e.value == "nixl_async.testing" for e in m.entry_points(group="pytest11")))' && plugin=()
    timeout -k 10 200 "$PY" -m pytest "${plugin[@]}" -p no:cacheprovider -q -x \
        tests/core/test_host.py tests/engine/test_backend_start.py tests/engine/test_tcp_segments.py \
        tests/reliability/test_memory_quiet.py tests/sync/test_facade_quiet.py || rc=1
    echo "== (3) engine-only TCP benchmarks"
    timeout -k 10 240 "$PY" -m nixl_async.cli bench --quick --json "$OUT_DIR/bench.json" \
        busy small_reads inflight throughput_tcp >"$OUT_DIR/bench.log" 2>&1 || rc=1
    sed -n '/== goals/,$p' "$OUT_DIR/bench.log"
    exit "$rc"
} 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
rm -rf "$SRC"
echo "gpu-tcp-check.sh: exit $rc"
exit "$rc"
