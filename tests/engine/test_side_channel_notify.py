"""Notifications over the side channel (`EngineConfig(notify_via="side_channel")`), real NIXL.

Why they exist: after a NIXL notification, UCX holds the sender's next operation to that peer
until the peer's worker is progressed (an idle peer polls only every few ms). Side-channel
notifications wake the peer's loop through its socket and hold nothing.
"""

import asyncio
import time

import numpy as np
import pytest
import zmq

from nixl_async import EngineConfig, TransferEngine, messages
from nixl_async.testing import WaitNotifications, verify_blocks

BLOCK = 4096
SECRET = b"s" * 32


def _regions(n=2, blocks=32, fill=0):
    return [np.full(blocks * BLOCK, fill, dtype=np.uint8) for _ in range(n)]


async def _pair(reader_config: EngineConfig, producer_config: EngineConfig):
    producer = await TransferEngine(producer_config).start()
    reader = await TransferEngine(reader_config).start()
    producer.register("kv", _regions(fill=7), block_len=BLOCK)
    reader.register("kv", _regions(), block_len=BLOCK)
    await producer.serve()
    peer = await reader.connect(*producer.address)
    return producer, reader, peer


@pytest.mark.parametrize("notify_via", ["side_channel", "nixl"])
async def test_read_notification_arrives_and_next_read_is_not_held(nixl_peer_factory, notify_via):
    """Over CMA a READ is a copy inside its post, so the post of the read after a notification says
    whether UCX held it: "DONE" (copied at once) or "PROC" (queued behind the notification until the
    producer's worker is progressed). NIXL's notification holds it; the side channel must not."""
    producer = nixl_peer_factory(num_blocks=32, block_len=BLOCK, seed=3)
    async with TransferEngine(EngineConfig(engine_id="reader", notify_via=notify_via)) as reader:
        regions = _regions()
        reader.register("kv", regions, block_len=BLOCK)
        peer = await reader.connect(*producer.address)
        await reader.read(peer, [0], [0])
        agent, posted = reader._agent, []
        post = agent.post

        def traced_post(handle):
            state = post(handle)
            posted.append(state)
            return state

        agent.post = traced_post
        next_posts = []
        for i in range(5):
            await asyncio.sleep(0.3)  # let the producer's poller back off: it is idle between requests
            result = await reader.read(peer, [i + 1], [i + 1], notify=f"req-{i}:1".encode())
            assert result.notified
            posted.clear()
            await reader.read(peer, [10 + i], [10 + i])
            next_posts.append(posted[0])
            senders = await producer.request(WaitNotifications(message=f"req-{i}:1".encode(), timeout=5))
            assert senders == ["reader"]
        empty = await reader.read(peer, [], [], notify=b"hit:1")  # notify-only (a full prefix hit)
        assert empty.notified
        assert await producer.request(WaitNotifications(message=b"hit:1", timeout=5)) == ["reader"]
        assert verify_blocks(regions, BLOCK, [1, 2, 10, 14], [1, 2, 10, 14], seed=3) == []
    held = next_posts.count("PROC")
    if notify_via == "side_channel":
        assert held == 0, f"reads after a side-channel notification were held: {next_posts}"
    else:  # the control: what the side channel avoids
        assert held >= 3, f"NIXL's notification no longer holds the next read: {next_posts}"


@pytest.mark.parametrize("reader_secret", [None, b"w" * 32], ids=["no-secret", "wrong-secret"])
async def test_unauthenticated_side_channel_notifications_are_dropped(reader_secret):
    producer, reader, peer = await _pair(
        EngineConfig(engine_id="reader", notify_via="side_channel", auth_secret=SECRET),
        EngineConfig(engine_id="producer", auth_secret=SECRET),
    )
    try:
        await reader.notify(peer, b"genuine:1")
        assert await producer.wait_notifications(b"genuine:1", timeout=5) == ["reader"]
        forger = await TransferEngine(
            EngineConfig(engine_id="reader", notify_via="side_channel", auth_secret=reader_secret)
        ).start()
        try:
            # The forger cannot handshake without the secret (so it has no notify session): it sends
            # straight to the socket. Replays of captured notifications: tests/engine/test_notify_replay.py.
            sock = forger._zmq.socket(zmq.DEALER)
            sock.connect(f"tcp://{producer.address[0]}:{producer.address[1]}")
            mac = messages.notify_mac(reader_secret, b"", 1, "reader", b"forged:1") if reader_secret else b""
            forged = messages.NotifyMessage(engine_id="reader", message=b"forged:1", mac=mac, seq=1)
            await sock.send(messages.encode(forged))
            with pytest.raises(Exception, match="0 of 1"):
                await producer.wait_notifications(b"forged:1", timeout=0.5)
            assert producer.snapshot().counters["handshake_auth_failures"] == 1
            sock.close(0)
        finally:
            await forger.close()
        assert SECRET.decode() not in repr(producer.config)
    finally:
        await reader.close()
        await producer.close()


async def test_a_notification_too_large_for_the_side_channel_is_refused_before_anything_moves():
    """A peer's server refuses requests over its max_request_bytes without the sender hearing of it:
    the sender refuses such a notification up front instead of losing it."""
    producer, reader, peer = await _pair(EngineConfig(engine_id="reader", notify_via="side_channel"),
                                         EngineConfig(engine_id="producer"))  # fmt: skip
    try:
        largest = b"n" * (reader.config.max_request_bytes - 1024)
        await reader.notify(peer, largest)
        assert await producer.wait_notifications(largest, timeout=5) == ["reader"]
        too_large = b"n" * reader.config.max_request_bytes
        with pytest.raises(ValueError, match="max_request_bytes"):
            await reader.notify(peer, too_large)
        with pytest.raises(ValueError, match="max_request_bytes"):
            await reader.start_read(peer, [0], [0], notify=too_large)
        assert reader.live_handles().get("xfers", 0) == 0
        await reader.write(peer, [0], [0], notify=too_large)  # a WRITE's notification rides on NIXL
        assert await producer.wait_notifications(too_large, timeout=5) == ["reader"]
        with pytest.raises(ValueError, match="max_request_bytes"):  # no blocks: it only notifies, on the side channel
            await reader.start_write(peer, [], [], notify=too_large)
    finally:
        await reader.close()
        await producer.close()


