"""The vLLM P/D example's own housekeeping (its end-to-end run is what the adapter's P/D tests do, on vLLM)."""

import importlib.util
import os
import shutil
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


def test_the_work_folder_goes_after_a_good_run_and_stays_after_a_failed_or_kept_one(capsys):
    """An audit of session 39: each run left its model and logs in /tmp, with `--keep-logs` or not; a run that
    failed (raised, or decode's tokens differed) keeps them, and says where."""
    example = _example()
    with example.WorkDir(keep=False) as good:
        (good.path / "decode.log").write_text("...")
    assert not good.path.exists() and "logs:" not in capsys.readouterr().out
    kept = []
    with pytest.raises(RuntimeError), example.WorkDir(keep=False) as raised:
        kept.append(raised.path)
        raise RuntimeError("a server did not start")
    with example.WorkDir(keep=False) as mismatch:
        kept.append(mismatch.path)
        mismatch.failed = True
    with example.WorkDir(keep=True) as asked:
        kept.append(asked.path)
    out = capsys.readouterr().out
    for path in kept:
        assert path.exists() and f"logs: {path}" in out
        shutil.rmtree(path)
