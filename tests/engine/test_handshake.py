"""Handshake over the ZMQ side channel: success, sharing, and every way it can fail."""

import asyncio
import itertools
import socket
import sys
import time

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from nixl_async import (
    EngineClosedError,
    EngineConfig,
    EngineIdMismatch,
    HandshakeRejected,
    HandshakeTimeout,
    IncompatiblePeerError,
    NotificationFailed,
    ProtocolError,
    TransferEngine,
    messages,
)
from nixl_async.config import TCP_SEGMENT_BYTES
from nixl_async.testing import WaitNotifications, assert_no_live_handles


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """A ROUTER that accepts queries and answers with `reply` (None: never answers)."""

    def __init__(self, reply: bytes | list[bytes] | None):
        self.reply = reply
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.queries = 0
        self.task = asyncio.ensure_future(self._run())

    async def _run(self):
        while True:
            identity, *_ = await self.sock.recv_multipart()
            self.queries += 1
            if self.reply is not None:
                frames = self.reply if isinstance(self.reply, list) else [self.reply]
                await self.sock.send_multipart([identity, *frames])

    async def close(self):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.ctx.destroy(0)


async def test_connect_describes_the_peer(nixl_engine, nixl_peer):
    peer = await nixl_engine.connect(*nixl_peer.address, expected_engine_id=nixl_peer.engine_id)
    assert peer.engine_id == nixl_peer.engine_id
    assert peer.layout().num_blocks == 64 and peer.layout("kv").block_len == 4096
    assert nixl_engine.peer(nixl_peer.engine_id) is peer
    # a second connect to the same address reuses the peer; refresh re-handshakes
    assert await nixl_engine.connect(*nixl_peer.address) is peer
    again = await nixl_engine.connect(*nixl_peer.address, refresh=True)
    assert again is peer and peer.connected, "the same incarnation answered: the peer is kept"
    assert nixl_engine.snapshot().counters["handshakes"] == 2
    assert nixl_engine.live_handles()["remote_agents"] == 1


async def test_nobody_listening_times_out(nixl_engine):
    started = time.monotonic()
    with pytest.raises(HandshakeTimeout, match="no handshake reply"):
        await nixl_engine.connect("127.0.0.1", _free_port(), timeout=0.3)
    assert time.monotonic() - started < 2


async def test_silent_peer_times_out(nixl_engine):
    server = FakeServer(None)
    try:
        with pytest.raises(HandshakeTimeout):
            await nixl_engine.connect("127.0.0.1", server.port, timeout=0.3)
        assert server.queries == 1
    finally:
        await server.close()


async def test_a_close_during_a_connect_or_a_call_tells_the_callers_it_closed(nixl_peer_factory):
    """Callers waiting for a handshake (two sharing it) or for a call's reply when the engine closes
    hear `EngineClosedError`; before, a `CancelledError` they never asked for (a TaskGroup or retry
    loop takes that for its own cancellation)."""
    proc = nixl_peer_factory()
    silent = FakeServer(None)
    engine = await TransferEngine(EngineConfig(engine_id="closing-mid-connect")).start()
    try:
        peer = await engine.connect(*proc.address)
        proc.pause()  # its side channel answers no call now
        waiting = [asyncio.ensure_future(engine.connect("127.0.0.1", silent.port, timeout=30)) for _ in range(2)]
        waiting.append(asyncio.ensure_future(engine.call(peer, "topic", b"x", timeout=30)))
        await asyncio.sleep(0.3)
        await engine.close()
        for task in waiting:
            with pytest.raises(EngineClosedError):
                await asyncio.wait_for(task, 5)
            assert not task.cancelled()
    finally:
        proc.resume()
        await engine.close()
        await silent.close()


# A reply whose agent metadata NIXL refuses (before: NIXL's raw nixlMismatchError escaped connect())
_UNLOADABLE = messages.encode(messages.MetadataReply(version=1, engine_id="x", agent_name="x/1",
                                                     agent_metadata=b"garbage", compat_hash=messages.compat_hash({}),
                                                     layouts=[]))  # fmt: skip


