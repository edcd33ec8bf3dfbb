"""Side-channel notifications cannot be replayed or forged: `NotifyGuard` alone, then a real server.

The integration tests need no NIXL: a `HandshakeServer` with a fixed reply, `fetch_metadata`
for the session, `SideChannelNotifier` to send, and a tap in between that records the bytes
on the wire the way an eavesdropper would.
"""

import asyncio
import logging
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from nixl_async import messages
from nixl_async._notify_guard import NotifyGuard
from nixl_async._side_notify import SideChannelNotifier
from nixl_async.config import TCP_SEGMENT_BYTES
from nixl_async.handshake import HandshakeServer, fetch_metadata

SECRET = b"correct horse battery staple 42!"
WRONG = b"incorrect horse battery staple 0"


def _note(session: bytes, seq: int, *, engine_id="reader", message=b"free:req-1", secret: bytes | None = SECRET):
    mac = messages.notify_mac(secret, session, seq, engine_id, message) if secret else b""
    return messages.NotifyMessage(engine_id=engine_id, message=message, mac=mac, session=session, seq=seq)


# -- NotifyGuard, pure ---------------------------------------------------------------------
def test_fresh_session_accepts_increasing_numbers_once():
    guard = NotifyGuard(SECRET)
    session = guard.issue("reader")
    assert len(session) == 16 and session != guard.issue("reader")
    assert guard.check(_note(session, 1)) is None
    assert guard.check(_note(session, 1)) == "replayed"
    assert guard.check(_note(session, 3)) is None, "numbers may skip (ZMQ drops what a broken connection held)"
    assert guard.check(_note(session, 2)) == "replayed", "but never go back"
    assert guard.check(_note(session, 0)) == "replayed" and guard.check(_note(session, -5)) == "replayed"
    assert guard.check(_note(session, 4)) is None


def test_unknown_session_and_other_senders_are_refused():
    guard = NotifyGuard(SECRET)
    session = guard.issue("reader")
    assert guard.check(_note(b"\x00" * 16, 1)) == "unknown_session"
    assert guard.check(_note(b"", 1)) == "unknown_session", "an older sender without a session"
    assert guard.check(_note(session, 1, engine_id="intruder")) == "wrong_sender", "issued to another engine"
    assert guard.check(_note(session, 1)) is None, "a refusal does not use up the number"


def test_bad_mac_is_refused_and_changes_nothing():
    guard = NotifyGuard(SECRET)
    session = guard.issue("reader")
    genuine = _note(session, 1)
    assert guard.check(_note(session, 1, secret=WRONG)) == "bad_mac"
    assert guard.check(_note(session, 1, secret=None)) == "bad_mac", "unsigned"
    for field, value in [("seq", 2), ("message", b"free:req-2"), ("engine_id", "intruder")]:
        tampered = msgspec.structs.replace(genuine, **{field: value})
        assert tampered != genuine and guard.check(tampered) == "bad_mac", field
    other = guard.issue("reader")
    moved = msgspec.structs.replace(genuine, session=other)
    assert guard.check(moved) == "bad_mac", "a MAC does not carry over to another session"
    assert guard.check(genuine) is None


def test_without_a_secret_replays_are_still_refused():
    guard = NotifyGuard(None)
    session = guard.issue("reader")
    assert guard.check(_note(session, 1, secret=None)) is None
    assert guard.check(_note(session, 1, secret=None)) == "replayed"
    assert guard.check(_note(session, 2, engine_id="intruder", secret=None)) == "wrong_sender"


def test_least_recently_used_session_is_evicted():
    guard = NotifyGuard(SECRET, max_sessions=2)
    first, second = _answered(guard, "a"), _answered(guard, "b")
    assert guard.check(_note(first, 1, engine_id="a")) is None  # a use: now `second` is the oldest
    third = _answered(guard, "c")
    assert len(guard) == 2
    assert guard.check(_note(second, 1, engine_id="b")) == "unknown_session"
    assert guard.check(_note(first, 2, engine_id="a")) is None
    assert guard.check(_note(third, 1, engine_id="c")) is None
    with pytest.raises(ValueError):
        NotifyGuard(max_sessions=0)


def _answered(guard: NotifyGuard, engine_id: str = "reader") -> bytes:
    """A session whose handshake answer reached the asker."""
    session = guard.issue(engine_id)
    guard.delivered(session)
    return session


