"""No byte lands after the error: once a caller hears that a transfer ended, NIXL writes nothing
more into its memory (or the error is `TransferFenced` and the engine still holds that memory).

Both processes use UCX over TCP, so a READ is really in flight (over CMA it is a copy inside
`transfer()` and nothing could land late). The local blocks start as 0xAA; the peer's hold a
pattern. After the error reaches the caller we snapshot the local blocks, keep the engine
polling (progressing UCX) for a second, and compare.
"""

import asyncio
import gc
import weakref
import zlib

import numpy as np
import pytest

import nixl_async.engine as engine_module
from nixl_async import (
    EngineConfig,
    TransferCancelled,
    TransferEngine,
    TransferError,
    TransferFailed,
    TransferFenced,
    TransferTimeout,
    wait_all,
)
from nixl_async.testing import TCP_TLS, Checksums, TransferCommand, until_in_flight

BLOCK = 1 << 20
BLOCKS = 96
QUIET_FOR_S = 1.0


@pytest.fixture
async def tcp_engine(monkeypatch):
    monkeypatch.setenv("UCX_TLS", TCP_TLS)  # read when the agent's UCX worker is created
    engine = TransferEngine(EngineConfig(engine_id="quiet-reader"))
    await engine.start()
    yield engine
    await engine.close()


@pytest.fixture
def tcp_peer(nixl_peer_factory):
    return nixl_peer_factory(num_regions=2, num_blocks=BLOCKS, block_len=BLOCK, seed=9, tcp=True)


async def _setup(engine, proc):
    regions = [np.full(BLOCKS * BLOCK, 0xAA, np.uint8) for _ in range(2)]
    engine.register("kv", regions, block_len=BLOCK)
    peer = await engine.connect(*proc.address)
    return regions, peer


@pytest.fixture(params=[False, True], ids=["transfer", "batch"])
def as_batch(request):
    """Run a test with one `Transfer` of every block, then with a `TransferBatch` of one row per block."""
    return request.param


async def _start_read_all(engine, peer, as_batch=False):
    """Start a read of every block: a transfer, or a batch of one row each."""
    ids = list(range(BLOCKS))
    if as_batch:
        rows = np.array(ids)[:, None]
        return await engine.start_read_batch(peer, rows, rows)
    return await engine.start_read(peer, ids, ids)


async def _in_flight(engine, peer, as_batch=False):
    """`_start_read_all`, returning once the read is really in flight."""
    transfer = await _start_read_all(engine, peer, as_batch)
    await until_in_flight(transfer)
    return transfer


async def _assert_quiet_after(engine, regions, error):
    """Nothing lands in `regions` from now on, unless `error` says the memory is fenced."""
    snapshot = [r.copy() for r in regions]
    landed = sum(int((r != 0xAA).sum()) for r in snapshot)
    await asyncio.sleep(QUIET_FOR_S)  # the engine's poller keeps progressing UCX meanwhile
    changed = sum(int((a != b).sum()) for a, b in zip(snapshot, regions, strict=True))
    if isinstance(error, TransferFenced):
        assert engine.live_handles().get("registrations", 0) >= 1, "fenced memory must stay registered"
        return
    assert changed == 0, f"{changed} bytes landed after the caller was told {error!r} ({landed} landed before)"


async def test_deadline(tcp_engine, tcp_peer):
    regions, peer = await _setup(tcp_engine, tcp_peer)
    ids = list(range(BLOCKS))
    with pytest.raises((TransferTimeout, TransferFenced)) as info:
        await tcp_engine.read(peer, ids, ids, timeout=0.004)
    await _assert_quiet_after(tcp_engine, regions, info.value)


async def test_wait_timeout(tcp_engine, tcp_peer, as_batch):
    regions, peer = await _setup(tcp_engine, tcp_peer)
    transfer = await _in_flight(tcp_engine, peer, as_batch)
    with pytest.raises((TransferTimeout, TransferFenced)) as info:
        await transfer.wait(timeout=0.001)
    await _assert_quiet_after(tcp_engine, regions, info.value)