@pytest.mark.parametrize(
    ("reply", "error", "match"),
    [
        (b"\x93garbage", ProtocolError, "undecodable"),
        (msgspec.msgpack.encode({"type": "metadata", "version": 1}), ProtocolError, "undecodable"),
        ([b"a", b"b"], ProtocolError, "2 frames"),
        (messages.encode(messages.ErrorReply(code="auth", message="go away")), HandshakeRejected, "go away"),
        (_UNLOADABLE, HandshakeRejected, "NIXL refused the agent metadata of x"),
    ],
)
async def test_bad_replies_raise_typed_errors(nixl_engine, reply, error, match):
    server = FakeServer(reply)
    try:
        with pytest.raises(error, match=match):
            await nixl_engine.connect("127.0.0.1", server.port, timeout=2)
    finally:
        await server.close()
    assert nixl_engine.peers == []
    assert not nixl_engine.live_handles().get("remote_agents")


@pytest.mark.parametrize("claimed", ["its own", "the other's"])
async def test_an_engine_answering_with_another_engines_agent_is_refused(nixl_engine, claimed):
    """An engine whose reply carries the NIXL agent of an engine we are connected to (a hostile or
    misconfigured one) is refused, and the other engine's agent stays loaded and in use: before, the
    peer took that agent over (its notifications credited to the impostor), and disconnecting the
    impostor unloaded it, so reads from the real engine failed with NIXL's raw NOT_FOUND."""
    ours = [np.zeros(8 * 4096, np.uint8)]
    nixl_engine.register("kv", ours, num_blocks=8)
    async with TransferEngine(EngineConfig(engine_id="real")) as real:
        real.register("kv", [np.arange(8 * 4096, dtype=np.uint8)], num_blocks=8)
        peer = await nixl_engine.connect(*await real.serve())
        theirs = real._metadata()
        agent_name = "impostor/1" if claimed == "its own" else theirs.agent_name
        hostile = messages.MetadataReply(version=1, engine_id="impostor", agent_name=agent_name,
                                         agent_metadata=theirs.agent_metadata, compat_hash=theirs.compat_hash,
                                         layouts=theirs.layouts)  # fmt: skip
        server = FakeServer(messages.encode(hostile))
        try:
            with pytest.raises(HandshakeRejected, match="agent"):
                await nixl_engine.connect("127.0.0.1", server.port, timeout=2)
        finally:
            await server.close()
        assert [p.engine_id for p in nixl_engine.peers] == ["real"] and peer.connected
        assert nixl_engine._peers.table.of_agent(peer.agent_name) is peer
        assert nixl_engine.live_handles()["remote_agents"] == 1
        await nixl_engine.read(peer, [1, 2], [1, 2], timeout=5)
        assert np.array_equal(ours[0][4096 : 3 * 4096], np.arange(8 * 4096, dtype=np.uint8)[4096 : 3 * 4096])


