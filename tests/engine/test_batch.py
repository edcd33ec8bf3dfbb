"""`start_read_batch` / `start_write_batch` between this engine and a peer process, over real NIXL (UCX)."""

import asyncio

import numpy as np
import pytest

from nixl_async import (
    BatchRowsFailed,
    EngineConfig,
    LayoutError,
    TransferBatch,
    TransferCancelled,
    TransferEngine,
    TransferFailed,
    TransferFenced,
    TransferTimeout,
)
from nixl_async._agent import NIXL_ERRORS
from nixl_async.testing import TCP_TLS, Verify, fill_pattern, transfers_settled, verify_blocks

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
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    proc = nixl_peer_factory(num_regions=1, num_blocks=64, block_len=BLOCK, tcp=True)
    async with TransferEngine(EngineConfig(engine_id="batch-rows")) as engine:
        engine.register("kv", _regions(1), block_len=BLOCK)
        peer = await engine.connect(*proc.address)
        proc.kill()
        batch = await engine.start_read_batch(peer, np.arange(8)[:, None], np.arange(8)[:, None], timeout=30)
        with pytest.raises(BatchRowsFailed) as info:
            await batch
        arrived = set(np.flatnonzero(batch.arrived()).tolist())
        assert info.value.failed_rows and not arrived & set(info.value.failed_rows)
        assert len(arrived) + len(info.value.failed_rows) == 8 and batch.quiet
        assert engine.snapshot().counters["transfers_failures"] == 1
        assert _room_given_back(engine)


async def test_a_batch_behind_one_that_uses_the_sweeps_time_is_still_checked(nixl_engine, nixl_peer_factory):
    """A batch stuck in flight (its peer paused) takes the sweep's budget checking its rows: a later batch must
    still get checks of its own each sweep, not one row per sweep (its rows would be seen landed seconds late)."""
    stuck_proc = nixl_peer_factory(num_regions=1, num_blocks=64, block_len=BLOCK, tcp=True)
    live_proc = nixl_peer_factory(num_regions=1, num_blocks=64, block_len=BLOCK, tcp=True)
    nixl_engine.register("kv", _regions(1), block_len=BLOCK)
    stuck_peer = await nixl_engine.connect(*stuck_proc.address)
    live_peer = await nixl_engine.connect(*live_proc.address)
    stuck_proc.pause()
    try:
        rows = (np.arange(3000) % 64)[:, None]
        stuck = await nixl_engine.start_read_batch(stuck_peer, rows, rows)
        while stuck.core.wants_post:  # every row posted and in flight
            await asyncio.sleep(0.005)
        polls = nixl_engine.snapshot().counters["polls"]
        n = 1000
        result = await asyncio.wait_for(await nixl_engine.start_read_batch(live_peer, rows[:n], rows[:n]), 60)
        sweeps = nixl_engine.snapshot().counters["polls"] - polls
        assert result.slices == n
        assert sweeps < n / 5, f"{sweeps} sweeps for {n} rows: the later batch is starved of checks"
        stuck.cancel()
    finally:
        stuck_proc.resume()
    with pytest.raises((TransferCancelled, TransferFenced)):  # fenced if the peer was slow to let go
        await asyncio.wait_for(stuck, 30)
    assert await transfers_settled(nixl_engine) == 0