async def test_the_receiver_s_own_request_limit_bounds_what_is_sent_to_it():
    """The producer takes smaller requests than the reader (`max_request_bytes`, said in its handshake reply).
    Before, the reader checked against its own limit: a notification between the two was reported sent and
    dropped at the producer, and a call that large came back refused after the round trip."""
    from nixl_async import CallTooLarge

    producer, reader, peer = await _pair(EngineConfig(engine_id="reader", notify_via="side_channel"),
                                         EngineConfig(engine_id="producer", max_request_bytes=8192))  # fmt: skip
    producer.handle_calls("echo", lambda sender, payload: payload)
    try:
        fits = b"f" * (8192 - len(b"reader") - 256)
        await reader.notify(peer, fits)
        assert await producer.wait_notifications(fits, timeout=5) == ["reader"]
        over = b"o" * 12_000  # under the reader's own 64 KiB
        with pytest.raises(ValueError, match=r"'producer'.*max_request_bytes"):
            await reader.notify(peer, over)
        with pytest.raises(ValueError, match="max_request_bytes"):
            await reader.start_reads(peer, [[0], [1]], [[0], [1]], notify=[None, over])
        assert reader.live_handles().get("xfers", 0) == 0
        with pytest.raises(CallTooLarge, match="'producer'"):
            await reader.call(peer, "echo", over)
        assert await reader.call(peer, "echo", b"c" * 4096) == b"c" * 4096
        assert producer._server.rejected == 0, "nothing too large reached the producer"
    finally:
        await reader.close()
        await producer.close()


async def test_a_close_sends_what_is_queued_to_a_live_peer_and_never_stalls_on_a_gone_one():
    """Notifications queued for a live peer just before the close still arrive. Ones queued for a peer
    that is gone are dropped at the close, also for one forgotten a moment before: before, the close
    blocked the event loop for 1 s (the sockets' linger, waited out in the ZMQ context's term)."""
    producer, reader, peer = await _pair(EngineConfig(engine_id="reader", notify_via="side_channel"),
                                         EngineConfig(engine_id="producer"))  # fmt: skip
    gone = await TransferEngine(EngineConfig(engine_id="gone")).start()
    forgotten = await TransferEngine(EngineConfig(engine_id="forgotten")).start()
    try:
        gone_peer = await reader.connect(*await gone.serve())
        forgotten_peer = await reader.connect(*await forgotten.serve())
        await gone.close()
        await forgotten.close()
        for n in range(3):
            await reader.notify(gone_peer, b"lost %d" % n)
            await reader.notify(forgotten_peer, b"lost %d" % n)
        reader.disconnect(forgotten_peer)  # its socket closes within the second (before: lingering, it held the close)
        await reader.notify(peer, b"last words")
        stalls, stamps = [], [time.monotonic()]

        async def ticker():
            while True:
                await asyncio.sleep(0.005)
                stamps.append(time.monotonic())
                stalls.append(stamps[-1] - stamps[-2])

        ticking = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.02)
        await reader.close()
        await asyncio.sleep(0.02)
        ticking.cancel()
        assert max(stalls) < 0.3, f"the close blocked the loop for {max(stalls):.2f} s"
        assert await producer.wait_notifications(b"last words", timeout=5) == ["reader"]
    finally:
        await reader.close()
        await producer.close()


@pytest.mark.parametrize(
    ("notify_via", "brisk", "tcp"),
    [("side_channel", False, False), ("side_channel", False, True), ("nixl", True, False)],
)
async def test_only_a_nixl_notification_keeps_the_poller_brisk(nixl_peer_factory, notify_via, brisk, tcp):
    """A NIXL notification leaves only while our worker is progressed: we poll every 2 ms for 2 s
    after one. A side-channel one is ZMQ's to deliver; polling for it woke a vLLM decode worker's
    loop ~500 times a second and took the GIL from its model thread at every step. Over UCX/TCP
    (reads really in flight) the next read still lands whole without the brisk polling."""
    producer = nixl_peer_factory(num_blocks=32, block_len=BLOCK, seed=3, tcp=tcp)
    async with TransferEngine(EngineConfig(engine_id="reader", notify_via=notify_via)) as reader:
        regions = _regions()
        reader.register("kv", regions, block_len=BLOCK)
        peer = await reader.connect(*producer.address)
        assert (await reader.read(peer, [1], [1], notify=b"req:1")).notified
        assert await producer.request(WaitNotifications(message=b"req:1", timeout=5)) == ["reader"]
        await asyncio.sleep(0.2)  # past the read's own activity
        before = reader.stats.counters["polls"]
        await asyncio.sleep(1.0)
        polls = reader.stats.counters["polls"] - before
        await reader.read(peer, list(range(2, 32)), list(range(2, 32)), timeout=5)
        assert verify_blocks(regions, BLOCK, list(range(1, 32)), list(range(1, 32)), seed=3) == []
    # idle: backing off to 50 ms (~20 polls a second); brisk: every 2 ms (~500)
    assert (polls > 200) if brisk else (polls < 60), f"{polls} polls in 1 s after a {notify_via} notification"


def test_notify_via_is_validated():
    with pytest.raises(ValueError, match="notify_via"):
        EngineConfig(notify_via="carrier-pigeon")
