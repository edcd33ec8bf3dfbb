"""The engine where a caller least expects trouble: a post that raises, an empty notification, a refused
deregister, `asyncio.run`'s shutdown, and a close from the wrong loop (real NIXL, a peer process)."""

import asyncio
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

from nixl_async import LayoutError, TransferFailed, WrongThreadError
from nixl_async._agent import NIXL_ERRORS
from nixl_async.testing import Checksums, PeerCommandError, WaitNotifications, transfers_settled

BLOCK = 1 << 20


@pytest.mark.parametrize("blocks", [1, 8], ids=["one_slice", "eight_slices"])
@pytest.mark.nixl_engine_config(max_post_bytes=BLOCK, min_post_bytes=BLOCK)
async def test_a_notifying_write_whose_last_post_raises_fails(nixl_engine, nixl_peer_factory, monkeypatch, blocks):
    """A WRITE's notification rides on its last slice; a post of that slice that raises an error not NIXL's
    (a binding refusing an argument) sent nothing: the WRITE fails, and the peer hears nothing. Before, the
    slice counted as handed out, so the WRITE "landed": the caller was told it succeeded and notified."""
    proc = nixl_peer_factory(num_regions=1, num_blocks=blocks, block_len=BLOCK, tcp=True)
    nixl_engine.register("kv", [np.full(blocks * BLOCK, 7, np.uint8)], block_len=BLOCK)
    peer = await nixl_engine.connect(*proc.address)
    before = await proc.request(Checksums(blocks=[blocks - 1]))
    agent = nixl_engine._agent
    make_xfer = agent.make_xfer

    def refuses_notifications(op, local, lidx, remote, ridx, notif=b""):
        if notif:
            raise TypeError("a binding refused an argument")
        return make_xfer(op, local, lidx, remote, ridx, notif)

    monkeypatch.setattr(agent, "make_xfer", refuses_notifications)
    transfer = await nixl_engine.start_write(peer, list(range(blocks)), list(range(blocks)), notify=b"written")
    with pytest.raises(TransferFailed, match="TypeError"):
        await asyncio.wait_for(transfer, 30)
    assert transfer.slices_errored >= 1
    assert await proc.request(Checksums(blocks=[blocks - 1])) == before  # the last block was never written
    with pytest.raises(PeerCommandError, match="NotificationTimeout"):
        await proc.request(WaitNotifications(message=b"written", timeout=1.0))
    monkeypatch.setattr(agent, "make_xfer", make_xfer)
    assert (await nixl_engine.write(peer, [0], [0], notify=b"again")).notified
    assert await proc.request(WaitNotifications(message=b"again", timeout=10)) == [nixl_engine.engine_id]
    assert await transfers_settled(nixl_engine) == 0


async def test_an_empty_notification_on_a_write_is_refused(nixl_engine, nixl_peer):
    """NIXL attaches no empty notification to a WRITE: the caller would be told `notified` while the peer,
    waiting for it, heard nothing. Refused at the submit, nothing posted (a READ's empty one is sent)."""
    nixl_engine.register("kv", [np.zeros(64 * 4096, np.uint8) for _ in range(2)], block_len=4096)
    peer = await nixl_engine.connect(*nixl_peer.address)
    with pytest.raises(ValueError, match="empty notification"):
        await nixl_engine.start_write(peer, [0], [0], notify=b"")
    with pytest.raises(ValueError, match="empty notification"):
        await nixl_engine.start_writes(peer, [[0], []], [[0], []], notify=[b"", b""])
    assert nixl_engine.stats.counters["transfers_submitted"] == 0
    await nixl_engine.write(peer, [], [], notify=b"")  # no blocks: it travels alone, and may be empty
    assert await nixl_peer.request(WaitNotifications(message=b"", timeout=10)) == [nixl_engine.engine_id]
    assert (await nixl_engine.read(peer, [0], [0], notify=b"")).notified
    assert await nixl_peer.request(WaitNotifications(message=b"", timeout=10)) == [nixl_engine.engine_id]