@pytest.mark.parametrize(
    ("claims", "metadata", "expected", "error"),
    [
        ("real", "third's", "wanted", EngineIdMismatch),  # a server ignoring the expected id we sent
        ("third", "third's", "wanted", EngineIdMismatch),  # (answering as itself)
        ("real", "garbage", None, HandshakeRejected),  # a restart of "real" NIXL cannot load
    ],
)
async def test_a_reply_we_cannot_take_leaves_the_peers_we_hold_alone(nixl_engine, claims, metadata, expected, error):
    """Before, the reply was adopted before its engine id was checked against the expected one, and
    an engine it replaced was forgotten before its metadata was loaded: our healthy peer "real" was
    dropped (its reads cancelled) or handed to the other engine's agent, or "third" stayed loaded
    although the connect failed."""
    ours = [np.zeros(8 * 4096, np.uint8)]
    nixl_engine.register("kv", ours, num_blocks=8)
    async with TransferEngine(EngineConfig(engine_id="real")) as real, \
            TransferEngine(EngineConfig(engine_id="third")) as third:  # fmt: skip
        real.register("kv", [np.arange(8 * 4096, dtype=np.uint8)], num_blocks=8)
        third.register("kv", [np.ones(8 * 4096, np.uint8)], num_blocks=8)
        peer = await nixl_engine.connect(*await real.serve())
        theirs = third._metadata()
        answer = messages.MetadataReply(
            version=1, engine_id=claims, agent_name=theirs.agent_name, compat_hash=theirs.compat_hash,
            agent_metadata=theirs.agent_metadata if metadata == "third's" else b"\x00garbage", layouts=theirs.layouts,
        )  # fmt: skip
        server = FakeServer(messages.encode(answer))
        try:
            with pytest.raises(error):
                await nixl_engine.connect("127.0.0.1", server.port, expected_engine_id=expected, timeout=2)
        finally:
            await server.close()
        assert [p.engine_id for p in nixl_engine.peers] == ["real"] and peer.connected
        assert nixl_engine.peer("real") is peer and nixl_engine.live_handles()["remote_agents"] == 1
        await nixl_engine.read(peer, [1, 2], [1, 2], timeout=5)
        assert np.array_equal(ours[0][4096 : 3 * 4096], np.arange(8 * 4096, dtype=np.uint8)[4096 : 3 * 4096])


async def test_future_protocol_version_is_refused(nixl_engine):
    reply = messages.MetadataReply(
        version=99, engine_id="x", agent_name="x", agent_metadata=b"", compat_hash="", layouts=[]
    )
    server = FakeServer(messages.encode(reply))
    try:
        with pytest.raises(ProtocolError, match="version 99"):
            await nixl_engine.connect("127.0.0.1", server.port, timeout=2)
    finally:
        await server.close()


async def test_compat_hash_mismatch(nixl_peer_factory):
    peer_proc = nixl_peer_factory(compat={"model": "llama", "dtype": "bf16"})
    async with TransferEngine(EngineConfig(compat={"model": "llama", "dtype": "fp16"})) as engine:
        with pytest.raises(IncompatiblePeerError, match="compatibility hash"):
            await engine.connect(*peer_proc.address)
        assert engine.peers == []
    assert_no_live_handles(engine)
    async with TransferEngine(EngineConfig(compat={"dtype": "bf16", "model": "llama"})) as engine:
        await engine.connect(*peer_proc.address)


async def test_compat_mismatch_is_logged_and_allowed_when_enforcement_is_off(nixl_peer_factory, caplog):
    # vLLM's enforce_handshake_compat=false: the user takes the risk, and the log says so.
    peer_proc = nixl_peer_factory(compat={"model": "llama", "dtype": "bf16"})
    config = EngineConfig(compat={"model": "llama", "dtype": "fp16"}, enforce_compat=False)
    async with TransferEngine(config) as engine:
        peer = await engine.connect(*peer_proc.address)
        assert engine.peers == [peer]
    assert "connecting anyway" in caplog.text and "compatibility hash" in caplog.text


async def test_engine_id_mismatch(nixl_engine, nixl_peer):
    """The handshake names the engine expected: the one found there refuses it, and nothing of it is loaded."""
    with pytest.raises(EngineIdMismatch, match="not 'someone-else'"):
        await nixl_engine.connect(*nixl_peer.address, expected_engine_id="someone-else")
    assert nixl_engine.peers == [] and nixl_engine.live_handles().get("remote_agents", 0) == 0
    peer = await nixl_engine.connect(*nixl_peer.address, expected_engine_id=nixl_peer.engine_id)
    assert nixl_engine.peers == [peer]


async def test_concurrent_connects_share_one_handshake(nixl_engine, nixl_peer):
    peers = await asyncio.gather(*(nixl_engine.connect(*nixl_peer.address) for _ in range(8)))
    assert all(p is peers[0] for p in peers)
    assert nixl_engine.snapshot().counters["handshakes"] == 1


