"""Transfers between this process's engine and a peer process, over real NIXL (UCX)."""

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from nixl_async import (
    BlockLayout,
    EngineClosedError,
    EngineConfig,
    HandshakeRejected,
    HandshakeTimeout,
    LayoutError,
    LayoutKind,
    MemType,
    NotificationFailed,
    PeerUnknownError,
    PollConfig,
    TransferCancelled,
    TransferEngine,
    TransferFailed,
    TransferFenced,
    TransferState,
    TransferTimeout,
    ViewSpec,
    WrongThreadError,
)
from nixl_async._agent import NIXL_ERRORS
from nixl_async._slicing import CopyRate
from nixl_async.testing import (
    Stats,
    Verify,
    WaitNotifications,
    fill_pattern,
    pattern_block,
    transfers_settled,
    verify_blocks,
)

BLOCK = 4096


def _regions(n=2, blocks=64, block_len=BLOCK):
    return [np.zeros(blocks * block_len, dtype=np.uint8) for _ in range(n)]


async def _tcp_peer(engine, factory, blocks, block_len):
    """A one-region peer over UCX TCP (so transfers are really in flight), registered and connected."""
    proc = factory(num_regions=1, num_blocks=blocks, block_len=block_len, tcp=True)
    engine.register("kv", _regions(1, blocks, block_len), block_len=block_len)
    return proc, await engine.connect(*proc.address)


async def test_a_region_range_moves_those_regions_only(nixl_engine, nixl_peer):
    """One layer at a time (progressive push): a view of some regions pairs them with the peer's, nothing else moves."""
    regions = _regions()
    nixl_engine.register("kv", regions, block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address)
    result = await nixl_engine.read(
        peer, [3, 9], [7, 60], local=ViewSpec(regions=(1, 2)), remote=ViewSpec(regions=(0, 1))
    )
    assert result.nbytes == 2 * BLOCK
    assert not regions[0].any(), "region 0 was not asked for"
    for local, remote in [(3, 7), (9, 60)]:
        assert np.array_equal(regions[1][local * BLOCK : (local + 1) * BLOCK], pattern_block(1, 0, remote, BLOCK))
    assert np.count_nonzero(regions[1]) == np.count_nonzero(regions[1][3 * BLOCK : 4 * BLOCK]) + np.count_nonzero(
        regions[1][9 * BLOCK : 10 * BLOCK]
    )
    with pytest.raises(LayoutError, match="regions x parts"):
        await nixl_engine.read(peer, [3], [7], local=ViewSpec(regions=(1, 2)))


async def test_read_round_trip_and_notification(nixl_engine, nixl_peer):
    regions = _regions()
    nixl_engine.register("kv", regions, block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address, expected_engine_id=nixl_peer.engine_id)
    result = await nixl_engine.read(peer, [0, 1, 2, 40], [5, 6, 7, 63], notify=b"req-1:1")
    assert result.nbytes == 4 * 2 * BLOCK and result.notified
    assert verify_blocks(regions, BLOCK, [0, 1, 2, 40], [5, 6, 7, 63], seed=1) == []
    assert not regions[0][3 * BLOCK : 40 * BLOCK].any(), "blocks not asked for must stay untouched"
    senders = await nixl_peer.request(WaitNotifications(message=b"req-1:1", timeout=10))
    assert senders == [nixl_engine.engine_id]


async def test_a_read_whose_notification_fails_says_its_data_arrived(nixl_engine, nixl_peer, monkeypatch):
    """The data landed and only the completion notice failed: the error carries the read's result, so a
    caller (vLLM's adapter) can keep the blocks instead of reading or computing them again."""
    regions = _regions()
    nixl_engine.register("kv", regions, block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address)

    def refuse(peer, message):
        raise NIXL_ERRORS[0]("NIXL_ERR_NOT_FOUND")

    monkeypatch.setattr(nixl_engine._notify, "send", refuse)
    with pytest.raises(NotificationFailed) as info:
        await nixl_engine.read(peer, [0, 1], [5, 6], notify=b"req-2:1")
    assert info.value.result is not None and info.value.result.nbytes == 2 * 2 * BLOCK
    assert not info.value.result.notified
    assert verify_blocks(regions, BLOCK, [0, 1], [5, 6], seed=1) == []
    assert nixl_engine.live_handles().get("xfers", 0) == 0


async def test_misuse_gets_a_typed_error_and_posts_nothing(nixl_engine, nixl_peer):
    regions = _regions()
    nixl_engine.register("kv", regions, block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address)
    for timeout in (0, -1.0):  # a deadline already passed: nothing is posted, no byte lands
        with pytest.raises(TransferTimeout, match="before the submit"):
            await nixl_engine.start_read(peer, [0], [5], timeout=timeout)
    # NaN would compare False with every clock reading: a transfer with no deadline, a lease never checked
    for options in ({"timeout": float("nan")}, {"lease_expires_at": float("nan")}):
        with pytest.raises(ValueError, match="NaN"):
            await nixl_engine.start_read(peer, [0], [5], **options)
        with pytest.raises(ValueError, match="NaN"):
            await nixl_engine.start_reads(peer, [[0]], [[5]], **options)
    assert not any(r.any() for r in regions) and nixl_engine.live_handles().get("xfers", 0) == 0
    with pytest.raises(TypeError, match="bytes"):
        await nixl_engine.wait_notifications("req-1", timeout=1)  # would never match b"req-1"
    with pytest.raises(TypeError, match="bytes"):
        nixl_engine.lend("req-1", ttl_s=1)
    for timeout in (0, float("nan")):  # a budget run out: checked whether a handshake is needed or not
        with pytest.raises(HandshakeTimeout, match="no time left"):
            await nixl_engine.connect(*nixl_peer.address, timeout=timeout)
    with pytest.raises(HandshakeRejected, match="this engine itself"):
        await nixl_engine.connect(*nixl_engine.address)


async def test_a_backend_nixl_has_no_plugin_for_is_named_and_nothing_is_left_running():
    """Before: NIXL's bare NIXL_ERR_NOT_FOUND, naming no backend."""
    engine = TransferEngine(EngineConfig(engine_id="no-such-backend", backends=("NOPE",)))
    with pytest.raises(ValueError, match=r"no plugin for backend 'NOPE'.*UCX"):
        await engine.start()
    assert not engine.running and engine._agent is None and engine._zmq is None
    await engine.close()


