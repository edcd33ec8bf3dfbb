"""The vLLM P/D example's own housekeeping (its end-to-end run is what the adapter's P/D tests do, on vLLM)."""

import importlib.util
import os
from pathlib import Path

import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")

RUN = Path(__file__).resolve().parents[2] / "examples" / "vllm_pd" / "run.py"


def _example():
    spec = importlib.util.spec_from_file_location("vllm_pd_run", RUN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_work_folder_goes_unless_kept_even_when_the_run_fails(capsys):
    """An audit of session 39: each run left its model and logs in /tmp, with `--keep-logs` or not."""
    example = _example()
    with pytest.raises(RuntimeError), example.work_dir(keep=False) as work:
        (work / "decode.log").write_text("...")
        raise RuntimeError("a server did not start")
    assert not work.exists()
    with example.work_dir(keep=True) as kept:
        (kept / "decode.log").write_text("...")
    assert (kept / "decode.log").exists() and f"logs: {kept}" in capsys.readouterr().out
    (kept / "decode.log").unlink()
    kept.rmdir()