async def test_cancelling_the_awaiting_task(tcp_engine, tcp_peer, as_batch):
    regions, peer = await _setup(tcp_engine, tcp_peer)
    transfer = await _in_flight(tcp_engine, peer, as_batch)

    async def awaiter():
        return await transfer

    task = asyncio.create_task(awaiter())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    error = transfer.exception()
    assert isinstance(error, TransferCancelled | TransferFenced)
    await _assert_quiet_after(tcp_engine, regions, error)


async def test_asyncio_timeout_around_read(tcp_engine, tcp_peer):
    regions, peer = await _setup(tcp_engine, tcp_peer)
    ids = list(range(BLOCKS))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await tcp_engine.read(peer, ids, ids)
    await _assert_quiet_after(tcp_engine, regions, None)


@pytest.mark.parametrize("ending", ["awaiter_timed_out", "one_failed"])
async def test_wait_all_ends_only_once_every_transfer_is_quiet(tcp_engine, nixl_peer_factory, ending):
    """`wait_all` over 768 reads of 64 KiB: the wait times out, or one more read fails (its own 3 ms
    deadline). `asyncio.gather` over the futures returned at the first transfer to end, with the
    others still writing (a review measured 8.7 MB landing after its timeout); `wait_all` ends them
    all and raises once they are quiet."""
    blocks, block = 1024, 64 << 10
    proc = nixl_peer_factory(num_regions=1, num_blocks=blocks, block_len=block, seed=9, tcp=True)
    regions = [np.full(blocks * block, 0xAA, np.uint8)]
    tcp_engine.register("kv", regions, block_len=block)
    peer = await tcp_engine.connect(*proc.address)
    rows = np.arange(blocks)[:, None]
    transfers = list(await tcp_engine.start_reads(peer, rows[256:], rows[256:]))
    if ending == "awaiter_timed_out":
        with pytest.raises(TimeoutError) as info:
            async with asyncio.timeout(0.005):
                await wait_all(transfers)
    else:
        first = list(range(256))  # 16 MiB: not read within its 3 ms
        transfers.append(await tcp_engine.start_read(peer, first, first, timeout=0.003))
        with pytest.raises((TransferTimeout, TransferFenced)) as info:
            await wait_all(transfers)
    assert all(t.done() for t in transfers), "wait_all raised with transfers still running"
    fenced = next((t.exception() for t in transfers if isinstance(t.exception(), TransferFenced)), None)
    await _assert_quiet_after(tcp_engine, regions, fenced or info.value)


async def test_settle(tcp_engine, tcp_peer, as_batch):
    regions, peer = await _setup(tcp_engine, tcp_peer)
    transfer = await _in_flight(tcp_engine, peer, as_batch)
    assert await tcp_engine.settle([transfer], timeout=10)
    assert transfer.quiet and isinstance(transfer.exception(), TransferCancelled)
    assert transfer.slices_errored == 0  # cancelled, yet what was in flight ended DONE: no stray bytes
    await _assert_quiet_after(tcp_engine, regions, None)


async def test_peer_sigkill(tcp_engine, tcp_peer, as_batch):
    """A dead source sends nothing more, so quiet memory is given here: what counts is that the caller
    hears a typed error and that, unless it says fenced, NIXL holds none of the read's requests."""
    _regions, peer = await _setup(tcp_engine, tcp_peer)
    transfer = await _in_flight(tcp_engine, peer, as_batch)
    tcp_peer.kill()
    with pytest.raises((TransferFailed, TransferFenced)) as info:
        await transfer.wait(timeout=30)
    if not isinstance(info.value, TransferFenced):
        assert transfer.quiet and tcp_engine.live_handles().get("xfers", 0) == 0
        assert transfer.slices_errored >= 1, "NIXL ended a slice in error: its bytes are not known to have landed"


