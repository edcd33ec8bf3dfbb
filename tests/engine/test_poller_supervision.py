"""The poller is supervised: a bug that breaks a sweep fails the transfers in flight, and even if
failing them breaks too, the poller lives on. A dead poller would hang every caller: nothing would
see completions, deadlines or releases again."""

import asyncio
import contextlib

import numpy as np
import pytest

from nixl_async import TransferFailed
from nixl_async._agent import NIXL_ERRORS

BLOCK, BLOCKS = 1 << 20, 32


def _break_once(monkeypatch, obj, name, error):
    real, calls = getattr(obj, name), []

    async def broken_async(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return await real(*args, **kwargs)

    def broken(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, broken_async if asyncio.iscoroutinefunction(real) else broken)


async def test_the_poller_outlives_a_failure_while_failing_the_transfers_in_flight(nixl_engine, nixl_peer_factory,
                                                                                   monkeypatch):  # fmt: skip
    proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, seed=4, tcp=True)
    nixl_engine.register("kv", [np.zeros(BLOCKS * BLOCK, np.uint8)], block_len=BLOCK)
    peer = await nixl_engine.connect(*proc.address)
    driver = nixl_engine._driver
    _break_once(monkeypatch, driver, "sweep", RuntimeError("a bug in the sweep"))
    _break_once(monkeypatch, driver, "end", RuntimeError("a bug while ending a transfer"))
    transfer = await nixl_engine.start_read(peer, range(BLOCKS), range(BLOCKS), timeout=5)
    with contextlib.suppress(TransferFailed):  # ending it broke: the next sweep carries it on, to its end
        await asyncio.wait_for(transfer.wait(), 10)
    assert not nixl_engine._poller.done(), "the poller died"
    result = await asyncio.wait_for(nixl_engine.read(peer, [1, 2], [3, 4]), 10)
    assert result.nbytes == 2 * BLOCK


@pytest.fixture(autouse=True)
def _quiet_poller_errors(caplog):
    caplog.set_level("CRITICAL", logger="nixl_async.engine")


@pytest.mark.parametrize("where", ["notifications", "remove_remote"])
async def test_nixl_trouble_draining_or_unloading_a_peer_fails_no_transfer(nixl_engine, nixl_peer_factory, monkeypatch,
                                                                          where):  # fmt: skip
    """Draining notifications and unloading a forgotten peer are the poller's housekeeping: a NIXL
    error there is logged, and the reads in flight go on (they all failed, as after a bug)."""
    proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, seed=4, tcp=True)
    other = nixl_peer_factory(num_regions=1, num_blocks=1, block_len=BLOCK, tcp=True)
    nixl_engine.register("kv", [np.zeros(BLOCKS * BLOCK, np.uint8)], block_len=BLOCK)
    peer = await nixl_engine.connect(*proc.address)
    gone = await nixl_engine.connect(*other.address)
    agent = nixl_engine._agent
    _break_once(monkeypatch, agent, where, NIXL_ERRORS[0]("NIXL_ERR_BACKEND"))
    transfer = await nixl_engine.start_read(peer, range(BLOCKS), range(BLOCKS), timeout=10)
    nixl_engine.disconnect(gone)  # its remote agent is unloaded by the poller's next pass
    result = await asyncio.wait_for(transfer.wait(), 15)
    assert result.nbytes == BLOCKS * BLOCK
    assert nixl_engine.snapshot().counters.get("transfers_failures", 0) == 0
