#!/usr/bin/env bash
# Set up (if needed, vLLM included), lint (ruff), type-check (mypy), then run the whole test suite on real NIXL
# and, for the adapter, real vLLM (the end-to-end P/D tests start vLLM servers: ~2 min). Extra arguments go to pytest.
# pytest's exit code 5 ("no tests collected") is a failure here, never a silent pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
bash scripts/setup-vllm.sh || exit 1
export NIXL_ASYNC_REQUIRE_VLLM=1  # the vLLM tests must run here, never skip
if [ "$(id -u)" -eq 0 ]; then
  # As root (CI) the tests across network namespaces must run, never skip; they need iproute2 (ip, tc, ss).
  export NIXL_ASYNC_REQUIRE_NETNS=1
  # Likewise the tests of discovery through etcd: they start Debian's etcd-server on loopback.
  export NIXL_ASYNC_REQUIRE_ETCD=1
  packages=""
  if ! command -v ip >/dev/null || ! command -v tc >/dev/null || ! command -v ss >/dev/null; then
    packages="iproute2"
  fi
  command -v etcd >/dev/null || packages="$packages etcd-server"
  if [ -n "$packages" ]; then
    # shellcheck disable=SC2086
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages) >/dev/null || exit 1
  fi
fi
.venv/bin/ruff check . || exit 1
.venv/bin/mypy nixl_async adapters/vllm benchmarks examples || exit 1
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
