"""The public surface: exports, the CLI demo and the example program, run for real."""

import json
import subprocess
import sys
from pathlib import Path

import nixl_async

ROOT = Path(__file__).resolve().parent.parent


def test_all_names_exist_and_are_sorted():
    for name in nixl_async.__all__:
        assert hasattr(nixl_async, name), name
    assert list(nixl_async.__all__) == sorted(nixl_async.__all__)
    assert (Path(nixl_async.__file__).parent / "py.typed").exists()


def test_demo_quick_writes_verified_json(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "nixl_async.cli", "demo", "--quick", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["verified"] is True
    assert report["bytes_moved"] == 4 * 128 * 8 * 65536
    assert report["throughput_gbps"] > 0 and report["request_latency_p99_us"] >= report["request_latency_p50_us"]
    assert 0 < report["completion_latency_p50_us"] <= report["completion_latency_p99_us"]
    assert "every byte verified: yes" in proc.stdout


def test_quickstart_example_runs():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "every byte matches" in proc.stdout and "after close: {} {}" in proc.stdout