async def test_a_deregister_nixl_refuses_leaves_the_layout_registered(nixl_engine, nixl_peer, monkeypatch):
    """NIXL refusing to deregister: a typed error, and the layout stays registered, offered and referenced
    (before: its memory was no longer referenced, so it could be freed while NIXL still had it registered
    and peers could reach it, and a second deregister said there was no such layout)."""
    region = np.zeros(64 * 4096, np.uint8)
    alive = weakref.ref(region)
    nixl_engine.register("kv", [region, np.zeros(64 * 4096, np.uint8)], block_len=4096)
    peer = await nixl_engine.connect(*nixl_peer.address)
    await nixl_engine.read(peer, [0], [1])  # (a prepared descriptor list over it)
    agent = nixl_engine._agent

    def refuses(memory):
        raise NIXL_ERRORS[0]("NIXL_ERR_BACKEND (refused by the test)")

    monkeypatch.setattr(agent, "deregister", refuses)
    with pytest.raises(LayoutError, match="refused to deregister"):
        nixl_engine.deregister("kv")
    del region
    assert alive() is not None and "kv" in nixl_engine._memory.layouts
    assert (await nixl_engine.read(peer, [2], [3])).nbytes == 2 * 4096
    monkeypatch.undo()
    nixl_engine.deregister("kv")
    assert "kv" not in nixl_engine._memory.layouts


_SHUTDOWN = """
import asyncio, os, sys, threading, time
import numpy as np
from nixl_async import EngineConfig, TransferEngine
from nixl_async.testing import TCP_ENV
from nixl_async.testing.peer_process import PeerProcess, PeerSpec

os.environ.update(TCP_ENV)
BLOCK, BLOCKS = 1 << 20, 96
proc = PeerProcess(PeerSpec(engine_id="shutdown-peer", num_regions=1, num_blocks=BLOCKS, block_len=BLOCK),
                   env=TCP_ENV).start()
seen = {}

async def serve():
    async with TransferEngine(EngineConfig(engine_id="shutdown-reader")) as engine:
        engine.register("kv", [np.zeros(BLOCKS * BLOCK, np.uint8)], block_len=BLOCK)
        peer = await engine.connect(*proc.address)
        while True:  # a service reading again and again, until the process ends
            seen["transfer"] = await engine.start_read(peer, list(range(BLOCKS)), list(range(BLOCKS)))
            await seen["transfer"]

async def main():
    asyncio.get_running_loop().create_task(serve())
    while "transfer" not in seen or not seen["transfer"].core.has_running:
        await asyncio.sleep(0.0005)

def watchdog():
    time.sleep(30)
    print("hung", flush=True)
    proc.kill()
    os._exit(3)

threading.Thread(target=watchdog, daemon=True).start()
asyncio.run(main())
print("returned", seen["transfer"].state.name, seen["transfer"].quiet, flush=True)
proc.stop(timeout=5)
"""


def test_asyncio_run_returns_while_a_task_awaits_a_transfer_in_flight():
    """`asyncio.run`'s shutdown cancels every task left, the poller among them, while a task awaits a READ in
    flight over TCP: the poller closes the engine (its transfers end once NIXL lets go) and the run returns.
    Before, nothing progressed NIXL any more: the transfer never ended, nor did the process."""
    done = subprocess.run([sys.executable, "-c", _SHUTDOWN], capture_output=True, text=True, timeout=90)
    assert "returned CANCELLED True" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "closing the engine now" in done.stderr


async def test_close_from_another_loop_is_refused_and_leaves_the_engine_working(nixl_engine, nixl_peer):
    """Before, `close()` awaited on another thread's loop cancelled the poller and stored a closer that failed
    there: the engine refused all work yet held its agent and memory for good."""
    nixl_engine.register("kv", [np.zeros(64 * 4096, np.uint8) for _ in range(2)], block_len=4096)
    peer = await nixl_engine.connect(*nixl_peer.address)
    raised: list[BaseException] = []

    def elsewhere() -> None:
        try:
            asyncio.run(nixl_engine.close())
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    await asyncio.to_thread(thread.join)
    assert len(raised) == 1 and isinstance(raised[0], WrongThreadError)
    assert (await nixl_engine.read(peer, [0], [1])).nbytes == 2 * 4096


