"""The poller is supervised: a bug that breaks a sweep fails the transfers in flight, and even if
failing them breaks too, the poller lives on. A dead poller would hang every caller: nothing would
see completions, deadlines or releases again."""

import asyncio
import contextlib
import time

import numpy as np
import pytest

from nixl_async import EngineConfig, TransferEngine, TransferFailed, TransferFenced
from nixl_async._agent import NIXL_ERRORS
from nixl_async.testing import TCP_TLS

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
    return calls


async def test_a_sweep_that_breaks_fails_the_transfers_in_flight(nixl_engine, nixl_peer_factory, monkeypatch):
    """A read in flight over TCP when a sweep breaks fails (its caller hears, once NIXL lets go of it)."""
    proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, seed=4, tcp=True)
    nixl_engine.register("kv", [np.zeros(BLOCKS * BLOCK, np.uint8)], block_len=BLOCK)
    peer = await nixl_engine.connect(*proc.address)
    swept = _break_once(monkeypatch, nixl_engine._driver, "sweep", RuntimeError("a bug in the sweep"))
    transfer = await nixl_engine.start_read(peer, range(BLOCKS), range(BLOCKS), timeout=5)
    with pytest.raises(TransferFailed, match="engine poller error: RuntimeError"):
        await asyncio.wait_for(transfer.wait(), 10)
    assert swept and transfer.quiet
    assert (await asyncio.wait_for(nixl_engine.read(peer, [1, 2], [3, 4]), 10)).nbytes == 2 * BLOCK


async def test_the_poller_outlives_a_failure_while_failing_the_transfers_in_flight(nixl_engine, nixl_peer_factory,
                                                                                   monkeypatch):  # fmt: skip
    proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, seed=4, tcp=True)
    nixl_engine.register("kv", [np.zeros(BLOCKS * BLOCK, np.uint8)], block_len=BLOCK)
    peer = await nixl_engine.connect(*proc.address)
    driver = nixl_engine._driver
    swept = _break_once(monkeypatch, driver, "sweep", RuntimeError("a bug in the sweep"))
    ended = _break_once(monkeypatch, driver, "end", RuntimeError("a bug while ending a transfer"))
    transfer = await nixl_engine.start_read(peer, range(BLOCKS), range(BLOCKS), timeout=5)
    with contextlib.suppress(TransferFailed):  # ending it broke: the next sweep carries it on, to its end
        await asyncio.wait_for(transfer.wait(), 10)
    assert swept and ended, "both faults were injected"
    assert not nixl_engine._poller.done(), "the poller died"
    result = await asyncio.wait_for(nixl_engine.read(peer, [1, 2], [3, 4]), 10)
    assert result.nbytes == 2 * BLOCK


async def test_a_caller_hears_fenced_when_every_sweep_breaks(nixl_peer_factory, monkeypatch):
    """A bug that breaks every sweep: the poller fails the transfers in flight, but no sweep watches
    their slices end any more. Past the grace their callers hear `TransferFenced` (before: they waited
    forever); once the sweeps work again the transfer goes quiet."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, seed=4, tcp=True)
    async with TransferEngine(EngineConfig(engine_id="broken-sweeps", release_grace_s=0.2)) as engine:
        engine.register("kv", [np.zeros(BLOCKS * BLOCK, np.uint8)], block_len=BLOCK)
        peer = await engine.connect(*proc.address)
        driver, broken = engine._driver, [True]
        real = driver.sweep

        async def sweep(*args, **kwargs):
            if broken[0] and driver.active:
                raise RuntimeError("a bug in every sweep")
            return await real(*args, **kwargs)

        transfer = await engine.start_read(peer, range(BLOCKS), range(BLOCKS))
        for _ in range(2000):
            if transfer.core.has_running:
                break
            await asyncio.sleep(0.0005)
        assert transfer.core.has_running, "nothing in flight: is UCX really using TCP?"
        monkeypatch.setattr(driver, "sweep", sweep)
        with pytest.raises(TransferFenced) as info:
            await asyncio.wait_for(asyncio.shield(transfer.wait()), 10)
        assert isinstance(info.value.reason, TransferFailed)
        broken[0] = False
        assert await transfer.wait_quiet(timeout=10)


@pytest.fixture(autouse=True)
def _quiet_poller_errors(caplog):
    caplog.set_level("CRITICAL", logger="nixl_async.engine")


async def test_nixl_trouble_draining_notifications_fails_no_transfer(nixl_engine, nixl_peer_factory, monkeypatch):
    """Draining notifications is the poller's housekeeping: a NIXL error there is logged, and the
    reads in flight go on (they all failed, as after a bug)."""
    proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, seed=4, tcp=True)
    nixl_engine.register("kv", [np.zeros(BLOCKS * BLOCK, np.uint8)], block_len=BLOCK)
    peer = await nixl_engine.connect(*proc.address)
    _break_once(monkeypatch, nixl_engine._agent, "notifications", NIXL_ERRORS[0]("NIXL_ERR_BACKEND"))
    transfer = await nixl_engine.start_read(peer, range(BLOCKS), range(BLOCKS), timeout=10)
    result = await asyncio.wait_for(transfer.wait(), 15)
    assert result.nbytes == BLOCKS * BLOCK
    assert nixl_engine.snapshot().counters.get("transfers_failures", 0) == 0


class _Refusing:
    """NIXL's agent, refusing to unload one remote agent (or every descriptor list) for good."""

    def __init__(self, agent, refuse_agent=None, refuse_dlists=False):
        self._agent, self._refuse_agent, self._refuse_dlists = agent, refuse_agent, refuse_dlists
        self.refused = 0

    def remove_remote_agent(self, name):
        if name == self._refuse_agent:
            self.refused += 1
            raise NIXL_ERRORS[0]("NIXL_ERR_BACKEND")
        return self._agent.remove_remote_agent(name)

    def release_dlist_handle(self, handle):
        if self._refuse_dlists:
            self.refused += 1
            raise NIXL_ERRORS[0]("NIXL_ERR_BACKEND")
        return self._agent.release_dlist_handle(handle)

    def __getattr__(self, name):
        return getattr(self._agent, name)


