"""Peer death: the dead peer's callers get typed errors in time; everyone else is unaffected."""

import asyncio
import time

import numpy as np
import pytest

from nixl_async import HandshakeTimeout, TransferFailed, TransferTimeout
from nixl_async.testing import transfers_settled, verify_blocks

BLOCK, BLOCKS = 1 << 20, 32


async def test_sigkill_mid_transfer_fails_only_that_peer(nixl_engine, nixl_peer_factory):
    doomed = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, tcp=True, seed=1)
    healthy = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, tcp=True, seed=2)
    regions = [np.zeros(2 * BLOCKS * BLOCK, np.uint8) + 1]
    nixl_engine.register("kv", regions, block_len=BLOCK)
    to_doomed = await nixl_engine.connect(*doomed.address)
    to_healthy = await nixl_engine.connect(*healthy.address)
    await nixl_engine.read(to_doomed, [0], [0])
    await nixl_engine.read(to_healthy, [1], [0])

    deadline = 10.0
    started = time.monotonic()
    doomed_reads = [
        await nixl_engine.start_read(to_doomed, range(i * 8, i * 8 + 8), range(i * 8, i * 8 + 8), timeout=deadline)
        for i in range(4)
    ]
    healthy_reads = [
        await nixl_engine.start_read(to_healthy, range(BLOCKS + i * 8, BLOCKS + i * 8 + 8), range(i * 8, i * 8 + 8))
        for i in range(4)
    ]
    await doomed.akill()
    outcomes = await asyncio.gather(*(t.wait() for t in doomed_reads), return_exceptions=True)
    assert time.monotonic() - started < deadline + 1
    for outcome in outcomes:  # typed errors (a read may also have finished before the kill)
        assert not isinstance(outcome, BaseException) or isinstance(outcome, TransferFailed | TransferTimeout), outcome
    assert any(isinstance(o, BaseException) for o in outcomes), "expected the kill to interrupt a read"
    await asyncio.gather(*(t.wait() for t in healthy_reads))
    assert verify_blocks(regions, BLOCK, range(BLOCKS, 2 * BLOCKS), range(BLOCKS), seed=2) == []
    assert await transfers_settled(nixl_engine) == 0
    # and the healthy peer still serves new reads
    await nixl_engine.read(to_healthy, [0], [5])


async def test_a_peer_killed_while_our_handshake_waits_on_it_ends_at_the_timeout_holding_nothing(
    nixl_engine, nixl_peer_factory
):
    """ZMQ hides a peer's death from the asking side (it would reconnect), so the kill cannot end the
    handshake early: what counts is that it ends at its own timeout, typed, and loads nothing."""
    peer_proc = nixl_peer_factory()
    peer_proc.pause()  # its socket accepts connections, nobody answers
    started = time.monotonic()
    connecting = asyncio.ensure_future(nixl_engine.connect(*peer_proc.address, timeout=1.5))
    await asyncio.sleep(0.3)
    await peer_proc.akill()
    with pytest.raises(HandshakeTimeout):
        await connecting
    assert 1.4 < time.monotonic() - started < 3.0  # (asyncio may fire a timer a clock tick early)
    assert nixl_engine.peers == [] and not nixl_engine.live_handles().get("remote_agents")