async def test_dead_peer_costs_only_its_own_timeout(nixl_engine, nixl_peer_factory):
    live = [nixl_peer_factory() for _ in range(3)]
    silent = FakeServer(None)
    try:
        started = time.monotonic()
        dead = asyncio.ensure_future(nixl_engine.connect("127.0.0.1", silent.port, timeout=3))
        peers = await asyncio.gather(*(nixl_engine.connect(*p.address) for p in live))
        elapsed_live = time.monotonic() - started
        assert {p.engine_id for p in peers} == {p.engine_id for p in live}
        assert not dead.done() and elapsed_live < 2.5
        with pytest.raises(HandshakeTimeout):
            await dead
    finally:
        await silent.close()


async def test_a_connect_joining_a_handshake_in_flight_keeps_its_own_timeout(nixl_engine):
    silent = FakeServer(None)
    try:
        first = asyncio.ensure_future(nixl_engine.connect("127.0.0.1", silent.port, timeout=5))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        with pytest.raises(HandshakeTimeout, match="started earlier goes on"):
            await nixl_engine.connect("127.0.0.1", silent.port, timeout=0.3)
        assert time.monotonic() - started < 2, "it waited for the first caller's timeout"
        assert not first.done(), "the first caller's handshake goes on"
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    finally:
        await silent.close()


async def test_server_survives_malformed_queries(nixl_engine):
    host, port = nixl_engine.address
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://{host}:{port}")
    try:
        bad = [
            b"",
            b"\xff\xfe",
            msgspec.msgpack.encode({"type": "metadata_request", "version": "x"}),
            messages.encode(messages.MetadataRequest(version=7)),
            b"x" * (nixl_engine.config.max_request_bytes + 1),
        ]
        for payload in bad:
            await sock.send(payload)
            reply = messages.decode_reply(await asyncio.wait_for(sock.recv(), 5))
            assert isinstance(reply, messages.ErrorReply), payload[:20]
        await sock.send_multipart([b"two", b"frames"])
        reply = messages.decode_reply(await asyncio.wait_for(sock.recv(), 5))
        assert isinstance(reply, messages.ErrorReply) and reply.code == "bad_request"
        await sock.send(messages.encode(messages.MetadataRequest(expected_engine_id="other")))
        reply = messages.decode_reply(await asyncio.wait_for(sock.recv(), 5))
        assert isinstance(reply, messages.ErrorReply) and reply.code == "engine_id_mismatch"
        # still serving real requests
        await sock.send(
            messages.encode(messages.MetadataRequest(tcp_segment_bytes=TCP_SEGMENT_BYTES, engine_id="probe"))
        )
        reply = messages.decode_reply(await asyncio.wait_for(sock.recv(), 5))
        assert isinstance(reply, messages.MetadataReply) and reply.engine_id == nixl_engine.engine_id
        counters = nixl_engine.snapshot().counters
        assert counters["handshakes_rejected"] == 7 and counters["handshakes_answered"] == 1
    finally:
        ctx.destroy(0)


_FLOOD = """
import sys, time, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.SNDHWM, 0)
sock.connect(sys.argv[1])
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for _ in range(200):
        sock.send(b"\\x00not a request")
    try:
        while True:
            sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        pass
sock.close(0)
"""


async def test_a_flood_of_queries_leaves_the_loop_running(nixl_engine):
    """Nobody needs credentials to send to the side channel: a sender that keeps it busy must not hold
    the engine's loop (its deadlines, completions and notifications)."""
    host, port = nixl_engine.address
    flood = await asyncio.create_subprocess_exec(sys.executable, "-c", _FLOOD, f"tcp://{host}:{port}", "2")
    ticks = [time.monotonic()]
    try:
        while flood.returncode is None and time.monotonic() - ticks[0] < 20:
            await asyncio.sleep(0.01)
            ticks.append(time.monotonic())
    finally:
        await flood.wait()
    assert nixl_engine._server.rejected > 1000, "the flood never reached the server"
    assert max(b - a for a, b in itertools.pairwise(ticks)) < 0.5, "the loop stood still while the flood lasted"


async def _query(address):
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://{address[0]}:{address[1]}")
    try:
        await sock.send(
            messages.encode(messages.MetadataRequest(tcp_segment_bytes=TCP_SEGMENT_BYTES, engine_id="probe"))
        )
        return messages.decode_reply(await asyncio.wait_for(sock.recv(), 5))
    finally:
        ctx.destroy(0)