async def test_rows_whose_post_raises_fail_alone_in_one_sweep(nixl_engine, nixl_peer, monkeypatch):
    """NIXL refusing to make a row's request fails that row only; the rows after it are posted in the same sweep."""
    regions = _regions()
    nixl_engine.register("kv", regions, block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address)
    agent = nixl_engine._agent
    make_xfer, nixl_error = agent.make_xfer, NIXL_ERRORS[0]
    calls = refused = 0
    posted_in_polls = set()  # the poller's poll count at each post: posts of one sweep share it

    def every_other_refused(*args):  # rows are posted in order, one request each: odd rows are refused
        nonlocal calls, refused
        calls += 1
        posted_in_polls.add(nixl_engine.stats.counters["polls"])
        if calls % 2 == 0:
            refused += 1
            raise nixl_error("refused by the test")
        return make_xfer(*args)

    monkeypatch.setattr(agent, "make_xfer", every_other_refused)
    n = 64
    batch = await nixl_engine.start_read_batch(peer, np.arange(n)[:, None], np.arange(n)[:, None])
    with pytest.raises(BatchRowsFailed) as info:
        await asyncio.wait_for(batch, 30)
    assert sorted(info.value.failed_rows) == list(range(1, n, 2)) and refused == n // 2
    assert np.array_equal(np.flatnonzero(batch.arrived()), np.arange(0, n, 2))
    assert verify_blocks(regions, BLOCK, list(range(0, n, 2)), list(range(0, n, 2)), seed=1) == []
    assert len(posted_in_polls) < n // 8, f"rows posted over {len(posted_in_polls)} sweeps: each refused row cost one"
    assert _room_given_back(nixl_engine) and await transfers_settled(nixl_engine) == 0


@pytest.mark.parametrize("as_batch", [False, True], ids=["transfer", "batch"])
async def test_an_unexpected_error_while_posting_inline_ends_the_transfer_once_quiet(
    nixl_engine, nixl_peer_factory, monkeypatch, as_batch
):
    """An error that is not NIXL's (a bug, a binding refusing an argument) while a submit posts: the submit still
    returns the transfer, which ends with `TransferFailed` once nothing it posted can land any more (over TCP some
    of a batch's rows are in flight then); an exception from the submit would leave them landing unseen."""
    block_len, blocks = 1 << 20, 32
    proc = nixl_peer_factory(num_regions=1, num_blocks=blocks, block_len=block_len, tcp=True)
    region = np.full(blocks * block_len, 0xAA, np.uint8)
    nixl_engine.register("kv", [region], block_len=block_len)
    peer = await nixl_engine.connect(*proc.address)
    agent = nixl_engine._agent
    make_xfer, calls = agent.make_xfer, 0

    def breaks_on_the_fifth(*args):
        nonlocal calls
        calls += 1
        if calls == 5:
            raise TypeError("a binding refused an argument")
        return make_xfer(*args)

    monkeypatch.setattr(agent, "make_xfer", breaks_on_the_fifth)
    if as_batch:
        transfer = await nixl_engine.start_read_batch(peer, np.arange(blocks)[:, None], np.arange(blocks)[:, None])
        mine = region
    else:  # one post per transfer: the fifth transfer's post breaks (the other four are not its memory)
        transfer = [await nixl_engine.start_read(peer, [i], [i]) for i in range(5)][-1]
        mine = region[4 * block_len : 5 * block_len]
    with pytest.raises(TransferFailed, match="TypeError"):
        await asyncio.wait_for(transfer, 30)
    assert transfer.quiet
    snapshot = mine.copy()
    await asyncio.sleep(0.5)  # the poller keeps progressing UCX meanwhile
    assert np.array_equal(snapshot, mine), "bytes landed after the caller was told"
    monkeypatch.setattr(agent, "make_xfer", make_xfer)
    assert (await nixl_engine.read(peer, [0], [0])).nbytes == block_len
    assert _room_given_back(nixl_engine) and await transfers_settled(nixl_engine) == 0


async def test_an_error_before_a_transfer_exists_gives_its_room_back(nixl_engine, nixl_peer, monkeypatch):
    """Something raising between admission and the transfer (or batch) becoming active (a busy hint's send, say):
    before session 40 its room stayed taken for good, and with the room full every later submit waited."""
    nixl_engine.register("kv", _regions(), block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address)

    def broken(*_args):
        raise RuntimeError("a bug before the transfer exists")

    monkeypatch.setattr(nixl_engine._driver, "_expect", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        await nixl_engine.start_read(peer, [0], [0])
    with pytest.raises(RuntimeError, match="a bug"):
        await nixl_engine.start_read_batch(peer, [[1], [2]], [[1], [2]])
    assert _room_given_back(nixl_engine)
    monkeypatch.undo()
    await asyncio.wait_for(nixl_engine.read(peer, [0], [0]), 10)