async def test_an_engine_refuses_another_engines_peer_and_another_loop(nixl_engine, nixl_peer):
    peer = await nixl_engine.connect(*nixl_peer.address)
    async with TransferEngine(EngineConfig(engine_id="bystander")) as other:
        with pytest.raises(PeerUnknownError):
            other.disconnect(peer)
    assert peer.connected and nixl_engine.peer(nixl_peer.engine_id) is peer
    elsewhere = threading.Thread(target=lambda: caught.append(_in_a_new_loop(nixl_engine.read(peer, [0], [0]))))
    caught: list[BaseException | None] = []
    elsewhere.start()
    elsewhere.join(30)
    assert isinstance(caught[0], WrongThreadError)
    assert nixl_engine.live_handles().get("xfers", 0) == 0


def _in_a_new_loop(coro) -> BaseException | None:
    try:
        asyncio.run(coro)
    except BaseException as exc:
        return exc
    return None


async def test_a_closed_engine_cannot_start_again():
    engine = TransferEngine(EngineConfig(engine_id="once"))
    await engine.start()
    await engine.close()
    with pytest.raises(EngineClosedError):
        await engine.start()


async def test_write_round_trip_from_torch_tensors(nixl_engine, nixl_peer):
    tensors = [torch.zeros(64, BLOCK, dtype=torch.uint8) for _ in range(2)]
    fill_pattern([t.numpy() for t in tensors], seed=42)
    layout = nixl_engine.register("kv", tensors, num_blocks=64)
    assert layout.block_len == BLOCK and layout.mem_type == "DRAM"
    peer = await nixl_engine.connect(*nixl_peer.address)
    await nixl_engine.write(peer, [10, 11, 12], [0, 33, 2], notify=b"w")
    assert await nixl_peer.request(Verify(blocks=[0, 33, 2], source_blocks=[10, 11, 12], seed=42)) == []
    assert await nixl_peer.request(WaitNotifications(message=b"w", timeout=10))


async def test_large_transfer_is_sliced_and_complete(nixl_peer_factory, nixl_engine):
    """64 MiB in 256 KiB blocks: posted in several slices, every byte lands."""
    block_len, blocks = 256 << 10, 128
    peer_proc = nixl_peer_factory(num_regions=2, num_blocks=blocks, block_len=block_len, seed=3)
    regions = _regions(2, blocks, block_len)
    nixl_engine.register("kv", regions, block_len=block_len)
    peer = await nixl_engine.connect(*peer_proc.address)
    order = np.random.default_rng(0).permutation(blocks)
    result = await nixl_engine.read(peer, np.arange(blocks), order, notify=b"big")
    assert result.slices > 1 and result.nbytes == 2 * blocks * block_len
    assert verify_blocks(regions, block_len, range(blocks), order, seed=3) == []
    assert await peer_proc.request(WaitNotifications(message=b"big", timeout=10))


async def test_views_read_a_window_and_split_blocks(nixl_peer_factory, nixl_engine):
    """Heterogeneous TP (a head window) and a block-size ratio, against real memory."""
    peer_proc = nixl_peer_factory(num_regions=1, num_blocks=16, block_len=1024, seed=5)
    local = np.zeros(8 * 1024, dtype=np.uint8)
    nixl_engine.register("kv", [local], block_len=512)  # half-size blocks
    peer = await nixl_engine.connect(*peer_proc.address)
    # 1) decode TP rank 1 of 2: read the second half of remote blocks 3 and 9 into local blocks 0 and 1
    await nixl_engine.read(peer, [0, 1], [3, 9], remote=ViewSpec(chunk_offset=512, chunk_len=512))
    assert np.array_equal(local[:512], pattern_block(5, 0, 3, 1024)[512:])
    assert np.array_equal(local[512:1024], pattern_block(5, 0, 9, 1024)[512:])
    # 2) remote blocks twice the size: split each remote block into two local blocks
    await nixl_engine.read(peer, [4, 5, 6, 7], [2, 11], remote=ViewSpec(split=2))
    assert np.array_equal(local[4 * 512 : 6 * 512], pattern_block(5, 0, 2, 1024))
    assert np.array_equal(local[6 * 512 : 8 * 512], pattern_block(5, 0, 11, 1024))


async def test_blocks_first_kv_layout_round_trip(nixl_peer_factory, nixl_engine):
    peer_proc = nixl_peer_factory(num_regions=1, num_blocks=8, block_len=2048, kind=LayoutKind.BLOCKS_FIRST_KV)
    local = np.zeros(8 * 2048, dtype=np.uint8)
    nixl_engine.register("kv", [local], block_len=2048, kind=LayoutKind.BLOCKS_FIRST_KV)
    peer = await nixl_engine.connect(*peer_proc.address)
    await nixl_engine.read(peer, [1], [6], remote=ViewSpec(chunk_offset=256, chunk_len=256),
                           local=ViewSpec(chunk_offset=256, chunk_len=256))  # fmt: skip
    want = pattern_block(1, 0, 6, 2048)
    got = local[2048:4096]
    for half in (0, 1024):
        assert np.array_equal(got[half + 256 : half + 512], want[half + 256 : half + 512])
        assert not got[half : half + 256].any() and not got[half + 512 : half + 1024].any()


async def test_empty_block_lists_send_only_the_notification(nixl_engine, nixl_peer):
    nixl_engine.register("kv", _regions(), block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address)
    result = await nixl_engine.read(peer, [], [], notify=b"prefix-hit")
    assert result.nbytes == 0 and result.notified
    assert await nixl_peer.request(WaitNotifications(message=b"prefix-hit", timeout=10)) == [nixl_engine.engine_id]


