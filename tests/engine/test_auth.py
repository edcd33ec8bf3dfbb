"""Shared-secret authentication of handshakes (HMAC over a single-use server nonce)."""

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio

from nixl_async import EngineConfig, HandshakeRejected, TransferEngine, messages
from nixl_async.config import TCP_SEGMENT_BYTES
from nixl_async.testing import Stats

SECRET = b"correct horse battery staple 42!"
WRONG = b"incorrect horse battery staple 0"


async def test_only_holders_of_the_secret_get_in(nixl_peer_factory):
    peer_proc = nixl_peer_factory(auth_secret=SECRET)
    async with TransferEngine(EngineConfig(engine_id="has-key", auth_secret=SECRET)) as engine:
        peer = await engine.connect(*peer_proc.address)
        assert peer.engine_id == peer_proc.engine_id
    async with TransferEngine(EngineConfig(engine_id="no-key")) as engine:
        with pytest.raises(HandshakeRejected, match="requires authentication") as no_key:
            await engine.connect(*peer_proc.address)
    async with TransferEngine(EngineConfig(engine_id="wrong-key", auth_secret=WRONG)) as engine:
        with pytest.raises(HandshakeRejected, match="authentication failed") as wrong_key:
            await engine.connect(*peer_proc.address)
    for exc in (no_key.value, wrong_key.value):
        assert SECRET.decode() not in str(exc) and WRONG.decode() not in str(exc)
    counters = (await peer_proc.request(Stats()))["counters"]
    assert counters["handshake_auth_failures"] == 1 and counters["handshakes_answered"] == 1
    log = peer_proc.stderr()
    assert "refused a handshake from engine 'wrong-key'" in log
    assert SECRET.decode() not in log and WRONG.decode() not in log


def test_secret_never_shows_in_repr():
    config = EngineConfig(auth_secret=SECRET)
    assert SECRET.decode() not in repr(config) and "auth_secret" not in repr(config)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        EngineConfig(auth_secret=b"short")


@pytest.mark.nixl_engine_config(auth_secret=SECRET)
async def test_a_signed_request_cannot_be_replayed(nixl_engine):
    host, port = nixl_engine.address
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://{host}:{port}")

    async def ask(request: messages.MetadataRequest):
        await sock.send(messages.encode(request))
        return messages.decode_reply(await asyncio.wait_for(sock.recv(), 5))

    try:
        challenge = await ask(messages.MetadataRequest(tcp_segment_bytes=TCP_SEGMENT_BYTES, engine_id="client"))
        assert isinstance(challenge, messages.AuthChallenge) and len(challenge.nonce) == 16
        signed = msgspec.structs.replace(
            messages.MetadataRequest(tcp_segment_bytes=TCP_SEGMENT_BYTES, engine_id="client"), nonce=challenge.nonce
        )
        signed = msgspec.structs.replace(signed, mac=messages.request_mac(SECRET, signed))
        assert isinstance(await ask(signed), messages.MetadataReply)
        replay = await ask(signed)
        assert isinstance(replay, messages.ErrorReply) and replay.code == "auth_failed"
        # a MAC for another request (here: another engine id) does not verify either
        second = await ask(messages.MetadataRequest(tcp_segment_bytes=TCP_SEGMENT_BYTES, engine_id="client"))
        forged = msgspec.structs.replace(signed, nonce=second.nonce, engine_id="intruder")
        reply = await ask(forged)
        assert isinstance(reply, messages.ErrorReply) and reply.code == "auth_failed"
    finally:
        ctx.destroy(0)


class _Impostor:
    """A side channel at an address where an engine with our secret served (a dead engine's port), answering
    as `answer(request)` says: it has the real engine's last metadata, not the secret."""

    def __init__(self, answer):
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.answer = answer
        self.task = asyncio.ensure_future(self._run())

    async def _run(self):
        while True:
            identity, payload = await self.sock.recv_multipart()
            await self.sock.send_multipart([identity, self.answer(messages.decode_request(payload))])

    async def close(self):
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.ctx.destroy(0)


