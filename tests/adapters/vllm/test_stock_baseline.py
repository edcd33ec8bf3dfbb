"""The side-by-side benchmarks' NixlConnector (`benchmarks/stock_nixl.py`) keeps the placement the
benchmark gives it: vLLM's own connector would move its model thread onto a "reserved KV core"."""

import subprocess
import sys
import textwrap
from pathlib import Path

CHECK = textwrap.dedent(
    """
    import inspect
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    init = inspect.getsource(base_worker.NixlBaseConnectorWorker.__init__)
    # The patch takes effect only while vLLM picks the cores it moves to with this call.
    assert "discover_numa_topology()" in init and "sched_setaffinity" in init, "vLLM moved its affinity call"
    before = base_worker.current_platform.discover_numa_topology()
    import nixl_async_benchmarks.stock_nixl  # noqa: F401

    print(repr(before), repr(base_worker.current_platform.discover_numa_topology()))
    """
)


def test_stock_connector_keeps_the_benchmarks_cpu_placement():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after = proc.stdout.strip().splitlines()[-1].rsplit(" ", 1)
    assert after == "[]"  # no reserved core: the connector leaves its thread where the launcher bound it
    if Path("/sys/devices/system/node/node0").exists():  # vLLM finds NUMA nodes here: unpatched, it names cores
        assert before != "[]"