async def test_an_exception_right_after_a_post(tcp_engine, tcp_peer, as_batch, monkeypatch):
    """Something not NIXL's raises between NIXL taking a post and the engine noting it (a bug, a
    KeyboardInterrupt): the transfer fails, and the caller hears only once that post ended and its
    handle is released (before: told at once, the handle lost and its bytes landing afterwards)."""
    regions, peer = await _setup(tcp_engine, tcp_peer)
    agent, raised = tcp_engine._agent, []
    real = agent.post

    def post(handle):
        state = real(handle)
        if not raised and state == "PROC":
            raised.append(handle)
            raise RuntimeError("a bug right after the post")
        return state

    monkeypatch.setattr(agent, "post", post)
    transfer = await _start_read_all(tcp_engine, peer, as_batch)
    with pytest.raises((TransferFailed, TransferFenced)) as info:
        await transfer.wait(timeout=30)
    assert raised, "no post was in flight: is UCX really using TCP?"
    if not isinstance(info.value, TransferFenced):
        assert transfer.quiet and tcp_engine.live_handles().get("xfers", 0) == 0, "a handle was lost"
    await _assert_quiet_after(tcp_engine, regions, info.value)


async def test_engine_close(tcp_engine, tcp_peer, as_batch):
    regions, peer = await _setup(tcp_engine, tcp_peer)
    transfer = await _in_flight(tcp_engine, peer, as_batch)
    await tcp_engine.close()
    error = transfer.exception()
    assert isinstance(error, TransferCancelled | TransferFenced)
    assert transfer.quiet or isinstance(error, TransferFenced)
    if not isinstance(error, TransferFenced):
        assert tcp_engine.live_handles() == {}, "a quiet close releases everything"
    await _assert_quiet_after(tcp_engine, regions, error)


async def test_a_close_cancelled_midway_still_finishes(tcp_engine, tcp_peer):
    """`asyncio.timeout` around `close()`, or a TaskGroup cancelling `__aexit__`: the close goes on
    (its transfers quiet, its handles released, its agent dropped) and a later `close()` waits for it."""
    regions, peer = await _setup(tcp_engine, tcp_peer)
    transfer = await _in_flight(tcp_engine, peer)
    closing = asyncio.ensure_future(tcp_engine.close())
    await asyncio.sleep(0.002)  # close() now waits for the read to go quiet
    assert not closing.done()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not tcp_engine.running
    await tcp_engine.close()
    assert tcp_engine._agent is None, "the close stopped where it was cancelled: agent, memory and poller kept"
    error = transfer.exception()
    assert isinstance(error, TransferCancelled | TransferFenced)
    if not isinstance(error, TransferFenced):
        assert tcp_engine.live_handles() == {}
    await _assert_quiet_after(tcp_engine, regions, error)


async def test_a_write_is_done_only_once_the_target_placed_its_bytes(tcp_engine, tcp_peer):
    """What `slices_errored == 0` promises of a WRITE, which the push adapter relies on to hand decode's
    blocks back without a margin: NIXL reports it DONE only once the target's UCX worker has placed every
    byte (its UCX backend flushes the endpoint; over TCP the target acknowledges each PUT once placed).
    The target pauses (SIGSTOP) after wire-up: a WRITE posted then stays in flight until it resumes."""
    regions, peer = await _setup(tcp_engine, tcp_peer)
    await tcp_engine.write(peer, [0], [BLOCKS - 1])  # wire-up while the target runs
    ids = [0, 1]  # 2 MiB per region: socket buffers hold it, so a WRITE done when sent would be done at once
    tcp_peer.pause()
    try:
        transfer = await tcp_engine.start_write(peer, ids, ids)
        await asyncio.sleep(1.0)  # our poller keeps checking meanwhile
        assert not transfer.done() and transfer.core.has_running, "DONE while the target could place nothing"
    finally:
        tcp_peer.resume()
    await transfer.wait(timeout=30)
    assert transfer.slices_errored == 0
    ours = [[zlib.crc32(r[b * BLOCK : (b + 1) * BLOCK].data) for b in ids] for r in regions]
    assert await tcp_peer.request(Checksums(blocks=ids)) == ours


