"""A backend NIXL cannot start fails `start()` with a typed error that says which and, where the
host shows it, why; the engine then closes cleanly and a new one starts once the cause is gone.

Over real NIXL: an unknown ``UCX_TLS`` leaves UCX no transport, so NIXL's UCX backend fails to
start with a bare NIXL_ERR_BACKEND (the same exception as its refusal of ``UCX_TLS=tcp`` on a GPU
host, which only a GPU machine shows: ``scripts/gpu-tcp-check.sh`` runs it there, docs/gpu.md).
"""

import pytest

from nixl_async import BackendStartError, EngineConfig, TransferEngine, _agent
from nixl_async.testing import assert_no_live_handles


async def test_a_backend_nixl_cannot_start_fails_start_typed_and_the_engine_closes(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "no_such_transport")
    monkeypatch.setattr(_agent, "nvidia_gpus", lambda: 0)  # this test's answer whatever the host has
    engine = TransferEngine(EngineConfig())
    with pytest.raises(BackendStartError, match=r"could not start its UCX backend \(NIXL_ERR_BACKEND\)") as caught:
        await engine.start()
    assert type(caught.value.__cause__).__name__ == "nixlBackendError"
    assert "UCX_TLS" not in str(caught.value)  # no GPU: nothing named that is not the cause
    await engine.close()

    monkeypatch.delenv("UCX_TLS")
    async with TransferEngine(EngineConfig()) as again:
        assert again.address is None
    assert_no_live_handles(again)


async def test_on_a_gpu_host_the_error_names_ucx_tls_and_the_fix(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "no_such_transport")
    monkeypatch.setattr(_agent, "nvidia_gpus", lambda: 2)  # what NIXL's PCI scan finds on a GPU server
    engine = TransferEngine(EngineConfig())
    with pytest.raises(BackendStartError, match=r"UCX_TLS='no_such_transport' enables no CUDA transport") as caught:
        await engine.start()
    assert "2 NVIDIA GPU(s)" in str(caught.value) and "cuda_copy" in str(caught.value)
    await engine.close()
