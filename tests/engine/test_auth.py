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
