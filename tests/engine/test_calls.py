"""Calls: small acknowledged request/reply exchanges over the side channel (`handle_calls` / `call`).

Two real engines (NIXL agents and ZMQ sockets); the server's handler runs on its loop.
"""

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from nixl_async import (
    CallTooLarge,
    EngineConfig,
    EngineIdMismatch,
    HandshakeRejected,
    HandshakeTimeout,
    TransferEngine,
    messages,
)

SECRET = b"call secret: sixteen bytes at least"


async def _pair(server_secret: bytes | None = None, client_secret: bytes | None = None):
    server = await TransferEngine(EngineConfig(engine_id="server", auth_secret=server_secret)).start()
    client = await TransferEngine(EngineConfig(engine_id="client", auth_secret=client_secret)).start()
    await server.serve("127.0.0.1", 0)
    return server, client


async def test_a_call_reaches_the_topic_handler_with_its_sender_and_returns_its_reply():
    server, client = await _pair(SECRET, SECRET)
    seen = []

    def echo(sender: str, payload: bytes) -> bytes:
        seen.append((sender, payload))
        return payload[::-1]

    try:
        server.handle_calls("echo", echo)
        peer = await client.connect(*server.address)
        assert await client.call(peer, "echo", b"abc") == b"cba"
        assert await client.call(peer, "echo", b"") == b""
        assert seen == [("client", b"abc"), ("client", b"")]
        assert client.stats.counters["calls"] == 2 and server.stats.counters["calls_answered"] == 2
    finally:
        await client.close()
        await server.close()


async def test_unknown_topics_and_refusing_handlers_answer_a_typed_error():
    server, client = await _pair()

    def picky(_sender: str, payload: bytes) -> bytes:
        if payload != b"ok":
            raise ValueError(f"will not take {payload!r}")
        return b"fine"

    def broken(_sender: str, _payload: bytes) -> bytes:
        raise RuntimeError("a bug in the handler")

    try:
        server.handle_calls("picky", picky)
        server.handle_calls("broken", broken)
        peer = await client.connect(*server.address)
        with pytest.raises(HandshakeRejected, match="unknown_topic") as unknown:
            await client.call(peer, "nope", b"")
        with pytest.raises(HandshakeRejected, match=r"refused\): will not take b'bad'") as refused:
            await client.call(peer, "picky", b"bad")
        with pytest.raises(HandshakeRejected, match=r"internal\): RuntimeError") as internal:
            await client.call(peer, "broken", b"")
        # the peer's code, for a program to act on (before session 40: only in the text)
        assert (unknown.value.code, refused.value.code, internal.value.code) == ("unknown_topic", "refused", "internal")
        assert await client.call(peer, "picky", b"ok") == b"fine"  # the server carries on
        assert client.stats.counters["call_failures"] == 3
    finally:
        await client.close()
        await server.close()


@pytest.mark.parametrize(
    ("client_secret", "refusal"),
    [(None, "requires authentication"), (b"a wrong secret of sixteen+ bytes", "authentication failed")],
)
async def test_calls_are_authenticated_like_handshakes(client_secret, refusal):
    server, client = await _pair(SECRET, client_secret)
    ran = []
    try:
        server.handle_calls("t", lambda sender, payload: ran.append(sender) or b"")
        # A peer learned with the right secret, then called by an engine without it.
        async with TransferEngine(EngineConfig(engine_id="insider", auth_secret=SECRET)) as insider:
            peer = await insider.connect(*server.address)
            with pytest.raises(HandshakeRejected, match=refusal):
                await client.call(peer, "t", b"")
            assert await insider.call(peer, "t", b"") == b""
        assert ran == ["insider"]
    finally:
        await client.close()
        await server.close()


async def test_a_signed_call_cannot_be_replayed():
    server, _client = await _pair(SECRET)
    await _client.close()
    ran = []
    server.handle_calls("t", lambda sender, payload: ran.append(payload) or b"done")
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect("tcp://{}:{}".format(*server.address))

    async def ask(request: messages.CallRequest):
        await sock.send(messages.encode(request))
        return messages.decode_reply(await asyncio.wait_for(sock.recv(), 5))

    try:
        challenge = await ask(messages.CallRequest(engine_id="x", topic="t", payload=b"once"))
        assert isinstance(challenge, messages.AuthChallenge)
        signed = msgspec.structs.replace(messages.CallRequest(engine_id="x", topic="t", payload=b"once"),
                                         nonce=challenge.nonce)  # fmt: skip
        signed = msgspec.structs.replace(signed, mac=messages.request_mac(SECRET, signed))
        assert await ask(signed) == messages.CallReply(engine_id="server", payload=b"done")
        again = await ask(signed)
        assert isinstance(again, messages.ErrorReply) and again.code == "auth_failed"
        # The MAC covers the payload: a fresh nonce with someone else's payload is refused too.
        challenge = await ask(messages.CallRequest(engine_id="x", topic="t"))
        forged = msgspec.structs.replace(signed, nonce=challenge.nonce, payload=b"twice")
        reply = await ask(forged)
        assert isinstance(reply, messages.ErrorReply) and reply.code == "auth_failed"
        assert ran == [b"once"]
    finally:
        sock.close(0)
        ctx.term()
        await server.close()