async def test_reply_reflects_new_registrations(nixl_engine):
    import numpy as np

    nixl_engine.register("a", [np.zeros(4096, np.uint8)], block_len=1024)
    assert [lay.name for lay in (await _query(nixl_engine.address)).layouts] == ["a"]
    nixl_engine.register("b", [np.zeros(8192, np.uint8)], block_len=2048)
    reply = await _query(nixl_engine.address)
    assert [(lay.name, lay.num_blocks) for lay in reply.layouts] == [("a", 4), ("b", 4)]
    nixl_engine.deregister("a")
    assert [lay.name for lay in (await _query(nixl_engine.address)).layouts] == ["b"]


async def test_notify_only_needs_no_matching_layouts(nixl_engine, nixl_peer):
    import numpy as np

    nixl_engine.register("kv", [np.zeros(4096, np.uint8)], block_len=1024)  # differs from the peer's
    peer = await nixl_engine.connect(*nixl_peer.address)
    assert (await nixl_engine.read(peer, [], [], notify=b"hit")).notified


async def test_notify_needs_no_layout_or_one_named(nixl_engine, nixl_peer):
    """`notify()` is tied to no transfer: an engine with its K and V in two layouts, or none, notifies."""
    import numpy as np

    peer = await nixl_engine.connect(*nixl_peer.address)
    await nixl_engine.notify(peer, b"none")
    nixl_engine.register("k", [np.zeros(4096, np.uint8)], block_len=1024)
    nixl_engine.register("v", [np.zeros(4096, np.uint8)], block_len=1024)
    await nixl_engine.notify(peer, b"two")
    for message in (b"none", b"two"):
        assert await nixl_peer.request(WaitNotifications(message=message, timeout=10)) == [nixl_engine.engine_id]


async def test_restarted_peer_is_handshaken_again_after_a_failure(nixl_engine, nixl_peer_factory):
    """The peer dies and comes back at the same address with a new agent: no restart on our side."""
    import numpy as np

    from nixl_async import TransferFailed, TransferTimeout
    from nixl_async.testing import verify_blocks

    regions = [np.zeros(64 * 4096, np.uint8) for _ in range(2)]
    nixl_engine.register("kv", regions, block_len=4096)
    first = nixl_peer_factory(engine_id="prefill-x", seed=1)
    peer = await nixl_engine.connect(*first.address)
    await nixl_engine.read(peer, [0], [0])
    host, port = first.address
    await first.akill()
    nixl_peer_factory(engine_id="prefill-x", seed=2, port=port)
    with pytest.raises((TransferFailed, TransferTimeout)):
        await nixl_engine.read(peer, [1], [1], timeout=5)
    again = await nixl_engine.connect(host, port, expected_engine_id="prefill-x", refresh=not peer.stale)
    assert again is not peer and again.agent_name != peer.agent_name and not peer.connected
    result = await nixl_engine.read(again, [2], [5])
    assert result.nbytes == 2 * 4096
    assert verify_blocks(regions, 4096, [2], [5], seed=2) == [], "bytes must come from the new incarnation"
    assert nixl_engine.live_handles()["remote_agents"] == 1


async def test_a_failed_notification_has_the_next_connect_handshake_again(nixl_peer_factory):
    """A peer restarted at its address with its engine id: NIXL refuses our notification (its agent is
    gone), and the next connect() handshakes with the new one instead of returning the old peer."""
    async with TransferEngine(EngineConfig(engine_id="notifier", notify_via="nixl")) as engine:
        first = nixl_peer_factory(engine_id="prefill-y")
        peer = await engine.connect(*first.address)
        host, port = first.address
        await first.akill()
        second = nixl_peer_factory(engine_id="prefill-y", port=port)
        for _ in range(100):  # (UCX may take a moment to find the old agent's connection broken)
            try:
                await engine.notify(peer, b"lost")
            except NotificationFailed:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("NIXL never refused a notification to the killed peer's agent")
        again = await engine.connect(host, port)
        assert again is not peer
        await engine.notify(again, b"heard")
        assert await second.request(WaitNotifications(message=b"heard", timeout=10)) == ["notifier"]


