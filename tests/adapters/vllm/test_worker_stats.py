"""What the worker tells vLLM's stats about failed loads (vLLM's series, counted as vLLM counts them)."""

from __future__ import annotations

import collections
import os
import queue
import socket
import time

import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")

from nixl_async import EngineConfig, HandshakeError, HandshakeTimeout, SyncEngine, TransferFailed
from nixl_async_vllm.worker import ConnectorWorker


def _stats_worker() -> ConnectorWorker:
    worker = ConnectorWorker.__new__(ConnectorWorker)  # what the stats need, without a vLLM server
    worker._stats = None
    worker._results = queue.SimpleQueue()
    worker._loop_failures = queue.SimpleQueue()
    worker._counted_handshake_errors = collections.deque(maxlen=256)
    return worker


def test_requests_that_shared_one_failed_handshake_count_one_failed_handshake():
    """An audit of session 39: five requests to a dead producer share one handshake and all fail with it; each
    was counted (5 failed handshakes per rank), where vLLM counts the handshake once (as the engine does). The
    engine now hands every caller of a shared handshake its one error (before, each joiner's own timeout ran out
    a moment before the handshake's and raised an error of its own), and the worker counts that error once;
    another handshake's failure, even at the same address, counts again."""
    with socket.socket() as s:  # nothing listens there: the handshake times out
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]

    async def load(engine):
        await engine.connect("127.0.0.1", dead_port, timeout=1.0)

    with SyncEngine(EngineConfig(engine_id="stats-reader")) as engine:
        for i in range(5):
            engine.submit(f"r{i}", load)
        failed: dict[str, BaseException] = {}
        deadline = time.monotonic() + 30
        while len(failed) < 5 and time.monotonic() < deadline:
            failed.update(engine.get_finished().failed)
            time.sleep(0.01)
        assert engine.stats().counters["handshake_failures"] == 1
    assert len(failed) == 5 and all(isinstance(e, HandshakeError) for e in failed.values())
    assert len({id(e) for e in failed.values()}) == 1, "every request sharing the handshake hears its one error"
    worker = _stats_worker()
    for error in failed.values():
        worker._record_failure(error)
    worker._record_failure(TransferFailed("a read failed"))
    worker._record_failure(TransferFailed("another read failed"))
    data = worker.get_kv_connector_stats().data
    assert len(data["num_failed_handshakes"]) == 1 and len(data["num_failed_transfers"]) == 2
    worker._record_failure(HandshakeTimeout("the next handshake there", address=f"127.0.0.1:{dead_port}"))
    assert len(worker.get_kv_connector_stats().data["num_failed_handshakes"]) == 1
