"""The GPU check (docs/gpu.md) starts on a machine without a GPU: imports, pattern and oracles,
summary, then a clear stop before the GPU part. Its shell scripts at least parse."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
MODULE = "nixl_async_benchmarks.gpu_check"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine the check really runs")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", MODULE, *args], capture_output=True, text=True, timeout=180, cwd=ROOT)


def test_dry_run_stops_before_the_gpu_checks_and_succeeds(tmp_path):
    proc = _run("--cpu-dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "CUDA not available: stopping before the GPU checks" in proc.stdout
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    assert summary["all_ok"] is True and summary["mode"] == "dry run"
    assert [c["name"] for c in summary["checks"]] == ["imports", "pattern_and_oracles"]
    assert "pattern_and_oracles | ok" in (tmp_path / "gpu-check.md").read_text()


def test_without_dry_run_it_fails_when_cuda_is_missing(tmp_path):
    proc = _run("--out", str(tmp_path))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "CUDA not available: stopping before the GPU checks" in proc.stdout


@pytest.mark.parametrize("script", ["gpu-check.sh", "gpu-env.sh", "gpu-tcp-check.sh", "gpu-wheels.sh"])
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_dry_run_without_vllm_imports_the_adapter_over_stand_ins(tmp_path):
    """The device has no vLLM: the adapter's worker must still import (over the check's stand-ins)."""
    hide_vllm = (
        "import sys, runpy; sys.modules['vllm'] = None; "  # 'import vllm' now raises ImportError
        f"sys.argv = ['gpu_check', '--cpu-dry-run', '--out', {str(tmp_path)!r}]; "
        f"runpy.run_module({MODULE!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", hide_vllm], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert (tmp_path / "gpu-check.json").exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    imports = next(c for c in summary["checks"] if c["name"] == "imports")
    assert imports["details"]["errors"] == {}, imports
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_adapter_checks_pass_on_the_cpu_stand_in_without_vllm(tmp_path):
    """What the device runs of the adapter (ConnectorWorker over the check's vLLM stand-ins, no vLLM
    installed), with host memory for VRAM: a worker that reads a field the stand-ins lack fails here,
    not in a GPU session's scarce device time (it did once: `RemoteMeta.num_tokens`)."""
    checks = "adapter_connector_worker_vram,adapter_host_staging_kernel_pages2"
    run_check = (
        "import sys, runpy; sys.modules['vllm'] = None; "
        f"sys.argv = ['gpu_check', '--device', 'cpu', '--quick', '--tput-mib', '32', '--only', {checks!r}, "
        f"'--out', {str(tmp_path)!r}]; "
        f"runpy.run_module({MODULE!r}, run_name='__main__')"
    )
    proc = subprocess.run([sys.executable, "-c", run_check], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert (tmp_path / "gpu-check.json").exists(), proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    ran = {c["name"]: c for c in summary["checks"]}
    assert set(checks.split(",")) <= ran.keys(), list(ran)
    for name in checks.split(","):
        assert ran[name]["ok"], ran[name]
        assert ran[name]["details"]["bad_bytes"] == [0, 0], ran[name]
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_the_model_step_check_runs_on_the_cpu_stand_in(tmp_path):
    """The model thread beside reads (docs/gpu.md): every set-up steps, the engine, vLLM's pattern and the other
    process all move bytes, and every destination holds exactly what was read (the other process checks its own)."""
    proc = _run("--device", "cpu", "--quick", "--tput-mib", "32", "--only", "model_steps_beside_reads",
                "--out", str(tmp_path))  # fmt: skip
    summary = json.loads((tmp_path / "gpu-check.json").read_text())
    check = next(c for c in summary["checks"] if c["name"] == "model_steps_beside_reads")
    assert check["ok"], check
    rows = {row["set-up"]: row for row in check["details"]["rows"]}
    assert set(rows) == {"alone", "engine", "vllm_pattern", "other_process", "gil_handoffs"}  # (graph_*: CUDA only)
    assert all(row["steps"] > 0 for row in rows.values()), rows
    assert all(rows[s]["GB/s"] > 0 for s in ("engine", "vllm_pattern", "other_process")), rows
    assert rows["alone"]["GB/s"] == rows["gil_handoffs"]["GB/s"] == 0 and rows["gil_handoffs"]["GIL handoffs/s"] > 500
    assert check["details"]["other_process_verified"] is True
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