async def test_a_batch_moves_each_row_as_its_own_transfer(nixl_engine, nixl_peer):
    """`start_reads` / `start_writes`: transfer i moves row i, with its own notification and result."""
    regions = _regions()
    nixl_engine.register("kv", regions, block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address)
    local, remote = [[0, 1], [2, 3], [40, 41]], [[5, 6], [7, 5], [63, 62]]
    reads = await nixl_engine.start_reads(peer, local, remote, notify=[b"r-0", None, b"r-2"])
    results = await asyncio.gather(*reads)
    assert [r.nbytes for r in results] == [2 * 2 * BLOCK] * 3
    assert [r.notified for r in results] == [True, False, True]
    assert len({r.transfer_id for r in results}) == 3
    assert verify_blocks(regions, BLOCK, [b for row in local for b in row], [b for row in remote for b in row],
                         seed=1) == []  # fmt: skip
    assert not regions[0][4 * BLOCK : 40 * BLOCK].any(), "blocks not asked for must stay untouched"
    for message in (b"r-0", b"r-2"):
        assert await nixl_peer.request(WaitNotifications(message=message, timeout=10)) == [nixl_engine.engine_id]
    fill_pattern(regions, seed=7)
    writes = await nixl_engine.start_writes(peer, np.array([[10], [11], [12]]), np.array([[0], [33], [2]]),
                                            notify=[None, None, b"w-2"])  # fmt: skip
    await asyncio.gather(*writes)
    assert await nixl_peer.request(Verify(blocks=[0, 33, 2], source_blocks=[10, 11, 12], seed=7)) == []
    assert await nixl_peer.request(WaitNotifications(message=b"w-2", timeout=10))
    # requests of different lengths; one with no blocks only notifies (a full prefix hit)
    regions[0][:] = 0
    mixed = await nixl_engine.start_reads(peer, [[20, 21, 22], [], [23]], [[8, 9, 10], [], [11]],
                                          notify=[None, b"hit-1", None])  # fmt: skip
    assert [(await t).nbytes for t in mixed] == [3 * 2 * BLOCK, 0, 2 * BLOCK]
    assert verify_blocks(regions, BLOCK, [20, 21, 22, 23], [8, 9, 10, 11], seed=1) == []
    assert await nixl_peer.request(WaitNotifications(message=b"hit-1", timeout=10))
    assert nixl_engine.snapshot().counters["transfers_submitted"] == 3 + 3 + 2  # a notify-only row is not one
    counters = nixl_engine.snapshot().counters
    assert counters["inflight_transfers"] == 0 and counters["inflight_bytes"] == 0, "admitted room not given back"
    assert await transfers_settled(nixl_engine) == 0


async def test_a_bad_row_refuses_the_whole_batch_before_anything_is_posted(nixl_engine, nixl_peer):
    nixl_engine.register("kv", _regions(), block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address)
    cases = [
        ([[0], [64]], [[0], [1]], LayoutError, "out of range"),
        ([[0, 1], [2]], [[0, 1], [2, 3]], LayoutError, "do not pair"),
        ([[0, 0]], [[1, 2]], LayoutError, "more than once"),
        ([[0], [1]], [[0]], LayoutError, "2 local rows against 1 remote rows"),
        ([[0], [1]], [[0], [1]], ValueError, "2 transfers"),
    ]
    for local, remote, error, match in cases:
        with pytest.raises(error, match=match):
            await nixl_engine.start_reads(peer, local, remote, notify=[b"x"] if error is ValueError else None)
    with pytest.raises(TypeError, match="bytes"):
        await nixl_engine.start_writes(peer, [[0]], [[0]], notify=["text"])
    snap = nixl_engine.snapshot()
    assert snap.counters.get("transfers_submitted", 0) == 0
    assert snap.live_handles.get("xfers", 0) == 0


@pytest.mark.nixl_engine_config(max_inflight_transfers=2)
async def test_a_batch_waits_for_room_for_all_of_it_or_posts_nothing(nixl_engine, nixl_peer_factory):
    """A batch is admitted whole: it waits for room for every transfer; past its deadline nothing was posted."""
    block_len, blocks = 1 << 20, 16
    peer_proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, blocks, block_len)
    rows = [[i] for i in range(6)]  # beyond the limit of 2: goes alone, as an oversized transfer does
    await asyncio.gather(*await asyncio.wait_for(nixl_engine.start_reads(peer, rows, rows), 30))
    peer_proc.pause()  # the read below stays in flight while the peer is stopped
    try:
        held = await nixl_engine.start_read(peer, range(8, 16), range(8, 16))
        with pytest.raises(TransferTimeout, match="room"):  # one slot is free, the batch needs two
            await nixl_engine.start_reads(peer, [[0], [1]], [[0], [1]], timeout=0.2)
        counters = nixl_engine.snapshot().counters
        assert counters["transfers_submitted"] == 6 + 1, "no transfer of the refused batch may have been posted"
        assert counters["backpressure_waits"] == 1
        later = asyncio.ensure_future(nixl_engine.start_reads(peer, [[0], [1]], [[0], [1]]))
        await asyncio.sleep(0.05)
        assert not later.done(), "the batch must wait while the held read fills the room"
    finally:
        peer_proc.resume()
    assert (await held).nbytes == 8 * block_len
    assert [r.nbytes for r in await asyncio.gather(*await asyncio.wait_for(later, 30))] == [block_len] * 2
    assert await transfers_settled(nixl_engine) == 0
    counters = nixl_engine.snapshot().counters
    assert counters["inflight_transfers"] == 0 and counters["inflight_bytes"] == 0, "admitted room not given back"