async def test_new_engine_at_a_known_address_replaces_the_old_one(nixl_engine, nixl_peer_factory):
    """vLLM gives a restarted instance a new engine id: asking for it re-handshakes, no error."""
    import numpy as np

    from nixl_async.testing import verify_blocks

    regions = [np.zeros(64 * 4096, np.uint8) for _ in range(2)]
    nixl_engine.register("kv", regions, block_len=4096)
    first = nixl_peer_factory(engine_id="prefill-old", seed=1)
    old = await nixl_engine.connect(*first.address, expected_engine_id="prefill-old")
    host, port = first.address
    await first.akill()
    nixl_peer_factory(engine_id="prefill-new", seed=2, port=port)
    new = await nixl_engine.connect(host, port, expected_engine_id="prefill-new")
    assert new.engine_id == "prefill-new" and not old.connected
    await nixl_engine.read(new, [3], [4])
    assert verify_blocks(regions, 4096, [3], [4], seed=2) == []
    assert nixl_engine.live_handles()["remote_agents"] == 1
    with pytest.raises(EngineIdMismatch):  # and a wrong expectation still fails, after one fresh look
        await nixl_engine.connect(host, port, expected_engine_id="prefill-old")


async def test_a_reply_over_the_askers_frame_limit_is_refused_at_once_by_name():
    """ZMQ drops a frame over the asker's `max_frame_bytes` without a word: before, the asker waited out its whole
    timeout and heard `HandshakeTimeout`, as if the peer were dead."""
    async with TransferEngine(EngineConfig(engine_id="many-regions")) as server, \
            TransferEngine(EngineConfig(engine_id="small-frames", max_frame_bytes=4096)) as asker:  # fmt: skip
        server.register("kv", [np.zeros(4096, np.uint8) for _ in range(200)], block_len=4096)
        assert len(messages.encode(server._metadata())) > 4096
        address = await server.serve()
        started = time.monotonic()
        with pytest.raises(HandshakeRejected, match="max_frame_bytes"):
            await asker.connect(*address, timeout=5)
        assert time.monotonic() - started < 2
        assert asker.peers == [] and not asker.live_handles().get("remote_agents")


async def test_a_refresh_never_takes_an_answer_given_before_it_was_asked(nixl_engine):
    """An audit of session 39: a refresh joined a handshake already under way, which the peer may have answered
    before the change the refresh was called for (its extras, layouts or agent): the caller got the old ones."""
    async with TransferEngine(EngineConfig(engine_id="changing")) as other:
        other.set_extra(generation="1")
        address = await other.serve("127.0.0.1", 0)
        await nixl_engine.connect(*address)
        served = other._server.served
        under_way = asyncio.ensure_future(nixl_engine.connect(*address, refresh=True))
        while other._server.served == served:  # answered, not yet taken in by the asker
            await asyncio.sleep(0)
        other.set_extra(generation="2")
        peer = await nixl_engine.connect(*address, refresh=True)
        assert peer.extra["generation"] == "2"
        assert (await under_way).extra["generation"] in ("1", "2")
        assert other._server.served == served + 2


@pytest.mark.parametrize(
    ("host", "port", "error"),
    [("bad host", 5600, HandshakeRejected), ("127.0.0.1", -1, ValueError), ("127.0.0.1", 70000, ValueError),
     ("127.0.0.1", "5600", TypeError), ("", 5600, TypeError), ("127.0.0.1", True, TypeError)],
)  # fmt: skip
async def test_an_address_that_cannot_be_dialled_is_refused_typed_at_once(nixl_engine, host, port, error):
    """An audit of session 39: ZMQ's own error escaped connect() (callers catching HandshakeError crashed)."""
    started = time.monotonic()
    with pytest.raises(error):
        await nixl_engine.connect(host, port, timeout=5)
    assert time.monotonic() - started < 1 and nixl_engine.peers == []


