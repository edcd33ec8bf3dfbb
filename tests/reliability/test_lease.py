"""Producer-side leases: blocks lent to a reader are released on notification or expiry, and a
late read is refused before anything is posted."""

import asyncio
import gc
import time

import numpy as np
import pytest

from nixl_async import EngineConfig, TransferEngine
from nixl_async.testing import PeerCommandError, Stats, TransferCommand, fill_pattern

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
