"""Producer-side leases: blocks lent to a reader are released on notification or expiry, and a
late read is refused before anything is posted."""

import asyncio
import gc
import time

import numpy as np
import pytest

from nixl_async import EngineConfig, LeaseExpired, TransferEngine, TransferState, TransferTimeout, WrongThreadError
from nixl_async.testing import (
    TCP_TLS,
    PeerCommandError,
    Stats,
    TransferCommand,
    fill_pattern,
    pattern_block,
    until_in_flight,
)

BLOCK = 4096


async def test_lease_expires_when_the_reader_vanishes_and_late_reads_are_refused(nixl_engine, nixl_peer):
    regions = [np.zeros(64 * BLOCK, np.uint8) for _ in range(2)]
    fill_pattern(regions, seed=77)
    nixl_engine.register("kv", regions, block_len=BLOCK)
    host, port = nixl_engine.address

    lease = nixl_engine.lend(b"req-gone", readers=1, ttl_s=0.4)
    started = time.monotonic()
    assert await asyncio.wait_for(lease.wait(), 5) is False, "nobody read: the lease must expire"
    assert 0.35 < time.monotonic() - started < 2.0

    late = TransferCommand(op="READ", host=host, port=port, local_blocks=[0], remote_blocks=[3],
                           notify=b"req-gone", lease_expires_at=lease.expires_at)  # fmt: skip
    with pytest.raises(PeerCommandError, match="LeaseExpired"):
        await nixl_peer.request(late)
    counters = (await nixl_peer.request(Stats()))["counters"]
    assert counters.get("transfers_submitted", 0) == 0 and counters["lease_refusals"] == 1


async def test_reader_within_its_lease_releases_the_blocks(nixl_engine, nixl_peer_factory):
    regions = [np.zeros(64 * BLOCK, np.uint8) for _ in range(2)]
    fill_pattern(regions, seed=78)
    nixl_engine.register("kv", regions, block_len=BLOCK)
    host, port = nixl_engine.address
    readers = [nixl_peer_factory(), nixl_peer_factory()]

    lease = nixl_engine.lend(b"req-ok", readers=2, ttl_s=30)
    read = TransferCommand(op="READ", host=host, port=port, local_blocks=[1, 2], remote_blocks=[5, 6],
                           notify=b"req-ok", lease_expires_at=lease.expires_at)  # fmt: skip
    for reader in readers:
        await reader.request(read)
    assert await asyncio.wait_for(lease.wait(), 10) is True
    for reader in readers:
        assert (await reader.request(Stats()))["counters"]["transfers_done"] == 1


async def test_handshake_measures_the_clock_offset(nixl_engine, nixl_peer):
    peer = await nixl_engine.connect(*nixl_peer.address)
    assert abs(peer.clock_offset_s) < 0.05  # same host: the clocks agree


@pytest.mark.parametrize(("readers", "ttl_s"), [(0, 5), (-1, 5), (True, 5), (1.5, 5), (1, float("nan")),
                                                (1, float("inf")), (1, 0), (1, "5")])  # fmt: skip
async def test_a_lease_nobody_could_end_is_refused_at_once(nixl_engine, readers, ttl_s):
    """Before, `readers=0` was taken and failed later in a task nobody awaited ("never retrieved"),
    and a NaN ttl gave a lease with `expires_at` NaN (every reader's lease check passes or fails)."""
    with pytest.raises(ValueError, match=r"readers|ttl_s"):
        nixl_engine.lend(b"req-bad", readers=readers, ttl_s=ttl_s)


async def test_a_lease_the_close_ends_logs_nothing_never_retrieved(caplog):
    """A lease still held when the engine closes ends with the close; nobody awaited it, so nothing
    may be logged as a task exception never retrieved."""
    engine = await TransferEngine(EngineConfig(engine_id="lender")).start()
    lease = engine.lend(b"req-held", readers=1, ttl_s=60)
    await engine.close()
    await asyncio.sleep(0.05)
    assert lease.done()
    del lease
    gc.collect()
    await asyncio.sleep(0.05)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


# -- a lease renewed while its read is in flight (UCX over TCP: the read really is in flight) ----------
TCP_BLOCK = 1 << 20
TCP_BLOCKS = 32