@pytest.mark.nixl_engine_config(max_inflight_transfers=1)
@pytest.mark.parametrize("then", ["deregistered", "registered-again"])
async def test_a_layout_deregistered_while_a_submit_waits_for_room_is_refused(nixl_engine, nixl_peer_factory, then):
    """A submit waiting for room holds a view of its layout. Deregistered meanwhile (or registered again
    under the name), the submit gets `LayoutError` and posts nothing: before, its stale view was prepared
    (NIXL's own error, or a READ into whatever memory now sits at the old addresses) and cached."""
    block_len, blocks = 1 << 20, 8
    peer_proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, blocks, block_len)
    other = _regions(1, blocks, block_len)
    nixl_engine.register("kv2", other, block_len=block_len)
    await nixl_engine.read(peer, [0], [0], local="kv2")  # "kv2"'s descriptor list is prepared (and cached)
    peer_proc.pause()  # the read below stays in flight while the peer is stopped
    try:
        held = await nixl_engine.start_read(peer, [0], [1], local="kv")
        waiting = asyncio.ensure_future(nixl_engine.start_read(peer, [1, 2], [2, 3], local="kv2"))
        await asyncio.sleep(0.05)
        assert not waiting.done(), "the submit must wait while the held read fills the room"
        nixl_engine.deregister("kv2")
        fresh = _regions(1, blocks, block_len)
        if then == "registered-again":
            nixl_engine.register("kv2", fresh, block_len=block_len)
    finally:
        peer_proc.resume()
    await held
    with pytest.raises(LayoutError, match="'kv2' was deregistered here while the transfer waited"):
        await asyncio.wait_for(waiting, 30)
    assert not any(r.any() for r in fresh), "nothing may be read into the new registration"
    counters = nixl_engine.snapshot().counters
    assert counters["transfers_submitted"] == 2 and counters["inflight_transfers"] == 0
    if then == "registered-again":  # the new registration gets a list of its own
        await nixl_engine.read(peer, [1], [2], local="kv2")
        assert verify_blocks(fresh, block_len, [1], [2], seed=1) == []


async def test_a_large_batch_does_not_stall_the_loop_and_every_row_lands(nixl_engine, nixl_peer_factory):
    """Small rows are posted inside `start_reads` only for about one sweep's budget; the poller posts the rest
    while earlier rows are in flight (UCX/TCP) and completing."""
    proc = nixl_peer_factory(num_regions=1, num_blocks=64, block_len=BLOCK, tcp=True)
    regions = _regions(1, 64)
    nixl_engine.register("kv", regions, block_len=BLOCK)
    peer = await nixl_engine.connect(*proc.address)
    n = 3000
    local = [[i % 64] for i in range(n)]  # rows may share a destination block: each writes the same bytes there
    batch = await nixl_engine.start_reads(peer, local, local)
    assert any(not t.first_post_at for t in batch), "every row was posted inside the call: the loop stalled"
    results = await asyncio.wait_for(asyncio.gather(*batch), 60)
    assert len(results) == n and all(r.nbytes == BLOCK for r in results)
    assert verify_blocks(regions, BLOCK, list(range(64)), list(range(64)), seed=1) == []
    counters = nixl_engine.snapshot().counters
    assert counters["transfers_done"] == n and counters["inflight_transfers"] == 0
    assert await transfers_settled(nixl_engine) == 0


async def test_bad_block_ids_are_refused_before_anything_is_posted(nixl_engine, nixl_peer):
    nixl_engine.register("kv", _regions(), block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address)
    cases = [([0], [64]), ([64], [0]), ([0, 1], [2]), ([-1], [0]), ([1, 1], [2, 3])]
    for local, remote in cases:
        with pytest.raises(LayoutError):
            await nixl_engine.read(peer, local, remote)
    with pytest.raises(LayoutError, match="no layout"):
        await nixl_engine.read(peer, [0], [0], remote="nope")
    with pytest.raises(LayoutError, match="does not fit"):
        await nixl_engine.read(peer, [0], [0], remote=ViewSpec(chunk_offset=BLOCK))
    snap = nixl_engine.snapshot()
    assert snap.counters.get("transfers_submitted", 0) == 0
    assert snap.live_handles.get("xfers", 0) == 0


async def test_fan_in_notifications_from_several_peers(nixl_engine, nixl_peer_factory):
    """Two 'prefill ranks' notify the same message; we wait for both (heterogeneous TP)."""
    nixl_engine.register("kv", _regions(), block_len=BLOCK)
    peers = [nixl_peer_factory(), nixl_peer_factory()]
    host, port = nixl_engine.address
    # The first notification arrives before anyone waits: it must be kept.
    await peers[0].request(_notify(host, port, b"req-7"))
    waiter = asyncio.ensure_future(nixl_engine.wait_notifications(b"req-7", count=2, timeout=20))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await peers[1].request(_notify(host, port, b"req-7"))
    senders = await waiter
    assert sorted(senders) == sorted(p.engine_id for p in peers)


def _notify(host, port, message):
    from nixl_async.testing import Notify

    return Notify(host=host, port=port, message=message)


async def test_notification_iterator(nixl_engine, nixl_peer):
    nixl_engine.register("kv", _regions(), block_len=BLOCK)
    host, port = nixl_engine.address
    seen = []

    async def collect():
        async for note in nixl_engine.notifications():
            seen.append(note)
            if len(seen) == 2:
                return

    collector = asyncio.ensure_future(collect())
    await asyncio.sleep(0)
    await nixl_peer.request(_notify(host, port, b"one"))
    await nixl_peer.request(_notify(host, port, b"two"))
    await asyncio.wait_for(collector, 10)
    assert [n.message for n in seen] == [b"one", b"two"]
    assert {n.sender for n in seen} == {nixl_peer.engine_id}


async def test_cancel_releases_the_in_flight_handle(nixl_engine, nixl_peer_factory):
    """Over UCX TCP the read is really in flight; cancelling it releases its NIXL handle."""
    block_len, blocks = 1 << 20, 64
    _peer_proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, blocks, block_len)
    transfer = await nixl_engine.start_read(peer, range(blocks), range(blocks))
    assert transfer.state is TransferState.POSTING, "expected a genuinely in-flight transfer over TCP"
    for _ in range(100):  # a large first slice is posted by the poller, one iteration later
        if nixl_engine.live_handles().get("xfers"):
            break
        await asyncio.sleep(0)
    assert nixl_engine.live_handles().get("xfers", 0) >= 1
    assert transfer.cancel()
    with pytest.raises(TransferCancelled):
        await transfer
    assert transfer.state is TransferState.CANCELLED
    assert await transfers_settled(nixl_engine) == 0
    assert nixl_engine.snapshot().counters["transfers_cancelled"] == 1
    # the engine still works afterwards
    await nixl_engine.read(peer, [0], [1])