async def test_fenced_when_nixl_holds_past_the_grace(monkeypatch, tcp_peer, as_batch):
    """A zero grace: the caller hears at once that the memory is fenced; it clears later."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    async with TransferEngine(EngineConfig(engine_id="fence-reader", release_grace_s=0.0)) as engine:
        regions, peer = await _setup(engine, tcp_peer)
        transfer = await _in_flight(engine, peer, as_batch)
        transfer.cancel()
        with pytest.raises(TransferFenced) as info:
            await transfer
        assert isinstance(info.value.reason, TransferCancelled) and isinstance(info.value, TransferError)
        with pytest.raises(Exception, match="fenced"):
            engine.deregister("kv")  # never under a live handle
        assert await transfer.wait_quiet(timeout=10)
        assert engine.snapshot().counters["transfers_unfenced"] == 1
        snapshot = [r.copy() for r in regions]
        await asyncio.sleep(0.3)
        assert all(np.array_equal(a, b) for a, b in zip(snapshot, regions, strict=True))
        engine.deregister("kv")  # quiet now: allowed
    assert engine.live_handles() == {}


async def test_a_fenced_transfer_keeps_its_room_until_nixl_lets_go(monkeypatch, tcp_peer, as_batch):
    """The admission limits bound what NIXL holds. Before, a fenced read gave its room back at once: with
    the room full, another read was posted beside it (and, to a stalled peer, fenced in turn)."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    room = BLOCKS if as_batch else 1  # a batch takes one per row
    config = EngineConfig(engine_id="fenced-room", release_grace_s=0.1, max_inflight_transfers=room)
    async with TransferEngine(config) as engine:
        _regions, peer = await _setup(engine, tcp_peer)
        transfer = await _in_flight(engine, peer, as_batch)
        tcp_peer.pause()
        try:
            transfer.cancel()
            with pytest.raises(TransferFenced):
                await transfer
            assert engine.snapshot().counters["inflight_transfers"] == room  # NIXL still holds it
            with pytest.raises(TransferTimeout, match="waiting for room"):
                await engine.start_read(peer, [0], [0], timeout=0.3)
        finally:
            tcp_peer.resume()
        assert await transfer.wait_quiet(timeout=10)
        assert engine.snapshot().counters["inflight_transfers"] == 0
        await (await engine.start_read(peer, [0], [0], timeout=10))  # the room came back with the quiet


# -- batches: the same contract, row by row (the tests above run with a batch too) ------------------
async def test_batch_cancel(tcp_engine, tcp_peer):
    regions, peer = await _setup(tcp_engine, tcp_peer)
    batch = await _in_flight(tcp_engine, peer, as_batch=True)
    assert batch.cancel()
    with pytest.raises((TransferCancelled, TransferFenced)) as info:
        await batch
    assert not batch.arrived().all(), "the batch ended before every row arrived: nothing was in flight"
    await _assert_quiet_after(tcp_engine, regions, info.value)


async def test_batch_deadline(tcp_engine, tcp_peer):
    regions, peer = await _setup(tcp_engine, tcp_peer)
    rows = np.arange(BLOCKS)[:, None]
    with pytest.raises((TransferTimeout, TransferFenced)) as info:
        await (await tcp_engine.start_read_batch(peer, rows, rows, timeout=0.004))
    await _assert_quiet_after(tcp_engine, regions, info.value)


