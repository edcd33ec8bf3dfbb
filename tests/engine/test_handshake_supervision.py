"""The handshake server is supervised: if its loop dies it rebinds the same address and answers
again; if it cannot, it stops advertising the address (never a silent, dead address)."""

import asyncio

import numpy as np
import pytest
import zmq

from nixl_async import EngineConfig, HandshakeTimeout, TransferEngine


@pytest.fixture
async def asker():
    engine = TransferEngine(EngineConfig(engine_id="asker"))
    await engine.start()
    engine.register("kv", [np.zeros(4096, np.uint8)], block_len=4096)
    yield engine
    await engine.close()


def _break_answering(monkeypatch, server, times):
    """The serving loop dies sending its next `times` replies (a failure no one message owns: since session 38
    an error answering a message drops that message alone, never the loop)."""
    sock = server._socket
    real, calls = sock.send_multipart, []

    async def broken(parts, *args, **kwargs):
        calls.append(1)
        if len(calls) <= times:
            raise RuntimeError("a bug in replying")
        return await real(parts, *args, **kwargs)

    monkeypatch.setattr(sock, "send_multipart", broken)


async def test_server_restarts_on_the_same_address_after_its_loop_dies(nixl_engine, asker, monkeypatch):
    nixl_engine.register("kv", [np.zeros(4096, np.uint8)], block_len=4096)
    address = nixl_engine.address
    _break_answering(monkeypatch, nixl_engine._server, times=1)
    with pytest.raises(HandshakeTimeout):
        await asker.connect(*address, timeout=1)  # the request that hit the bug is lost
    peer = await asker.connect(*address, timeout=5)
    assert peer.engine_id == nixl_engine.engine_id
    extra = nixl_engine.snapshot().counters
    assert extra["handshake_server_restarts"] == 1 and extra["handshake_server_failed"] == 0
    assert nixl_engine.address == address


async def test_server_that_cannot_rebind_stops_advertising(nixl_engine, asker, monkeypatch):
    server = nixl_engine._server
    address = nixl_engine.address
    _break_answering(monkeypatch, server, times=1)

    def no_bind(host, port):
        raise zmq.ZMQError(98, "address in use")

    monkeypatch.setattr(server, "_bind", no_bind)
    with pytest.raises(HandshakeTimeout):
        await asker.connect(*address, timeout=1)
    for _ in range(500):
        if server.failed is not None:
            break
        await asyncio.sleep(0.01)
    assert server.failed is not None
    assert nixl_engine.address is None
    assert nixl_engine.snapshot().counters["handshake_server_failed"] == 1