@pytest.mark.parametrize("ending", ["cancel", "deadline"])
async def test_a_write_that_landed_and_notified_is_done_though_it_was_ended_meanwhile(
    nixl_engine, nixl_peer_factory, ending
):
    """A one-slice WRITE with a notification, the target paused (SIGSTOP) so it stays in flight, is
    cancelled or passes its deadline; the target resumes, the bytes land and it is notified. The caller
    now gets the result (before: `TransferCancelled` / `TransferTimeout`, while the target was told done)."""
    proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, 8, 1 << 20)
    await nixl_engine.write(peer, [0], [0], notify=b"wire-up")
    proc.pause()
    try:
        timeout = 0.1 if ending == "deadline" else None
        transfer = await nixl_engine.start_write(peer, [1, 2], [1, 2], notify=b"landed", timeout=timeout)
        assert transfer.num_slices == 1
        for _ in range(200):  # (the poller posts it)
            if transfer.core.has_running:
                break
            await asyncio.sleep(0.001)
        assert transfer.core.has_running, "the WRITE never went out"
        if ending == "cancel":
            assert transfer.cancel()
        await asyncio.sleep(0.3)
        assert not transfer.done()
    finally:
        proc.resume()
    result = await asyncio.wait_for(transfer, 10)
    assert result.notified and result.nbytes == 2 << 20 and transfer.slices_errored == 0
    assert await proc.request(WaitNotifications(message=b"landed", count=1, timeout=5))


async def test_settle_returns_only_once_nixl_holds_no_handle_of_the_transfers(nixl_engine, nixl_peer_factory):
    """What a failed request needs before its memory is reused: siblings cancelled *and* released."""
    block_len, blocks = 1 << 20, 64
    _peer_proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, blocks, block_len)
    done = await nixl_engine.start_read(peer, [0], [0])
    await done
    running = await nixl_engine.start_read(peer, range(1, blocks), range(1, blocks))
    for _ in range(100):
        if nixl_engine.live_handles().get("xfers"):
            break
        await asyncio.sleep(0)
    assert running.state is TransferState.POSTING
    assert await nixl_engine.settle([done, running], timeout=10)
    assert running.state is TransferState.CANCELLED and done.state is TransferState.DONE
    assert nixl_engine.live_handles().get("xfers", 0) == 0, "settle() returned while NIXL still held a handle"
    with pytest.raises(TransferCancelled):
        await running


async def test_deadline_expiry_and_asyncio_timeout(nixl_engine, nixl_peer_factory):
    block_len, blocks = 1 << 20, 64
    _peer_proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, blocks, block_len)
    with pytest.raises(TransferTimeout):
        await nixl_engine.read(peer, range(blocks), range(blocks), timeout=0.001)
    transfer = await nixl_engine.start_read(peer, range(blocks), range(blocks))
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.001):
            await transfer
    for _ in range(100):  # the poller notices the cancelled awaiter on its next sweep
        if transfer.state is not TransferState.POSTING:
            break
        await asyncio.sleep(0.001)
    assert transfer.state is TransferState.CANCELLED
    with pytest.raises(TransferTimeout):
        await (await nixl_engine.start_read(peer, range(blocks), range(blocks))).wait(timeout=0.001)
    waiter = asyncio.ensure_future(
        (transfer := await nixl_engine.start_read(peer, range(blocks), range(blocks))).wait(30)
    )
    await asyncio.sleep(0.001)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert transfer.state is TransferState.CANCELLED
    counters = nixl_engine.snapshot().counters
    assert counters["transfers_timeouts"] == 2 and counters["transfers_cancelled"] == 2


async def test_a_read_whose_deadline_passed_before_its_first_post_posts_nothing(nixl_engine, nixl_peer_factory):
    """The deadline is checked before each post, the first one included. A slice posted past it is work the caller
    no longer wants; over cuda_ipc (an H100, a 256 MiB read copied inside one post) the whole read landed and was
    reported a success long past a 0.1 ms deadline."""
    proc = nixl_peer_factory(num_regions=1, num_blocks=16, block_len=1 << 20, tcp=True)
    local = _regions(1, 16, 1 << 20)
    nixl_engine.register("kv", local, block_len=1 << 20)
    peer = await nixl_engine.connect(*proc.address)
    transfer = await nixl_engine.start_read(peer, range(16), range(16), timeout=0.05)
    assert not transfer.first_post_at, "the submit posted it: this test wants a read the poller posts (16 MiB)"
    time.sleep(0.1)  # the loop is busy elsewhere until the deadline has passed
    with pytest.raises(TransferTimeout):
        await asyncio.wait_for(transfer, 10)
    assert await nixl_engine.settle([transfer], timeout=5)
    assert not local[0].any(), "a slice was posted past the deadline"
    assert transfer.slices_posted == 0, "a slice handed out, then not posted, counted as posted"
    await nixl_engine.read(peer, range(16), range(16))  # the engine and the peer are fine
    assert local[0].any()


@pytest.mark.nixl_engine_config(max_inflight_transfers=2)
async def test_backpressure_waits_for_room(nixl_engine, nixl_peer_factory):
    block_len, blocks = 1 << 20, 16
    _peer_proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, blocks, block_len)
    first = await nixl_engine.start_read(peer, range(0, 8), range(0, 8))
    second = await nixl_engine.start_read(peer, range(8, 16), range(8, 16))
    third = asyncio.ensure_future(nixl_engine.start_read(peer, [0], [1]))
    await asyncio.sleep(0)
    assert not third.done(), "a third submit must wait while two transfers are in flight"
    await first
    await second
    await (await asyncio.wait_for(third, 10))
    assert nixl_engine.snapshot().counters["backpressure_waits"] == 1
    # a submit that cannot get room before its deadline fails cleanly, posting nothing
    a = await nixl_engine.start_read(peer, range(0, 8), range(0, 8))
    b = await nixl_engine.start_read(peer, range(8, 16), range(8, 16))
    with pytest.raises(TransferTimeout, match="room"):
        await nixl_engine.start_read(peer, [0], [1], timeout=0.0005)
    await asyncio.gather(a.wait(), b.wait())


async def test_wire_time_spans_a_read_in_flight_over_tcp(nixl_engine, nixl_peer_factory):
    """`wire_seconds` (what the vLLM adapter reports as NIXL's transfer time) runs from the first post to DONE."""
    _proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, 64, 1 << 20)
    result = await nixl_engine.read(peer, range(64), range(64))  # 64 MiB over TCP: in flight after the posts
    assert result.slices > 1
    assert result.post_seconds < result.wire_seconds <= result.seconds + 1e-3, result