@pytest.fixture
async def tcp_reader(monkeypatch, nixl_peer_factory):
    """(reader engine, its regions, the connected peer, the peer's process); the peer's blocks hold seed 5."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)  # read when the agent's UCX worker is created
    proc = nixl_peer_factory(num_regions=1, num_blocks=TCP_BLOCKS, block_len=TCP_BLOCK, seed=5, tcp=True)
    engine = await TransferEngine(EngineConfig(engine_id="lease-reader")).start()
    regions = [np.zeros(TCP_BLOCKS * TCP_BLOCK, np.uint8)]
    engine.register("kv", regions, block_len=TCP_BLOCK)
    peer = await engine.connect(*proc.address)
    try:
        yield engine, regions, peer, proc
    finally:
        proc.resume()
        await engine.close()


async def _held_in_flight(engine, peer, proc, **kwargs):
    """A read of every block, in flight, with the peer stopped (SIGSTOP) so it stays so."""
    ids = list(range(TCP_BLOCKS))
    transfer = await engine.start_read(peer, ids, ids, **kwargs)
    await until_in_flight(transfer)
    proc.pause()
    return transfer


async def test_a_lease_running_out_mid_read_is_reported_as_such(tcp_reader):
    """Before, a lease that ran out while the read was in flight ended it as `TransferTimeout`."""
    engine, _regions, peer, proc = tcp_reader
    transfer = await _held_in_flight(engine, peer, proc, lease_expires_at=time.time() + 0.3)
    await asyncio.sleep(0.4)
    proc.resume()
    with pytest.raises(LeaseExpired):
        await transfer


async def test_a_renewed_lease_lets_the_read_in_flight_finish(tcp_reader):
    engine, regions, peer, proc = tcp_reader
    transfer = await _held_in_flight(engine, peer, proc, lease_expires_at=time.time() + 0.3)
    assert engine.renew_lease([transfer], time.time() + 30) == 1
    await asyncio.sleep(0.5)  # past the first lease, the peer still stopped
    proc.resume()
    result = await transfer
    assert result.nbytes == TCP_BLOCKS * TCP_BLOCK
    assert np.array_equal(regions[0][:TCP_BLOCK], pattern_block(5, 0, 0, TCP_BLOCK))
    assert engine.renew_lease([transfer], time.time() + 60) == 0, "an ended transfer is left alone"


async def test_a_renewal_never_runs_past_the_transfers_own_timeout(tcp_reader):
    engine, _regions, peer, proc = tcp_reader
    transfer = await _held_in_flight(engine, peer, proc, timeout=0.4, lease_expires_at=time.time() + 0.2)
    engine.renew_lease([transfer], time.time() + 30)
    started = time.monotonic()
    await asyncio.sleep(0.5)
    proc.resume()
    with pytest.raises(TransferTimeout):
        await transfer
    assert time.monotonic() - started < 2.0


async def test_a_lease_the_producer_let_go_ends_the_read(tcp_reader):
    """A renewal saying the blocks are gone (expired already) ends the read as `LeaseExpired`,
    reported once NIXL holds none of its handles; nothing lands after that."""
    engine, regions, peer, proc = tcp_reader
    transfer = await _held_in_flight(engine, peer, proc, lease_expires_at=time.time() + 30)
    assert engine.renew_lease([transfer], 0.0) == 1
    assert transfer.state is not TransferState.POSTING
    proc.resume()
    with pytest.raises(LeaseExpired):
        await transfer
    snapshot = regions[0].copy()
    await asyncio.sleep(0.5)
    assert np.array_equal(snapshot, regions[0]), "bytes landed after the read was reported ended"


async def test_renew_lease_refuses_nan_and_other_threads(tcp_reader):
    engine, _regions, peer, _proc = tcp_reader
    transfer = await engine.start_read(peer, [0], [0], lease_expires_at=time.time() + 30)
    with pytest.raises(ValueError, match="NaN"):
        engine.renew_lease([transfer], float("nan"))
    with pytest.raises(WrongThreadError):
        await asyncio.to_thread(engine.renew_lease, [transfer], time.time() + 60)
    await transfer
    assert engine.renew_lease([transfer], time.time() + 60) == 0


async def test_a_lease_running_out_while_waiting_for_room_is_reported_as_such(monkeypatch, nixl_peer_factory):
    """Before, a submit waiting for room past its lease failed as `TransferTimeout` (a `TimeoutError`)."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    proc = nixl_peer_factory(num_regions=1, num_blocks=TCP_BLOCKS, block_len=TCP_BLOCK, seed=5, tcp=True)
    async with TransferEngine(EngineConfig(engine_id="lease-waiter", max_inflight_transfers=1)) as engine:
        engine.register("kv", [np.zeros(TCP_BLOCKS * TCP_BLOCK, np.uint8)], block_len=TCP_BLOCK)
        peer = await engine.connect(*proc.address)
        holding = await _held_in_flight(engine, peer, proc)  # takes the only room, and keeps it
        try:
            with pytest.raises(LeaseExpired, match="waiting for room"):
                await engine.start_read(peer, [0], [0], lease_expires_at=time.time() + 0.2, timeout=10)
            with pytest.raises(TransferTimeout):  # its own timeout first: a timeout, as before
                await engine.start_read(peer, [0], [0], lease_expires_at=time.time() + 10, timeout=0.2)
        finally:
            proc.resume()
        await holding


async def test_a_read_seen_done_only_after_its_lease_names_its_transfer(tcp_reader):
    """The read's bytes arrived while the loop was held past its lease, so the check that saw it done refused it
    (`LeaseExpired`): before, that error alone carried no `transfer_id` (every other one does)."""
    engine, _regions, peer, proc = tcp_reader
    await engine.read(peer, [0], [0])  # (wired up)
    proc.pause()
    transfer = await engine.start_read(peer, [1], [1], lease_expires_at=time.time() + 0.2)
    await asyncio.sleep(0.05)
    proc.resume()
    time.sleep(0.4)  # (the loop held: the peer answers, nothing is checked until the lease has passed)
    with pytest.raises(LeaseExpired, match="during the READ") as expired:
        await transfer
    assert expired.value.transfer_id == transfer.id