def test_an_engine_handshaking_again_and_again_evicts_nobody_else():
    """It keeps its two newest sessions (notifications may still be under way in the previous one)."""
    guard = NotifyGuard(SECRET, max_sessions=4)
    idle = _answered(guard, "idle-reader")
    sessions = [_answered(guard, "busy-reader") for _ in range(10)]
    assert len(guard) == 3
    assert guard.check(_note(idle, 1, engine_id="idle-reader")) is None
    assert guard.check(_note(sessions[-2], 1, engine_id="busy-reader")) is None
    assert guard.check(_note(sessions[-1], 1, engine_id="busy-reader")) is None
    assert guard.check(_note(sessions[-3], 1, engine_id="busy-reader")) == "unknown_session"


def test_at_capacity_an_engine_handshaking_again_evicts_its_own_and_a_revoked_answer_nobody():
    """(A review of session 40's first version: the table full, the least recently used session of another
    engine went at `issue`, before the engine's own surplus, and a revoked answer had evicted it already.)"""
    guard = NotifyGuard(SECRET, max_sessions=4)
    idle_a, idle_b = _answered(guard, "idle-a"), _answered(guard, "idle-b")
    for _ in range(5):
        _answered(guard, "busy")
    assert len(guard) == 4
    guard.revoke(guard.issue("latecomer"))
    assert len(guard) == 4
    assert guard.check(_note(idle_a, 1, engine_id="idle-a")) is None
    assert guard.check(_note(idle_b, 1, engine_id="idle-b")) is None


def test_the_session_in_use_outlives_handshakes_whose_answers_never_arrived():
    """Two refreshes timed out at the reader, which still sends under the session it has; their late answers
    issued two more. Before, those evicted it: every later notification of that reader was refused
    (`unknown_session`) while its `notify()` reported success."""
    guard = NotifyGuard(SECRET)
    in_use = _answered(guard)
    assert guard.check(_note(in_use, 1)) is None
    _answered(guard)
    _answered(guard)
    assert guard.check(_note(in_use, 2)) is None
    adopted = _answered(guard)  # a refresh that did arrive: the reader sends under it from now on
    assert guard.check(_note(adopted, 1)) is None
    newest = _answered(guard)  # (both used: the older goes)
    assert guard.check(_note(in_use, 3)) == "unknown_session"
    assert guard.check(_note(adopted, 2)) is None and guard.check(_note(newest, 1)) is None


def test_an_answer_that_could_not_be_sent_evicts_nobody():
    """The reader was just given a session it has not used yet; the server then read, late, a handshake the
    reader had given up on. Its answer cannot be sent (the asker's socket is gone): revoked, it evicts nothing.
    Before, issuing it evicted the reader's newest session (the first unused), and the reader's notifications
    in that session were refused."""
    guard = NotifyGuard(SECRET)
    used = _answered(guard)
    assert guard.check(_note(used, 1)) is None
    current = _answered(guard)
    late = guard.issue("reader")
    assert len(guard) == 3, "nothing is evicted before the server knows whether the answer left"
    guard.revoke(late)
    guard.revoke(late)  # (twice, or after an eviction: nothing more happens)
    assert len(guard) == 2
    assert guard.check(_note(late, 2)) == "unknown_session"
    assert guard.check(_note(current, 2)) is None and guard.check(_note(used, 3)) is None
    guard.delivered(b"\x00" * 16)  # a session already gone: nothing happens
    assert len(guard) == 2


# -- a real HandshakeServer ----------------------------------------------------------------
def _reply_for(request: messages.MetadataRequest) -> messages.MetadataReply:
    return messages.MetadataReply(
        version=messages.PROTOCOL_VERSION,
        engine_id="producer",
        agent_name="producer/1",
        agent_metadata=b"md",
        compat_hash="h",
        layouts=[],
    )