async def test_a_read_in_flight_over_tcp_is_checked_every_interval_not_spun_on(nixl_engine, nixl_peer_factory):
    """Until the read may end (from the rate the previous one moved at), the poller sleeps between checks."""
    # 192 MiB: ~60 ms in flight at the ~3.5 GB/s engines reach from 8 MiB send buffers (64 MiB, ~18 ms, left
    # room for only two sleeps before the read might end)
    blocks = 192
    _proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, blocks, 1 << 20)
    for _ in range(3):  # in flight: teaches the wire rate (a slow first read, wire-up and all, set it
        await nixl_engine.read(peer, range(blocks), range(blocks))  # low, and the test's hot_from then came too late)
    loop, sleep, poll_once = asyncio.get_running_loop(), nixl_engine._sleep, nixl_engine._poll_once
    polls: list[tuple[float, bool]] = []  # (when, whether the poller slept since the poll before)
    slept = [False]

    async def traced_sleep(delay: float) -> None:
        await sleep(delay)
        slept[0] = True

    async def traced_poll(running_loop: asyncio.AbstractEventLoop) -> None:
        polls.append((loop.time(), slept[0]))
        slept[0] = False
        await poll_once(running_loop)

    nixl_engine._sleep, nixl_engine._poll_once = traced_sleep, traced_poll
    # see WireRate.spin_window; the poller goes hot up to the interval its sleeps really last before (at most 10 ms)
    hot_from = loop.time() + 0.8 * (blocks << 20) / peer.link.wire.bytes_per_s - 0.010
    result = await nixl_engine.read(peer, range(blocks), range(blocks))
    early = [after_sleep for when, after_sleep in polls if when < hot_from]
    # The previous poller spun for the whole read: hundreds of checks, none after a sleep. Now every check
    # before the read may end follows a ~1 ms sleep, but for the one after a slice ends (to post the next).
    # Counted, not timed: on a loaded machine UCX's progress (the socket reads) fills the time between.
    assert early.count(True) >= 3 and early.count(False) <= 2 * result.slices + 2, (early, result)


@pytest.mark.parametrize("as_batch", [False, True], ids=["transfer", "batch"])
async def test_a_read_stalled_in_flight_is_checked_every_interval_not_spun_on(nixl_engine, nixl_peer_factory, as_batch):
    """The peer paused (SIGSTOP) with a read in flight over TCP: once the read is long overdue the poller
    checks it every busy interval (1 ms). Before, it checked on every loop turn until the read's deadline
    (a review measured 17,000-82,000 checks and 0.92-0.97 CPU seconds per second). Counted, not timed."""
    proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, 32, 1 << 20)
    ids = list(range(1, 32))
    for _ in range(3):  # wire-up, and the link's rate measured (a read of 31 MiB: tens of ms)
        await nixl_engine.read(peer, ids, ids)
    proc.pause()
    try:
        if as_batch:
            rows = np.array(ids)[:, None]
            transfer = await nixl_engine.start_read_batch(peer, rows, rows)
        else:
            transfer = await nixl_engine.start_read(peer, ids, ids)
        await asyncio.sleep(0.3)  # long overdue
        polls = nixl_engine.stats.counters["polls"]
        await asyncio.sleep(1.0)
        checks = nixl_engine.stats.counters["polls"] - polls
        assert not transfer.done()
    finally:
        proc.resume()
    await transfer.wait(timeout=30)
    assert checks < 3000, f"{checks} checks in 1 s of a stalled read: the poller spins"


# (idle sleeps of 0.5 s: the poller's idle wake-ups never coincide with the submits; busy checks every 20 ms: the
# loop turns below fit in one on a loaded machine)
@pytest.mark.nixl_engine_config(
    poll=PollConfig(spin=False, linger_s=0.0, busy_interval_s=0.02, backoff_start_s=0.5, idle_interval_s=0.5)
)
async def test_a_read_the_submit_posts_in_flight_is_first_checked_a_busy_interval_later(nixl_engine, nixl_peer_factory):
    """As the vLLM adapter polls (no spin): the submit posts a small read, which is in flight over TCP; the poller
    first checks it when a busy check would look again, not at once (that poll only found it in flight: a loop turn,
    a notification drain and a state check per KV load on decode's core). A read still to post wakes it at once."""
    _proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, 16, 256 << 10)
    await nixl_engine.read(peer, [0], [0])  # wire-up
    counters = nixl_engine.stats.counters
    for _ in range(3):
        await asyncio.sleep(0.1)  # the poller sleeps idle
        polls = counters["polls"]
        transfer = await nixl_engine.start_read(peer, [1, 2, 3, 4], [1, 2, 3, 4])  # 1 MiB: one post (min_post_bytes)
        assert transfer.state is TransferState.POSTING, "expected a read in flight over TCP"
        for _ in range(5):
            await asyncio.sleep(0)
        assert counters["polls"] == polls, "the poller checked a read the submit had just posted"
        result = await asyncio.wait_for(transfer, 10)
        assert result.nbytes == 1 << 20 and result.slices == 1
        assert result.seconds < 0.25, "the poller's idle sleep (0.5 s), not a busy check's, ended the wait"
    await asyncio.sleep(0.1)
    polls = counters["polls"]
    big = await nixl_engine.start_read(peer, range(16), range(16))  # 4 MiB in slices: the poller posts the rest
    for _ in range(5):
        await asyncio.sleep(0)
    assert counters["polls"] > polls, "a read with slices to post waits for the poller"
    await asyncio.wait_for(big, 10)


