"""`start_read_batch` / `start_write_batch` between this engine and a peer process, over real NIXL (UCX)."""

import asyncio

import numpy as np
import pytest

from nixl_async import (
    BatchRowsFailed,
    EngineConfig,
    LayoutError,
    TransferBatch,
    TransferEngine,
    TransferTimeout,
)
from nixl_async.testing import Verify, fill_pattern, transfers_settled, verify_blocks

BLOCK = 4096


def _regions(n=2, blocks=64, block_len=BLOCK):
    return [np.zeros(blocks * block_len, dtype=np.uint8) for _ in range(n)]


def _room_given_back(engine):
    counters = engine.snapshot().counters
    return counters["inflight_transfers"] == 0 and counters["inflight_bytes"] == 0


async def test_a_batch_moves_each_row_and_is_awaited_once(nixl_engine, nixl_peer):
    regions = _regions()
    nixl_engine.register("kv", regions, block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address)
    remote = np.random.default_rng(5).permutation(64)[:, None]  # 64 rows of one block
    batch = await nixl_engine.start_read_batch(peer, np.arange(64)[:, None], remote)
    assert isinstance(batch, TransferBatch) and batch.rows == 64
    result = await batch
    assert (result.slices, result.descriptors, result.nbytes) == (64, 64 * 2, 64 * 2 * BLOCK)  # 2 regions
    assert batch.arrived().all() and batch.failed_rows() == {} and batch.quiet
    assert verify_blocks(regions, BLOCK, list(range(64)), remote[:, 0].tolist(), seed=1) == []
    # rows of different lengths, written to the peer, then checked there
    fill_pattern(regions, seed=7)
    local, remote_rows = [[10, 11, 12], [13], [14, 15]], [[0, 1, 2], [33], [40, 41]]
    result = await (await nixl_engine.start_write_batch(peer, local, remote_rows))
    assert (result.slices, result.nbytes) == (3, 6 * 2 * BLOCK)
    written = Verify(blocks=[0, 1, 2, 33, 40, 41], source_blocks=list(range(10, 16)), seed=7)
    assert await nixl_peer.request(written) == []
    counters = nixl_engine.snapshot().counters
    assert counters["transfers_submitted"] == 2 and counters["batch_rows_submitted"] == 67
    assert counters["transfers_done"] == 2 and _room_given_back(nixl_engine)
    assert await transfers_settled(nixl_engine) == 0


async def test_a_bad_batch_is_refused_before_anything_is_posted(nixl_engine, nixl_peer):
    nixl_engine.register("kv", _regions(), block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address)
    cases = [
        ([], [], ValueError, "at least one row"),
        ([[0], []], [[0], []], ValueError, "row 1 of the batch has no blocks"),
        ([[0], [64]], [[0], [1]], LayoutError, "out of range"),
        ([[0, 0]], [[1, 2]], LayoutError, "more than once"),
    ]
    for local, remote, error, match in cases:
        with pytest.raises(error, match=match):
            await nixl_engine.start_read_batch(peer, local, remote)
    snap = nixl_engine.snapshot()
    assert snap.counters.get("transfers_submitted", 0) == 0 and snap.live_handles.get("xfers", 0) == 0
    assert _room_given_back(nixl_engine)


async def test_a_large_batch_over_tcp_is_posted_and_checked_in_bounded_steps(nixl_engine, nixl_peer_factory):
    """Thousands of rows in flight (UCX/TCP): the call posts only about one sweep's budget, the poller
    the rest; the loop keeps running meanwhile, and every row lands."""
    proc = nixl_peer_factory(num_regions=1, num_blocks=64, block_len=BLOCK, tcp=True)
    regions = _regions(1, 64)
    nixl_engine.register("kv", regions, block_len=BLOCK)
    peer = await nixl_engine.connect(*proc.address)
    n = 5000
    rows = (np.arange(n) % 64)[:, None]  # rows may share a destination block: each writes the same bytes there
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    try:
        batch = await nixl_engine.start_read_batch(peer, rows, rows)
        assert batch.core.wants_post, "every row was posted inside the call: the loop stalled"
        seen_partial = False
        while not batch.done():
            seen_partial = seen_partial or 0 < int(batch.arrived().sum()) < n
            await asyncio.sleep(0.002)
        result = await batch
    finally:
        task.cancel()
    assert seen_partial, "rows must be seen arriving while others are still in flight"
    assert ticks > 10, "other coroutines must run while the batch is posted and checked"
    assert result.slices == n and result.nbytes == n * BLOCK
    assert verify_blocks(regions, BLOCK, list(range(64)), list(range(64)), seed=1) == []
    assert _room_given_back(nixl_engine) and await transfers_settled(nixl_engine) == 0


@pytest.mark.nixl_engine_config(max_inflight_transfers=4)
async def test_a_batch_takes_room_for_every_row(nixl_engine, nixl_peer_factory):
    """Admission counts a batch's rows: with a transfer in flight, a batch that does not fit waits (and times out)."""
    block_len, blocks = 1 << 20, 16
    proc = nixl_peer_factory(num_regions=1, num_blocks=blocks, block_len=block_len, tcp=True)
    nixl_engine.register("kv", _regions(1, blocks, block_len), block_len=block_len)
    peer = await nixl_engine.connect(*proc.address)
    proc.pause()  # the read below stays in flight while the peer is stopped
    try:
        held = await nixl_engine.start_read(peer, range(8, 16), range(8, 16))
        with pytest.raises(TransferTimeout, match="room"):  # three slots are free, the batch needs four
            await nixl_engine.start_read_batch(peer, [[0], [1], [2], [3]], [[0], [1], [2], [3]], timeout=0.2)
        fits = await nixl_engine.start_read_batch(peer, [[0], [1], [2]], [[0], [1], [2]])
    finally:
        proc.resume()
    await held
    assert (await fits).slices == 3
    assert _room_given_back(nixl_engine) and await transfers_settled(nixl_engine) == 0


async def test_a_dead_peer_fails_the_rows_and_the_batch_names_them(monkeypatch, nixl_peer_factory):
    """Rows NIXL fails are counted, released and named; the caller hears once every row is quiet."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    proc = nixl_peer_factory(num_regions=1, num_blocks=64, block_len=BLOCK, tcp=True)
    async with TransferEngine(EngineConfig(engine_id="batch-rows")) as engine:
        engine.register("kv", _regions(1), block_len=BLOCK)
        peer = await engine.connect(*proc.address)
        proc.kill()
        batch = await engine.start_read_batch(peer, np.arange(8)[:, None], np.arange(8)[:, None], timeout=30)
        with pytest.raises(BatchRowsFailed) as info:
            await batch
        assert set(info.value.failed_rows) | set(np.flatnonzero(batch.arrived())) == set(range(8))
        assert info.value.failed_rows and batch.quiet
        assert engine.snapshot().counters["transfers_failures"] == 1
        assert _room_given_back(engine)