async def test_a_call_to_a_dead_or_replaced_peer_fails_within_its_timeout():
    server, client = await _pair()
    try:
        server.handle_calls("t", lambda sender, payload: b"")
        peer = await client.connect(*server.address)
        address = server.address
        await server.close()
        started = time.monotonic()
        with pytest.raises(HandshakeTimeout):
            await client.call(peer, "t", b"", timeout=0.5)
        assert time.monotonic() - started < 2
        # Another engine now answers at that address: the reply is not taken for the old peer's.
        async with TransferEngine(EngineConfig(engine_id="newcomer")) as newcomer:
            ran = []
            newcomer.handle_calls("t", lambda sender, payload: ran.append(sender) or b"from the newcomer")
            await newcomer.serve(*address)
            with pytest.raises(EngineIdMismatch, match="newcomer"):
                await client.call(peer, "t", b"")
            assert ran == [], "the newcomer ran a handler meant for the old peer (before session 36 it did)"
    finally:
        await client.close()
        if server.running:
            await server.close()


async def test_a_handler_raising_cancelled_error_does_not_stop_the_server():
    """`.result()` of a cancelled task inside a handler raises `CancelledError`, which is no `Exception`.
    Before, it ended the server's task for good, silently: every later call and handshake timed out."""
    server, client = await _pair()

    def cancelled(_sender: str, _payload: bytes) -> bytes:
        raise asyncio.CancelledError("a cancelled task's result")

    try:
        server.handle_calls("cancelled", cancelled)
        server.handle_calls("fine", lambda sender, payload: b"fine")
        peer = await client.connect(*server.address)
        with pytest.raises(HandshakeRejected, match="internal"):
            await client.call(peer, "cancelled", b"", timeout=2)
        assert await client.call(peer, "fine", b"", timeout=2) == b"fine"
        async with TransferEngine(EngineConfig(engine_id="later")) as later:
            assert (await later.connect(*server.address, timeout=2)).engine_id == "server"
    finally:
        await client.close()
        await server.close()


async def test_handlers_and_payloads_calls_cannot_carry_are_refused_up_front():
    """Before: an `async def` handler was taken and every call failed; a reply that was not bytes failed to decode
    at the caller (counted answered); a payload over the peer's frame limit waited out the call's timeout."""
    server, client = await _pair()

    async def coroutine_handler(_sender: str, _payload: bytes) -> bytes:
        return b""

    try:
        with pytest.raises(TypeError, match="plain function"):
            server.handle_calls("async", coroutine_handler)
        server.handle_calls("text", lambda sender, payload: "not bytes")
        peer = await client.connect(*server.address)
        with pytest.raises(HandshakeRejected, match="internal"):
            await client.call(peer, "text", b"", timeout=2)
        assert server.stats.counters["calls_answered"] == 0
        started = time.monotonic()
        with pytest.raises(CallTooLarge, match="max_request_bytes"):  # a ValueError, raised unsent
            await client.call(peer, "text", bytes(8 << 20), timeout=5)
        assert time.monotonic() - started < 0.5
    finally:
        await client.close()
        await server.close()


async def test_refused_credentials_are_logged_at_most_once_a_second(caplog):
    """Anyone reaching the port chose how many warnings a server logged (one per bad request)."""
    server, _client = await _pair(SECRET)
    ctx = zmq.asyncio.Context()
    try:
        for i in range(50):
            sock = ctx.socket(zmq.DEALER)
            sock.connect(f"tcp://{server.address[0]}:{server.address[1]}")
            request = messages.CallRequest(engine_id=f"intruder-{i}" * 100, topic="t", nonce=b"n" * 16, mac=b"m" * 32)
            await sock.send(messages.encode(request))
            await asyncio.wait_for(sock.recv(), 2)
            sock.close(0)
        refused = [r for r in caplog.records if "bad or stale credentials" in r.getMessage()]
        assert len(refused) == 1 and len(refused[0].getMessage()) < 300
        assert server._server.auth_failures == 50
    finally:
        ctx.term()
        await _client.close()
        await server.close()