@pytest.mark.nixl_engine_config(slice_flight_s=None, post_target_s=0.05)  # the large read is one slice
async def test_a_read_submitted_while_a_sweep_yields_counts_in_that_sweeps_next_check(
    nixl_engine, nixl_peer_factory, monkeypatch
):
    """A sweep yields once a read has finished, before a large post, so that read's awaiter can submit its next. That
    submit cannot wake the running poller, and the sweep's list was taken before it: the sweep must still count the
    new read when it decides how soon to look again (it left it out: a read that may end at once waited for the busy
    interval, or for the large read's expected end)."""
    _proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, 128, 64 << 10)
    await nixl_engine.read(peer, [0], [0])  # wire-up
    driver = nixl_engine._driver
    sweeps: list[float] = []  # each sweep's hot_from, as the poller reads it
    in_sweep = False
    real_sweep = driver.sweep

    async def sweep(agent, loop):
        nonlocal in_sweep
        in_sweep = True
        try:
            return await real_sweep(agent, loop)
        finally:
            in_sweep = False
            sweeps.append(driver.hot_from)

    monkeypatch.setattr(driver, "sweep", sweep)
    first = await nixl_engine.start_read(peer, [1], [1])  # 64 KiB: posted by the submit, in flight over TCP
    large = await nixl_engine.start_read(peer, range(64, 128), range(64, 128))  # 4 MiB, one slice: the poller posts it

    async def next_after_first():
        await first
        during = in_sweep, len(sweeps)  # (the running sweep's index)
        nxt = await nixl_engine.start_read(peer, [2], [2])
        return during, nxt, driver._hot_from(nxt, time.perf_counter())

    follow = asyncio.ensure_future(next_after_first())
    assert large.num_slices == 1, "the large read must be one slice (else its own slice to post keeps the poller hot)"
    time.sleep(0.05)  # the first read's data waits in our socket: the next poll's drain receives it
    (was_in_sweep, index), nxt, nxt_hot = await asyncio.wait_for(follow, 10)
    await asyncio.wait_for(asyncio.gather(nxt, large), 10)
    assert was_in_sweep, "the next read was not submitted while a sweep yielded (the set-up did not happen)"
    assert sweeps[index] <= nxt_hot, "the sweep the next read was submitted in left it out of its next check"


@pytest.mark.nixl_engine_config(slice_flight_s=0.2, post_target_s=0.0005)
async def test_slices_to_a_peer_over_tcp_grow_to_the_wire_rate(nixl_engine, nixl_peer_factory):
    """Posts over TCP return before the data moves: slices are sized from the wire, not the loop's stall."""
    _proc, tcp = await _tcp_peer(nixl_engine, nixl_peer_factory, 64, 1 << 20)
    first = await nixl_engine.read(tcp, range(64), range(64))  # sized as inline copies: 0.5 ms of copying
    second = await nixl_engine.read(tcp, range(64), range(64))
    # 0.2 s at the rate the first read moved (> 160 MB/s on loopback) is >= 32 MiB a slice
    assert first.slices >= 8 and second.slices <= 2, (first, second)
    host_copies = nixl_engine._driver.copy_rates.of(("DRAM", "DRAM"))
    untaught = host_copies.bytes_per_s
    cma_proc = nixl_peer_factory(num_regions=1, num_blocks=64, block_len=1 << 20)
    cma = await nixl_engine.connect(*cma_proc.address)
    for _ in range(2):  # over CMA each post is a copy inside the call: slices stay sized for the loop
        assert (await nixl_engine.read(cma, range(64), range(64))).slices >= 8  # (8 MiB is 0.5 ms at 16 GB/s)
    assert cma.link.inline and tcp.link.inline is False
    # The route's copy rate is taught by the CMA posts (inline copies) and was by none of the TCP ones
    assert untaught == CopyRate(nixl_engine.config).bytes_per_s != host_copies.bytes_per_s
    hints = nixl_engine.stats.counters["busy_hints_sent"]
    await nixl_engine.read(cma, range(64), range(64))
    assert nixl_engine.stats.counters["busy_hints_sent"] == hints, "a CMA peer has nothing in flight to serve"


async def test_inline_copies_beside_a_busy_python_thread_keep_their_slices(nixl_engine, nixl_peer_factory):
    """A post that copies inline (CMA here; cuda_ipc between GPUs) releases the GIL, and getting it back
    from a busy Python thread (vLLM's model thread) takes up to a switch interval. Timed as copying,
    that wait shrank every slice to the 1 MiB floor (64 posts, 64 waits, for each 64 MiB read here;
    0.1 GB/s over cuda_ipc on an H100). Not a TCP test: over TCP posts return at once."""
    proc = nixl_peer_factory(num_regions=1, num_blocks=64, block_len=1 << 20)
    regions = _regions(1, 64, 1 << 20)
    nixl_engine.register("kv", regions, block_len=1 << 20)
    peer = await nixl_engine.connect(*proc.address)
    stop = threading.Event()

    def model_thread() -> None:
        while not stop.is_set():  # pure Python: holds the GIL but for the interpreter's switches
            pass

    busy = threading.Thread(target=model_thread, daemon=True)
    busy.start()
    try:
        slices = [(await nixl_engine.read(peer, range(64), range(64)[::-1])).slices for _ in range(4)]
    finally:
        stop.set()
        busy.join()
    # Before: 64 every time. Now at least 2 ms of copying, >= 4 blocks at >= 2.1 GB/s, and longer while posts wait.
    assert slices[-1] <= 16, slices
    assert peer.link.inline
    waited = nixl_engine._driver.copy_rates.of(("DRAM", "DRAM")).wait_s
    assert waited > 0.001, "no post waited for the GIL: the test tested nothing"
    assert verify_blocks(regions, 1 << 20, range(64), range(64)[::-1], seed=proc.spec.seed) == []


async def test_a_peer_serving_reads_over_tcp_is_kept_progressing(nixl_engine, nixl_peer_factory):
    """Over TCP a READ moves only while the *peer's* worker is progressed; idle, it is progressed every 50 ms."""
    proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, 64, 1 << 20)
    await nixl_engine.read(peer, [0], [0])
    await asyncio.sleep(2.5)  # past the brisk window after the handshake: the peer's poller backs off to 50 ms
    before = (await proc.request(Stats()))["counters"]
    result = await nixl_engine.read(peer, range(64), range(64))
    after = (await proc.request(Stats()))["counters"]
    assert after["busy_hints_received"] > before.get("busy_hints_received", 0)
    # brisk, the peer checks every ~2 ms while the read is in flight (without the hint: every 50 ms,
    # and the read took ~1.6 s instead of ~50 ms)
    checks = after["poller_sleeps"] - before["poller_sleeps"]
    assert checks >= 0.3 * result.wire_seconds / 0.0025, (checks, result)