def test_a_close_cancelled_by_the_loops_shutdown_still_ends(monkeypatch, tcp_peer):
    """`asyncio.run` cancels every task left when its coroutine returns, the close's too: the close
    still ends (a transfer NIXL still holds is reported fenced, and agent and memory are kept alive),
    and a later `close()` returns."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    engine = TransferEngine(EngineConfig(engine_id="shutdown-reader"))
    seen: dict[str, object] = {}

    async def main():
        await engine.start()
        seen["regions"], peer = await _setup(engine, tcp_peer)
        seen["transfer"] = await _in_flight(engine, peer)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.002):  # returns while the close waits for the read to go quiet
                await engine.close()

    asyncio.run(main())
    assert engine._agent is None, "the close stopped where the loop's shutdown cancelled it"
    error = seen["transfer"].exception()
    assert isinstance(error, TransferCancelled | TransferFenced)
    if isinstance(error, TransferFenced):
        assert any(kept[0] is not None and kept[2] for kept in engine_module._KEPT_ALIVE), "fenced memory freed"
    else:
        assert engine.live_handles() == {}
    asyncio.run(engine.close())  # closed: returns


async def test_a_transfer_the_close_leaves_fenced_tells_its_waiters_so_at_once(monkeypatch, tcp_peer):
    """The peer is stopped (SIGSTOP), so NIXL holds the read past the close: the engine keeps agent and
    memory alive, and nothing checks the read any more. Whoever waits for it to go quiet hears False
    (fenced for good) at once; before, `wait_quiet`, `settle` and `TransferFenced.quiet` waited forever."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    engine = TransferEngine(EngineConfig(engine_id="close-fenced-reader", release_grace_s=0.1))
    await engine.start()
    _regions, peer = await _setup(engine, tcp_peer)
    transfer = await _in_flight(engine, peer)
    tcp_peer.pause()
    try:
        waiter = asyncio.ensure_future(transfer.wait_quiet())  # waiting before the close, too
        await engine.close()
        error = transfer.exception()
        assert isinstance(error, TransferFenced) and not transfer.quiet
        assert any(kept[2] and kept[2][0] is transfer for kept in engine_module._KEPT_ALIVE), "fenced memory freed"
        assert await asyncio.wait_for(waiter, 2) is False
        assert await asyncio.wait_for(transfer.wait_quiet(), 2) is False
        assert await asyncio.wait_for(engine.settle([transfer]), 2) is False
        assert await asyncio.wait_for(error.quiet(None), 2) is False
    finally:
        tcp_peer.resume()


@pytest.mark.parametrize("op", ["READ", "WRITE"])
async def test_memory_deregistered_under_a_peers_transfer_stays_alive(tcp_engine, nixl_peer_factory, op):
    """Memory deregistered 50 ms into a peer's READ or WRITE of all 192 MiB of it: the peer is still served
    from that address (UCX over TCP checks no memory keys), and so is one holding our older metadata.
    The engine keeps the objects referenced until it closes; before, deregistering dropped them, the
    array was freed under the peer's read and our process crashed (a segfault draining notifications)."""
    blocks = 192
    await tcp_engine.serve()
    peer = nixl_peer_factory(num_regions=1, num_blocks=blocks, block_len=BLOCK, seed=3, tcp=True)
    memory = np.full(blocks * BLOCK, 0x11, np.uint8)
    alive = weakref.ref(memory)
    tcp_engine.register("kv", [memory], block_len=BLOCK)
    del memory  # the engine holds the only reference
    host, port = tcp_engine.address
    ids = list(range(blocks))
    await peer.request(TransferCommand(op=op, host=host, port=port, local_blocks=[0], remote_blocks=[0], timeout=10))
    moving = asyncio.ensure_future(peer.request(TransferCommand(op=op, host=host, port=port, local_blocks=ids,
                                                                remote_blocks=ids, timeout=20)))  # fmt: skip
    await asyncio.sleep(0.05)
    tcp_engine.deregister("kv")
    gc.collect()
    assert alive() is not None, "deregistered memory a peer may still reach was freed"
    await asyncio.gather(moving, return_exceptions=True)  # served to the end, or a typed failure on its side
    await asyncio.sleep(0.5)  # our poller keeps progressing UCX meanwhile
    assert alive() is not None