@pytest.mark.parametrize("what", ["remote_agents", "dlists"])
async def test_what_nixl_will_not_unload_is_left_to_it_and_counted(nixl_peer_factory, monkeypatch, what):
    """Forgotten peers whose remote agent (or lists) NIXL refuses to unload: the refusal is logged,
    the other peers are unloaded, reads in flight go on, the engine still closes, and its live
    handles say what NIXL kept. Asked once: the poller does not ask again on every pass."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, seed=4, tcp=True)
    forgotten = [nixl_peer_factory(num_regions=1, num_blocks=1, block_len=BLOCK, tcp=True) for _ in range(3)]
    engine = TransferEngine(EngineConfig(engine_id="refused-unload"))
    await engine.start()
    try:
        engine.register("kv", [np.zeros(BLOCKS * BLOCK, np.uint8)], block_len=BLOCK)
        peer = await engine.connect(*proc.address)
        gone = [await engine.connect(*p.address) for p in forgotten]
        for p in gone:
            await engine.read(p, [0], [0])  # prepares its descriptor lists
        agent = engine._agent
        before = agent.live_handles()
        refusing = _Refusing(agent._agent, refuse_agent=gone[0].agent_name if what == "remote_agents" else None,
                             refuse_dlists=what == "dlists")  # fmt: skip
        monkeypatch.setattr(agent, "_agent", refusing)
        transfer = await engine.start_read(peer, range(BLOCKS), range(BLOCKS), timeout=10)
        for p in gone:
            engine.disconnect(p)
        result = await asyncio.wait_for(transfer.wait(), 15)
        assert result.nbytes == BLOCKS * BLOCK
        asked = refusing.refused
        assert asked >= 1
        await asyncio.sleep(0.2)  # many poller passes
        assert refusing.refused == asked, "asked again on later passes"
        if what == "remote_agents":
            assert agent.live_handles()["remote_agents"] == before["remote_agents"] - 2, "the others are unloaded"
    finally:
        await asyncio.wait_for(engine.close(), 15)
    assert engine._agent is None, "the close finished"
    kept = engine.live_handles()
    if what == "remote_agents":
        assert kept == {"remote_agents": 1}, kept
    else:  # every release refused, ours at close too: the memory stays registered (and alive), never freed
        assert kept["dlists"] >= len(gone) and kept["registrations"] == 1, kept


async def test_a_read_submitted_while_the_poller_backs_off_from_errors_is_seen_done_at_once(
    nixl_engine, nixl_peer_factory, monkeypatch
):
    """Errors that repeat make the poller wait up to 1 s between sweeps. A read submitted in such a
    wait must not sit out the rest of it: its completion is looked for when it is due, as ever."""
    proc = nixl_peer_factory(num_regions=1, num_blocks=4, block_len=4096, seed=4, tcp=True)
    nixl_engine.register("kv", [np.zeros(4 * 4096, np.uint8)], block_len=4096)
    peer = await nixl_engine.connect(*proc.address)
    await nixl_engine.read(peer, [0], [0])  # wired up: the next read is a few ms on the wire
    peers, broken, failures = nixl_engine._peers, 7, []  # 7 errors in a row: a wait of 1 s after the last
    real = peers.evict_idle

    def evict_idle(now):
        if len(failures) < broken:
            failures.append(time.perf_counter())
            raise RuntimeError("a bug in the poller's housekeeping")
        return real(now)

    monkeypatch.setattr(peers, "evict_idle", evict_idle)
    nixl_engine.poll_soon()
    while len(failures) < broken:
        await asyncio.sleep(0.005)
    submitted = time.perf_counter()
    assert submitted - failures[-1] < 0.2, "the test came late into the last wait"
    result = await asyncio.wait_for(nixl_engine.read(peer, [1, 2], [1, 2]), 10)
    took = time.perf_counter() - submitted
    assert result.nbytes == 2 * 4096
    assert took < 0.5, f"the read waited {took:.2f} s: the poller's back-off held it"


async def test_pokes_do_not_cut_the_pollers_back_off_short(nixl_engine, monkeypatch):
    """A vLLM worker pokes the loop every 0.25 ms in idle steps: were each poke to end the back-off,
    an error that repeats would repeat at that pace, a core spent on failing sweeps."""
    peers, failures, broken = nixl_engine._peers, [], [True]

    def evict_idle(now):
        if broken[0]:
            failures.append(time.perf_counter())
            raise RuntimeError("a bug in the poller's housekeeping")

    monkeypatch.setattr(peers, "evict_idle", evict_idle)
    nixl_engine.poll_soon()
    while len(failures) < 7:  # the wait after the 7th is 1 s
        await asyncio.sleep(0.005)
    seen, last = len(failures), failures[-1]
    assert time.perf_counter() - last < 0.3, "the test came late into the last wait"
    while time.perf_counter() < last + 0.6:  # pokes every ms, well inside the 1 s wait
        nixl_engine.poll_soon()
        await asyncio.sleep(0.001)
    assert len(failures) == seen, f"{len(failures) - seen} more failing sweeps while poked"
    broken[0] = False