async def test_dead_peer_fails_the_transfer(nixl_engine, nixl_peer_factory):
    peer_proc = nixl_peer_factory(num_regions=1, num_blocks=64, block_len=1 << 20, tcp=True)
    nixl_engine.register("kv", _regions(1, 64, 1 << 20), block_len=1 << 20)
    peer = await nixl_engine.connect(*peer_proc.address)
    await nixl_engine.read(peer, [0], [0])
    transfer = await nixl_engine.start_read(peer, range(64), range(64), timeout=20)
    await peer_proc.akill()
    with pytest.raises((TransferFailed, TransferTimeout)):
        await transfer
    assert not nixl_engine.live_handles().get("xfers")


async def test_disconnected_peer_is_refused(nixl_engine, nixl_peer):
    nixl_engine.register("kv", _regions(), block_len=BLOCK)
    peer = await nixl_engine.connect(*nixl_peer.address)
    nixl_engine.disconnect(peer)
    with pytest.raises(PeerUnknownError):
        await nixl_engine.read(peer, [0], [0])
    assert not nixl_engine.live_handles().get("remote_agents")
    peer = await nixl_engine.connect(*nixl_peer.address)
    await nixl_engine.read(peer, [0], [0])


async def test_agent_refuses_other_threads(nixl_engine):
    errors = []

    def other():
        try:
            nixl_engine.register("kv", _regions(), block_len=BLOCK)
        except WrongThreadError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert errors and "owned by thread" in str(errors[0])
    assert not nixl_engine.live_handles().get("registrations")


async def test_overlapping_memory_is_refused(nixl_engine):
    shared = np.zeros(8 * BLOCK, np.uint8)
    with pytest.raises(LayoutError, match="overlap"):
        nixl_engine.register("kv", [shared, shared], block_len=BLOCK)
    nixl_engine.register("kv", [shared], block_len=BLOCK)
    with pytest.raises(LayoutError, match="overlaps registered layout 'kv'"):
        nixl_engine.register("again", [shared[BLOCK:]], block_len=BLOCK)
    assert nixl_engine.live_handles() == {"registrations": 1}


async def test_memory_nixl_cannot_use_as_given_is_refused(nixl_engine):
    """Before: a read-only array (bytes!) and an array of Python objects were registered and read into
    (the objects' pointers overwritten: a segfault), a conjugate view registered its raw bytes, and NIXL
    refusing memory (VRAM without CUDA here) was its raw binding error."""
    refused = [
        (np.frombuffer(bytes(BLOCK), np.uint8), "read-only"),
        (np.empty(BLOCK // 8, dtype=object), "Python objects"),
        (torch.zeros(BLOCK // 8, dtype=torch.complex64).conj(), "conjugate"),
    ]
    for memory, match in refused:
        with pytest.raises(LayoutError, match=match):
            nixl_engine.register("x", [memory], num_blocks=1)
    vram = BlockLayout.from_regions("gpu", [np.zeros(BLOCK, np.uint8).ctypes.data], num_blocks=1, block_len=BLOCK,
                                    mem_type=MemType.VRAM)  # fmt: skip
    if not torch.cuda.is_available():
        with pytest.raises(LayoutError, match="NIXL refused to register layout 'gpu'"):
            nixl_engine.register_layout(vram)
    assert not nixl_engine.live_handles().get("registrations")
    nixl_engine.register("x", [np.zeros(BLOCK, np.uint8)], num_blocks=1)  # the name was never taken


@pytest.mark.nixl_engine_config(transfer_timeout_s=1.0)
async def test_paused_peer_cannot_hang_a_caller(nixl_engine, nixl_peer_factory):
    """SIGSTOP the peer mid-transfer (TCP): the deadline ends the wait, typed, within the grace.

    The slices in flight cannot finish while the peer is stopped, so the caller hears that the
    memory is fenced; once the peer runs again they end and the fence clears.
    """
    block_len, blocks = 1 << 20, 64
    peer_proc, peer = await _tcp_peer(nixl_engine, nixl_peer_factory, blocks, block_len)
    await nixl_engine.read(peer, [0], [0])
    peer_proc.pause()
    try:
        started = asyncio.get_running_loop().time()
        transfer = await nixl_engine.start_read(peer, range(blocks), range(blocks), timeout=1.0)
        with pytest.raises(TransferFenced) as info:
            await transfer
        assert isinstance(info.value.reason, TransferTimeout)
        took = asyncio.get_running_loop().time() - started
        assert took < 1.0 + nixl_engine.config.release_grace_s + 1.0, took
        assert not transfer.quiet
    finally:
        peer_proc.resume()
    assert await transfer.wait_quiet(timeout=10)
    assert await transfers_settled(nixl_engine) == 0


async def test_an_engine_told_to_ignore_busy_hints_counts_them_but_stays_idle():
    """A host that pokes the engine itself (the vLLM producer, each step) turns busy hints off."""
    for follow in (True, False):
        config = EngineConfig(poll=PollConfig(follow_busy_hints=follow))
        async with TransferEngine(config) as engine:
            loop = asyncio.get_running_loop()
            engine._on_busy_hint(1.0)
            assert engine.stats.counters["busy_hints_received"] == 1
            assert (engine._pacer._brisk_until > loop.time() + 0.5) is follow


async def test_registered_bytes_counts_what_is_registered_now(nixl_engine):
    """Before, deregister() subtracted nothing: three rounds of 1 MiB left the counter at 3 MiB, nothing registered."""
    for _ in range(3):
        nixl_engine.register("scratch", [np.zeros(1 << 20, np.uint8)], block_len=4096)
        assert nixl_engine.snapshot().counters["registered_bytes"] == 1 << 20
        nixl_engine.deregister("scratch")
    assert nixl_engine.snapshot().counters["registered_bytes"] == 0
    async with TransferEngine(EngineConfig(engine_id="closing-registered")) as engine:
        engine.register("kv", [np.zeros(1 << 20, np.uint8)], block_len=4096)
    assert engine.snapshot().counters["registered_bytes"] == 0, "released at close"
