"""The peer-process harness's `Reincarnate`: a new engine, agent and address over the same memory."""

import asyncio
import os
import signal
import socket

import numpy as np
import pytest

from nixl_async import HandshakeTimeout
from nixl_async.testing import Checksums, PeerCommandError, Reincarnate, Stats, verify_blocks

BLOCK = 4096


async def test_reincarnate_serves_the_same_memory_as_a_new_engine(nixl_engine, nixl_peer_factory):
    proc = nixl_peer_factory(engine_id="churn-0", num_regions=1, num_blocks=8, block_len=BLOCK, seed=5)
    kv = [np.zeros(8 * BLOCK, np.uint8)]
    nixl_engine.register("kv", kv, block_len=BLOCK)
    first = await nixl_engine.connect(*proc.address)
    old_address, sums = proc.address, await proc.request(Checksums(blocks=list(range(8))))

    host, port = await proc.reincarnate("churn-1")
    assert (host, port) == proc.address != old_address and proc.engine_id == proc.spec.engine_id == "churn-1"
    assert await proc.request(Checksums(blocks=list(range(8)))) == sums  # same control socket, same fill
    again = await nixl_engine.connect(host, port, expected_engine_id="churn-1")
    assert again.agent_name != first.agent_name and again.agent_name.startswith("churn-1/")
    await nixl_engine.read(again, [2], [6])
    assert verify_blocks(kv, BLOCK, [2], [6], seed=5) == []
    with pytest.raises(HandshakeTimeout):  # the old incarnation is gone
        await nixl_engine.connect(*old_address, refresh=True, timeout=0.3)

    # The same engine id again, at the very same port: only the agent changes (a restart in place).
    assert await proc.reincarnate("churn-1", port=port) == (host, port)
    restarted = await nixl_engine.connect(host, port, refresh=True)
    assert restarted.engine_id == "churn-1" and restarted.agent_name != again.agent_name
    await nixl_engine.read(restarted, [3], [7])
    assert verify_blocks(kv, BLOCK, [3], [7], seed=5) == []


async def test_a_failed_reincarnation_reports_and_the_harness_still_stops(nixl_peer_factory):
    proc = nixl_peer_factory(num_regions=1, num_blocks=4, block_len=BLOCK)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(PeerCommandError, match="in use"):
            await proc.request(Reincarnate(engine_id="x", port=taken.getsockname()[1]))
    assert await proc.astop() == 0


async def test_idle_poll_keeps_an_idle_peer_progressing(nixl_peer_factory):
    """`idle_poll_s`: the TCP benchmarks' peers check every 2 ms when idle, as a hinted peer does, since raw
    NIXL loops send no busy hints (a peer at its 50 ms idle backoff serves their TCP reads at a fraction)."""
    brisk = nixl_peer_factory(num_regions=1, num_blocks=4, block_len=BLOCK, idle_poll_s=0.002)
    backing_off = nixl_peer_factory(num_regions=1, num_blocks=4, block_len=BLOCK)

    async def polls_in_a_second(proc) -> int:
        before = (await proc.request(Stats()))["counters"]["polls"]
        await asyncio.sleep(1.0)
        return (await proc.request(Stats()))["counters"]["polls"] - before

    brisk_polls, idle_polls = await asyncio.gather(polls_in_a_second(brisk), polls_in_a_second(backing_off))
    assert brisk_polls >= 150 and idle_polls <= 60, (brisk_polls, idle_polls)  # ~2-3 ms apart; 50 ms apart


async def test_a_peer_logging_after_it_is_ready_keeps_serving(nixl_engine, nixl_peer_factory):
    """The parent reads the peer's stdout only up to its ready line; UCX logs to stdout. Before, once the
    pipe's 64 KiB filled the peer blocked inside a log call: reads fenced, commands timed out. (And a
    partial line of C's buffered stdio could run into the ready line, which then did not parse.)"""
    nixl_engine.register("kv", [np.zeros(8 * BLOCK, np.uint8)], block_len=BLOCK)
    proc = nixl_peer_factory(num_regions=1, num_blocks=8, block_len=BLOCK, seed=4, tcp=True,
                             env={"UCX_LOG_LEVEL": "debug"})  # fmt: skip
    peer = await nixl_engine.connect(*proc.address)
    for _ in range(20):
        await nixl_engine.read(peer, [1, 2], [3, 4], timeout=30)
    assert (await proc.request(Stats(), timeout=30))["counters"]["polls"] > 0
    assert os.fstat(proc._stderr.fileno()).st_size > 1 << 16, "less logged than a pipe holds: this proves nothing"
    assert "UCX" in proc.stderr(), "the peer's log goes to its stderr file"


_PAUSED_THEN_KILLED = """
import os, signal, sys
from nixl_async.testing.peer_process import PeerProcess, PeerSpec
peer = PeerProcess(PeerSpec(engine_id="paused-orphan")).start()
print(peer.pid, flush=True)
peer.pause()
os.kill(os.getpid(), signal.SIGKILL)  # a run killed from outside, its peer paused
"""


def test_a_paused_peer_goes_when_the_run_is_killed():
    """A paused (stopped) peer cannot see its parent die: before, it stayed for good, holding its ports and
    memory. Its watcher kills it within a second or so."""
    import subprocess
    import sys
    import time

    done = subprocess.run([sys.executable, "-c", _PAUSED_THEN_KILLED], capture_output=True, text=True, timeout=60)
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(") ")[1].startswith("Z"):
                    break  # (a zombie until init reaps it: gone)
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the paused peer {pid} outlived the run that paused it")
