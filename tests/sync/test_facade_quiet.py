"""The facade reports a request only once its memory is quiet (UCX over TCP: reads really in flight).

vLLM frees or reuses a request's blocks as soon as `get_finished` names it; so a cancelled or
failed request must be named only when NIXL writes nothing more into them.
"""

import asyncio
import threading
import time

import numpy as np
import pytest

from nixl_async import CollectionClosedError, EngineConfig, SyncEngine
from nixl_async.testing import TCP_TLS

BLOCK, BLOCKS = 1 << 20, 96


@pytest.fixture
def tcp_sync_engine(monkeypatch):
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    engine = SyncEngine(EngineConfig(engine_id="sync-quiet"))
    yield engine
    engine.close()
    assert engine.engine.live_handles() == {}


def _collect(engine, request_id, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = engine.get_finished()
        if request_id in got.done or request_id in got.failed:
            return got
        time.sleep(0.0005)
    pytest.fail(f"{request_id} was never reported")


def _wait_in_flight(engine, request_id, timeout=10.0):
    def running():
        return any(t.core.has_running for t in list(engine.engine._driver.active.values()))

    deadline = time.monotonic() + timeout
    while not engine.call(running):
        assert time.monotonic() < deadline, "no slice in flight: is UCX using TCP?"
        time.sleep(0.0002)


def _assert_quiet(regions, what):
    snapshot = [r.copy() for r in regions]
    time.sleep(1.0)  # the loop thread keeps progressing UCX meanwhile
    changed = sum(int((a != b).sum()) for a, b in zip(snapshot, regions, strict=True))
    assert changed == 0, f"{changed} bytes landed after get_finished reported the request {what}"


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_reported_only_once_quiet(tcp_sync_engine, nixl_peer_factory, how):
    proc = nixl_peer_factory(num_regions=2, num_blocks=BLOCKS, block_len=BLOCK, seed=3, tcp=True)
    regions = [np.full(BLOCKS * BLOCK, 0xAA, np.uint8) for _ in range(2)]
    tcp_sync_engine.register("kv", regions, block_len=BLOCK)
    tcp_sync_engine.connect(*proc.address)
    ids = list(range(BLOCKS))
    if how == "cancel":
        tcp_sync_engine.submit_read("req", *proc.address, ids, ids)
        _wait_in_flight(tcp_sync_engine, "req")
        assert tcp_sync_engine.cancel("req")
    else:
        tcp_sync_engine.submit_read("req", *proc.address, ids, ids, timeout=0.004)
    got = _collect(tcp_sync_engine, "req")
    assert "req" in got.failed, got
    _assert_quiet(regions, got.failed["req"])


def test_a_request_that_leaves_its_read_unawaited_is_reported_failed_not_done(tcp_sync_engine, nixl_peer_factory):
    """Its coroutine returned while the read was in flight: the facade settles (cancels) the read
    before naming the request, and the request did not get its bytes, so it is named failed."""
    proc = nixl_peer_factory(num_regions=2, num_blocks=BLOCKS, block_len=BLOCK, seed=3, tcp=True)
    regions = [np.full(BLOCKS * BLOCK, 0xAA, np.uint8) for _ in range(2)]
    tcp_sync_engine.register("kv", regions, block_len=BLOCK)
    info = tcp_sync_engine.connect(*proc.address)
    ids = list(range(BLOCKS))

    async def start_and_leave(engine):
        await engine.start_read(engine.peer(info.engine_id), ids, ids)

    tcp_sync_engine.submit("req", start_and_leave)
    got = _collect(tcp_sync_engine, "req")
    assert "req" in got.failed and "req" not in got.done, got
    _assert_quiet(regions, got.failed["req"])


def _read_held_by_a_stopped_peer(monkeypatch, nixl_peer_factory, engine_id: str, grace: float):
    """(a sync engine, its peer's process): request "req" reads every block over UCX/TCP, and the peer is stopped
    (SIGSTOP) with the read in flight. The caller resumes the peer."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    proc = nixl_peer_factory(num_regions=2, num_blocks=BLOCKS, block_len=BLOCK, seed=3, tcp=True)
    engine = SyncEngine(EngineConfig(engine_id=engine_id, release_grace_s=grace))
    regions = [np.full(BLOCKS * BLOCK, 0xAA, np.uint8) for _ in range(2)]
    engine.register("kv", regions, block_len=BLOCK)
    engine.connect(*proc.address)
    ids = list(range(BLOCKS))
    engine.submit_read("req", *proc.address, ids, ids)
    _wait_in_flight(engine, "req")
    proc.pause()
    return engine, proc


def test_a_close_with_a_request_still_fenced_returns(monkeypatch, nixl_peer_factory):
    """The peer is stopped (SIGSTOP) with a read in flight: the cancelled request is reported fenced,
    and `close()` keeps its memory alive and returns; before, it waited forever for a quiet that
    nothing would check any more (and so did the interpreter's exit)."""
    engine, proc = _read_held_by_a_stopped_peer(monkeypatch, nixl_peer_factory, "sync-close-fenced", 0.1)
    try:
        assert engine.cancel("req")
        deadline = time.monotonic() + 10
        while "req" not in engine.get_finished().fenced:
            assert time.monotonic() < deadline, "the cancelled request was never reported fenced"
            time.sleep(0.005)
        closing = threading.Thread(target=engine.close, daemon=True)
        closing.start()
        closing.join(15)
        assert not closing.is_alive(), "close() hangs on a request NIXL still holds"
        got = engine.get_finished()
        assert "req" not in got.done and "req" not in got.failed, "memory NIXL still holds was reported free"
    finally:
        proc.resume()


def test_a_request_whose_read_was_told_fenced_is_reported_fenced_without_another_grace(monkeypatch, nixl_peer_factory):
    """The peer stopped with the read in flight, the request cancelled: its read is told `TransferFenced` once the
    grace (1 s) is spent. Before session 40 the facade then settled for another grace + 0.5 s before reporting it
    fenced (2.5 s in all); now at once, and still never done or failed while NIXL holds the read."""
    engine, proc = _read_held_by_a_stopped_peer(monkeypatch, nixl_peer_factory, "sync-fenced-soon", 1.0)
    try:
        cancelled = time.monotonic()
        assert engine.cancel("req")
        while "req" not in (got := engine.get_finished()).fenced:
            assert "req" not in got.done and "req" not in got.failed, "reported free while NIXL holds its read"
            assert time.monotonic() - cancelled < 10, "the cancelled request was never reported fenced"
            time.sleep(0.005)
        assert time.monotonic() - cancelled < 2.0, "reported fenced a whole grace after its read was told"
    finally:
        proc.resume()
    got = _collect(engine, "req")  # the peer resumed: NIXL lets go, and the request is reported failed
    assert "req" in got.failed
    engine.close()


def test_a_task_that_outlives_its_request_cannot_submit_into_it(tcp_sync_engine, nixl_peer_factory):
    """A request's coroutine starts a task and returns: the request is reported at once. When that task
    reads later, the read is refused (`CollectionClosedError`, nothing posted); before, it was posted
    into blocks already reported free, and landed there."""
    proc = nixl_peer_factory(num_regions=2, num_blocks=BLOCKS, block_len=BLOCK, seed=3, tcp=True)
    regions = [np.full(BLOCKS * BLOCK, 0xAA, np.uint8) for _ in range(2)]
    tcp_sync_engine.register("kv", regions, block_len=BLOCK)
    info = tcp_sync_engine.connect(*proc.address)
    outcome: list[BaseException | None] = []

    async def late_read(engine):
        await asyncio.sleep(0.3)  # after the request was reported
        try:
            await engine.read(engine.peer(info.engine_id), [0, 1], [0, 1])
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    async def start_and_return(engine):
        engine._late = asyncio.ensure_future(late_read(engine))  # (referenced: not collected midway)

    tcp_sync_engine.submit("req", start_and_return)
    got = _collect(tcp_sync_engine, "req")
    assert "req" in got.done, got
    deadline = time.monotonic() + 10
    while not outcome:
        assert time.monotonic() < deadline, "the late read never ended"
        time.sleep(0.01)
    assert isinstance(outcome[0], CollectionClosedError), outcome
    _assert_quiet(regions, "done")
    assert all((r == 0xAA).all() for r in regions), "the late read landed in blocks reported free"
    assert tcp_sync_engine.call(lambda: tcp_sync_engine.engine.stats.counters["transfers_submitted"]) == 0