async def test_serving_on_a_taken_port_raises_oserror_and_serving_elsewhere_works():
    """A bind that fails is an `OSError` with its errno (before: ZMQ's own `ZMQError`), and nothing is left
    half-serving: the engine serves on another port right after."""
    import errno
    import socket

    from nixl_async import EngineConfig, TransferEngine

    async with TransferEngine(EngineConfig(engine_id="taken")) as engine:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            with pytest.raises(OSError, match="cannot serve handshakes") as info:
                await engine.serve("127.0.0.1", taken.getsockname()[1])
            assert info.value.errno == errno.EADDRINUSE
        assert (await engine.serve("127.0.0.1", 0))[1] > 0


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
@pytest.mark.parametrize("via", ["nixl", "side_channel"])
@pytest.mark.parametrize("given", ["::1", "[::1]"])
async def test_an_ipv6_side_channel_serves_handshakes_and_notifications(via, given):
    """ZMQ speaks IPv4 alone unless each socket is told, and wants IPv6 hosts in brackets: before, `serve("::1")`
    raised ZMQ's "No such device" and a connect to an IPv6 address waited out its timeout (`HandshakeTimeout`)."""
    from nixl_async import EngineConfig, TransferEngine

    async with (
        TransferEngine(EngineConfig(engine_id="v6-reader", notify_via=via)) as reader,
        TransferEngine(EngineConfig(engine_id="v6-server", notify_via=via)) as server,
    ):
        reader.register("kv", [np.zeros(4 * 4096, np.uint8)], block_len=4096)
        server.register("kv", [np.arange(4 * 4096, dtype=np.uint8)], block_len=4096)
        host, port = await server.serve(given, 0)
        assert host == "::1"
        peer = await reader.connect(given, port, timeout=5)
        await reader.notify(peer, b"over-ipv6")
        assert await server.wait_notifications(b"over-ipv6", timeout=5) == ["v6-reader"]
        assert (await reader.read(peer, [0], [1], notify=b"read-v6")).nbytes == 4096
        assert await server.wait_notifications(b"read-v6", timeout=5) == ["v6-reader"]


async def test_deregistered_memory_a_peer_had_the_keys_to_is_not_registered_again(nixl_engine):
    """An audit of session 39: a peer holding our older metadata still reaches deregistered memory over UCX/TCP
    (nothing checks keys), so the engine keeps it alive; but the same tensor could be registered again (under
    any name), and that peer's stale WRITE would then land among the new layout's data. Memory no peer was
    given the keys to (no handshake answered, no record published while registered) may be laid out anew."""
    from nixl_async import EngineConfig, TransferEngine

    region = np.zeros(8 * 4096, np.uint8)
    nixl_engine.register("kv", [region], block_len=4096)
    nixl_engine.deregister("kv")
    nixl_engine.register("kv", [region], block_len=8192)  # no peer saw it: laid out anew
    async with TransferEngine(EngineConfig(engine_id="keyholder")) as other:
        await other.connect(*nixl_engine.address)  # our reply carries the keys to "kv"
    nixl_engine.deregister("kv")
    for name, memory in (("kv", region), ("kv2", region), ("half", region[4096:8192])):
        with pytest.raises(LayoutError, match="overlaps memory deregistered from layout 'kv'"):
            nixl_engine.register(name, [memory], block_len=4096)
        assert name not in nixl_engine._memory.layouts
    nixl_engine.register("kv", [np.zeros(8 * 4096, np.uint8)], block_len=4096)  # other memory: taken


async def test_a_submit_that_only_notifies_is_refused_as_any_submit(nixl_engine, nixl_peer_factory):
    """An audit of session 39: a submit with no blocks sent its notification before any check: past its lease
    (the adapter never notifies then: the producer counts it a stray), with its budget spent, or from a task
    outliving its `collect_transfers()` block; each is refused now, nothing sent."""
    import time

    from nixl_async import CollectionClosedError, LeaseExpired, TransferTimeout

    nixl_peer = nixl_peer_factory(num_regions=2, num_blocks=64, block_len=4096, tcp=True)
    nixl_engine.register("kv", [np.zeros(64 * 4096, np.uint8) for _ in range(2)], block_len=4096)  # as the peer's
    peer = await nixl_engine.connect(*nixl_peer.address)
    await nixl_engine.read(peer, [0, 1], [0, 1])  # (wired up over TCP)
    with pytest.raises(LeaseExpired):
        await nixl_engine.start_read(peer, [], [], notify=b"late", lease_expires_at=time.time() - 1)
    with pytest.raises(TransferTimeout):
        await nixl_engine.start_read(peer, [], [], notify=b"late", timeout=-1)
    with pytest.raises(LeaseExpired):
        await nixl_engine.start_reads(peer, [[]], [[]], notify=[b"late"], lease_expires_at=time.time() - 1)
    gate = asyncio.Event()

    async def outlives_its_block():
        await gate.wait()
        await nixl_engine.start_read(peer, [], [], notify=b"late")

    with nixl_engine.collect_transfers():
        straggler = asyncio.ensure_future(outlives_its_block())
    gate.set()
    with pytest.raises(CollectionClosedError):
        await straggler
    with pytest.raises(PeerCommandError, match="NotificationTimeout"):
        await nixl_peer.request(WaitNotifications(message=b"late", count=1, timeout=1.0))
    await nixl_engine.read(peer, [], [], notify=b"in time")  # within its lease and budget: sent
    await nixl_peer.request(WaitNotifications(message=b"in time", count=1, timeout=5))