async def test_a_refresh_waiting_on_an_older_handshake_starts_none_after_close():
    """The review of session 39's refresh fix: a refresh waiting for an older handshake that the close cancelled
    went on to start a new one after close() had gathered the ones under way (it then failed on a torn-down
    engine, or held a task nobody ended); it hears EngineClosedError, as the plain caller does."""
    with socket.socket() as listener:  # accepts, never answers: the handshake waits out its timeout
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = listener.getsockname()
        engine = await TransferEngine(EngineConfig(engine_id="closing-mid-refresh")).start()
        plain = asyncio.ensure_future(engine.connect(*address, timeout=5))
        await asyncio.sleep(0.05)
        refresh = asyncio.ensure_future(engine.connect(*address, timeout=5, refresh=True))
        await asyncio.sleep(0.05)
        await engine.close()
        for caller in (plain, refresh):
            with pytest.raises(EngineClosedError):
                await caller
        assert engine._dialer._connecting == {}
        assert engine.snapshot().counters["handshake_failures"] == 1, "the cancelled one alone: none started after"
    assert_no_live_handles(engine)


async def _pair_for_dialing(**reader_config):
    reader = await TransferEngine(EngineConfig(engine_id="dialer", notify_via="side_channel", **reader_config)).start()
    server = await TransferEngine(EngineConfig(engine_id="dialed", notify_via="side_channel")).start()
    reader.register("kv", [np.zeros(4 * 4096, np.uint8)], block_len=4096)
    server.register("kv", [np.ones(4 * 4096, np.uint8)], block_len=4096)
    await server.serve("127.0.0.1", 0)
    return reader, server


async def test_a_connect_waiting_for_the_previous_connection_s_transfers_keeps_its_timeout(monkeypatch):
    """Its previous connection was forgotten while NIXL still held one of its transfers (as a fenced READ does:
    faked here), so adopting the new answer waits for that agent to be let go. Before session 40 that wait (up to
    the release grace + 0.5 s) came on top of the caller's timeout: 3.5 s for a 1 s connect."""
    reader, server = await _pair_for_dialing(release_grace_s=3.0)
    try:
        peer = await reader.connect(*server.address)
        real = reader._driver.busy_agents
        monkeypatch.setattr(reader._driver, "busy_agents", lambda: {*real(), server.agent_name})
        reader.disconnect(peer)
        started = time.monotonic()
        with pytest.raises(HandshakeTimeout, match="still held its agent"):
            await reader.connect(*server.address, timeout=1.0)
        assert time.monotonic() - started < 2.0  # (the wait it is cut from: 3.5 s)
        monkeypatch.undo()
        assert (await reader.connect(*server.address)).engine_id == "dialed"
    finally:
        await reader.close()
        await server.close()


async def test_a_peer_only_notified_or_called_is_not_evicted_and_its_other_names_sockets_close_with_it():
    """Before session 40 notifications and calls did not count as use: a peer notified every 0.1 s was evicted
    after `peer_ttl_s` (the next notify: `PeerUnknownError`). And side-channel sockets opened for another name
    of a peer's server stayed open after the peer was forgotten, ZMQ reconnecting to a dead peer until close."""
    reader, server = await _pair_for_dialing(peer_ttl_s=0.5)
    server.handle_calls("echo", lambda _sender, payload: payload)
    try:
        port = server.address[1]
        peer = await reader.connect("localhost", port)
        for i in range(8):  # 1.6 s: over three TTLs
            await reader.notify(peer, b"n%d" % i)
            await reader.call(peer, "echo", b"c")
            await asyncio.sleep(0.2)
        assert await server.wait_notifications(b"n7", timeout=5) == ["dialer"]
        again = await reader.connect("127.0.0.1", port)  # another name for the same server: the same peer
        assert again is peer and peer.address == ("127.0.0.1", port)
        await reader.notify(peer, b"via another name")
        assert reader._notify.side_sockets == 2
        reader.disconnect(peer)
        assert reader._notify.side_sockets == 0
    finally:
        await reader.close()
        await server.close()