@pytest.mark.parametrize("how", ["unchallenged", "unsigned", "wrong secret", "replayed"])
async def test_a_server_that_cannot_prove_the_secret_is_refused(how):
    """Before, only the asker proved the secret: whoever answered at the address was taken at its word
    (its metadata loaded, our reads and writes sent to its memory)."""
    async with TransferEngine(EngineConfig(engine_id="real", auth_secret=SECRET)) as real, \
            TransferEngine(EngineConfig(engine_id="asker", auth_secret=SECRET)) as asker:  # fmt: skip
        metadata = messages.encode(real._metadata())
        earlier = messages.reply_mac(SECRET, b"m" * 32, metadata)  # a signed reply to another request

        def answer(request: messages.MetadataRequest) -> bytes:
            if how == "unchallenged" or (request.mac and how == "unsigned"):
                return metadata
            if not request.mac:
                return messages.encode(messages.AuthChallenge(nonce=b"n" * 16))
            mac = messages.reply_mac(WRONG, request.mac, metadata) if how == "wrong secret" else earlier
            return messages.encode(messages.SignedReply(payload=metadata, mac=mac))

        impostor = _Impostor(answer)
        try:
            with pytest.raises(HandshakeRejected, match="shared secret"):
                await asker.connect("127.0.0.1", impostor.port, timeout=3)
        finally:
            await impostor.close()
        assert asker.peers == [] and not asker.live_handles().get("remote_agents")
        peer = await asker.connect(*await real.serve())  # the real engine proves it
        assert peer.engine_id == "real"


@pytest.mark.nixl_engine_config(auth_secret=SECRET)
async def test_calls_are_answered_signed_and_checked(nixl_engine):
    nixl_engine.handle_calls("echo", lambda _sender, payload: payload[::-1])
    async with TransferEngine(EngineConfig(engine_id="caller", auth_secret=SECRET)) as caller:
        peer = await caller.connect(*nixl_engine.address)
        assert await caller.call(peer, "echo", b"abc") == b"cba"


async def test_a_recorded_exchange_replayed_at_the_address_is_refused():
    """An impostor at a dead engine's address that recorded one authenticated handshake replays its challenge,
    then its signed reply. Before, the asker (same engine id, same settings) signed the same request again under
    the recorded nonce, and the recorded reply verified: the dead engine's old metadata was taken."""
    async with TransferEngine(EngineConfig(engine_id="real", auth_secret=SECRET)) as real:
        host, port = await real.serve()
        ctx = zmq.asyncio.Context()
        front = ctx.socket(zmq.ROUTER)
        relay_port = front.bind_to_random_port("tcp://127.0.0.1")
        back = ctx.socket(zmq.DEALER)
        back.connect(f"tcp://{host}:{port}")
        recorded: list[bytes] = []

        async def relay(replaying: bool):
            while True:
                identity, payload = await front.recv_multipart()
                if replaying:
                    answer = recorded[len(replayed)]
                    replayed.append(answer)
                else:
                    await back.send(payload)
                    answer = await back.recv()
                    recorded.append(answer)
                await front.send_multipart([identity, answer])

        replayed: list[bytes] = []
        task = asyncio.ensure_future(relay(False))
        try:
            async with TransferEngine(EngineConfig(engine_id="asker", auth_secret=SECRET)) as asker:
                assert (await asker.connect("127.0.0.1", relay_port, timeout=3)).engine_id == "real"
            assert len(recorded) == 2  # the challenge, then the signed reply
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            task = asyncio.ensure_future(relay(True))  # "real" is gone; the impostor has the recording
            async with TransferEngine(EngineConfig(engine_id="asker", auth_secret=SECRET)) as again:
                with pytest.raises(HandshakeRejected, match="shared secret"):
                    await again.connect("127.0.0.1", relay_port, timeout=3)
                assert again.peers == []
            assert len(replayed) == 2
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            ctx.destroy(0)