class Tap:
    """A ROUTER that records every payload and forwards it to the server: an eavesdropper on the path."""

    def __init__(self, ctx: zmq.asyncio.Context, server_port: int) -> None:
        self.inbound = ctx.socket(zmq.ROUTER)
        self.inbound.setsockopt(zmq.LINGER, 0)
        self.port = self.inbound.bind_to_random_port("tcp://127.0.0.1")
        self.outbound = ctx.socket(zmq.DEALER)
        self.outbound.setsockopt(zmq.LINGER, 0)
        self.outbound.connect(f"tcp://127.0.0.1:{server_port}")
        self.captured: list[bytes] = []
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            _identity, payload = await self.inbound.recv_multipart()
            self.captured.append(payload)
            await self.outbound.send(payload)

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.inbound.close(0)
        self.outbound.close(0)


async def _until(condition, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


@pytest.fixture
async def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(0)


async def _serve(ctx, secret, received):
    server = HandshakeServer(
        ctx,
        _reply_for,
        max_request_bytes=64 << 10,
        max_frame_bytes=4 << 20,
        on_notify=lambda sender, message: received.append((sender, message)),
        secret=secret,
    )
    await server.start("127.0.0.1", 0)
    return server


async def _session(ctx, server, engine_id="reader", secret=SECRET) -> bytes:
    reply = await fetch_metadata(
        ctx,
        server.host,
        server.port,
        messages.MetadataRequest(tcp_segment_bytes=TCP_SEGMENT_BYTES, engine_id=engine_id),
        timeout=5,
        max_frame_bytes=4 << 20,
        secret=secret,
    )
    assert len(reply.notify_session) == 16
    return reply.notify_session


async def test_captured_notification_cannot_be_replayed_or_forged(ctx, caplog, monkeypatch):
    monkeypatch.setattr("nixl_async.handshake._REFUSAL_LOG_INTERVAL_S", 60.0)  # a slow machine stays in one interval
    received: list[tuple[str, bytes]] = []
    server = await _serve(ctx, SECRET, received)
    tap = Tap(ctx, server.port)
    notifier = SideChannelNotifier(ctx, "reader", SECRET)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://127.0.0.1:{server.port}")
    caplog.set_level(logging.WARNING, logger="nixl_async.handshake")
    try:
        session = await _session(ctx, server)
        assert session != await _session(ctx, server), "a new session per handshake"
        notifier.send(("127.0.0.1", tap.port), session, b"free:req-1")
        await _until(lambda: received)
        assert received == [("reader", b"free:req-1")]
        (captured,) = tap.captured
        note = messages.decode_request(captured)
        assert isinstance(note, messages.NotifyMessage) and note.session == session and note.seq == 1

        for _ in range(3):  # the identical bytes, from another connection
            await raw.send(captured)
        await _until(lambda: server.notifications_refused["replayed"] == 3)

        forged = msgspec.structs.replace(note, seq=2, message=b"free:req-2")  # the old MAC, new content
        await raw.send(messages.encode(forged))
        wrong_key = _note(session, 3, secret=WRONG)
        await raw.send(messages.encode(wrong_key))
        legacy = messages.NotifyMessage(engine_id="reader", message=b"free:req-2")  # an old sender: no session
        await raw.send(messages.encode(legacy))
        await _until(lambda: sum(server.notifications_refused.values()) == 6)
        assert server.notifications_refused == {"replayed": 3, "bad_mac": 2, "unknown_session": 1}
        assert server.auth_failures == 6 and server.notifications == 1

        # The genuine sender carries on: refusals used up none of its numbers.
        notifier.send(("127.0.0.1", tap.port), session, b"free:req-2")
        await _until(lambda: len(received) == 2)
        assert received == [("reader", b"free:req-1"), ("reader", b"free:req-2")]
    finally:
        notifier.close()
        raw.close(0)
        await tap.close()
        await server.close()
    refusals = [r.getMessage() for r in caplog.records if "dropped a notification" in r.getMessage()]
    assert len(refusals) == 3, f"once a second per reason: {refusals}"
    assert all("'reader'" in line for line in refusals)
    assert SECRET.decode() not in caplog.text and WRONG.decode() not in caplog.text


async def test_without_a_secret_replays_are_refused_too(ctx):
    received: list[tuple[str, bytes]] = []
    server = await _serve(ctx, None, received)
    tap = Tap(ctx, server.port)
    notifier = SideChannelNotifier(ctx, "reader", None)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        session = await _session(ctx, server, secret=None)
        notifier.send(("127.0.0.1", tap.port), session, b"free:req-1")
        await _until(lambda: received)
        await raw.send(tap.captured[0])
        await _until(lambda: server.notifications_refused["replayed"] == 1)
        assert received == [("reader", b"free:req-1")]
    finally:
        notifier.close()
        raw.close(0)
        await tap.close()
        await server.close()


async def test_a_busy_hint_in_an_unknown_session_is_counted_but_not_an_auth_failure(ctx, caplog):
    """A reader still holding a session of this server's previous incarnation hints it busy until it handshakes
    again: before session 40 each hint counted as an authentication failure and logged a warning."""
    received: list[tuple[str, bytes]] = []
    server = await _serve(ctx, None, received)
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://127.0.0.1:{server.port}")
    caplog.set_level(logging.WARNING, logger="nixl_async.handshake")
    try:
        hint = messages.NotifyMessage(engine_id="reader", message=b"", session=b"\x01" * 16, seq=1, busy_ms=5)
        await raw.send(messages.encode(hint))
        await raw.send(messages.encode(_note(b"\x01" * 16, 2, secret=None)))  # a notification still is one
        await _until(lambda: server.notifications_refused["unknown_session"] == 2)
        assert server.auth_failures == 1 and received == []
        assert len([r for r in caplog.records if "dropped a notification" in r.getMessage()]) == 1
    finally:
        raw.close(0)
        await server.close()


async def test_a_session_is_bound_to_the_engine_that_asked(ctx):
    received: list[tuple[str, bytes]] = []
    server = await _serve(ctx, SECRET, received)
    intruder = SideChannelNotifier(ctx, "intruder", SECRET)  # holds the secret, but asked for no session
    try:
        session = await _session(ctx, server, engine_id="reader")
        intruder.send((server.host, server.port), session, b"free:req-1")
        await _until(lambda: server.notifications_refused["wrong_sender"] == 1)
        assert received == []
        intruder.forget((server.host, server.port))
        assert len(intruder) == 0
    finally:
        intruder.close()
        await server.close()


async def test_sessions_on_the_server_stay_bounded(ctx):
    server = HandshakeServer(
        ctx, _reply_for, max_request_bytes=64 << 10, max_frame_bytes=4 << 20, max_notify_sessions=3
    )
    await server.start("127.0.0.1", 0)
    try:
        for i in range(10):
            await _session(ctx, server, engine_id=f"e{i}", secret=None)
        assert len(server.guard) == 3 and server.served == 10
    finally:
        await server.close()


async def test_a_handshake_read_after_its_asker_gave_up_leaves_the_asker_s_session_alone(ctx):
    """The reader's newest session is not used yet when the server reads, late, a handshake whose asker had
    already closed its socket (as one that timed out does; the request stays readable at the server).
    Before, the server issued that a session too and, keeping two per engine, evicted the reader's newest:
    its next notification was refused (`unknown_session`) while the reader's `notify()` had returned."""
    received: list[tuple[str, bytes]] = []
    server = await _serve(ctx, None, received)
    notifier = SideChannelNotifier(ctx, "reader", None)
    address = (server.host, server.port)
    gone = ctx.socket(zmq.DEALER)
    gone.setsockopt(zmq.LINGER, 0)
    try:
        first = await _session(ctx, server, secret=None)
        notifier.send(address, first, b"free:req-1")
        await _until(lambda: received)
        current = await _session(ctx, server, secret=None)  # the reader sends under this one from now on
        gone.connect(f"tcp://{server.host}:{server.port}")
        request = messages.MetadataRequest(tcp_segment_bytes=TCP_SEGMENT_BYTES, engine_id="reader")
        await gone.send(messages.encode(request))
        time.sleep(0.3)  # (the loop held: the server cannot read it yet; ZMQ's I/O threads deliver it)
        gone.close(0)
        time.sleep(0.3)  # (and see the asker's socket go)
        await asyncio.sleep(0.2)  # the late request read, its answer not sent
        notifier.send(address, current, b"free:req-2")
        await _until(lambda: len(received) == 2 or server.notifications_refused)
        assert received == [("reader", b"free:req-1"), ("reader", b"free:req-2")]
        assert not server.notifications_refused
        assert server.served == 2, "an answer that could not be sent is not counted as served"
        assert server.undelivered == 1, "the late request was read (else this test checked nothing)"
    finally:
        gone.close(0)
        notifier.close()
        await server.close()
