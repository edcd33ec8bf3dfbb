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


async def _fail_for_good(engine, monkeypatch):
    """The engine's server fails for good (its loop died and it could not bind again), as above."""
    server = engine._server

    def no_bind(host, port):
        raise zmq.ZMQError(98, "address in use")

    monkeypatch.setattr(server, "_bind", no_bind)
    _break_answering(monkeypatch, server, times=1)
    with pytest.raises(HandshakeTimeout):  # (the asker's handshake is what hits the broken reply)
        probe = TransferEngine(EngineConfig(engine_id="probe"))
        await probe.start()
        try:
            await probe.connect(*engine.address, timeout=1)
        finally:
            await probe.close()
    for _ in range(500):
        if server.failed is not None:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the server did not fail")


@pytest.mark.parametrize("where", ["another port", "the same port"])
async def test_a_peer_serving_again_is_notified_and_called_where_it_serves_now(monkeypatch, where):
    """An audit of session 39: after a peer's server failed for good and it served again, connect() kept the
    peer (same agent and metadata) but not the new server's address, so notifications (reported sent) and calls
    went to the dead one; on the same port the new server knew none of the old one's notify sessions."""
    import socket

    async with TransferEngine(EngineConfig(engine_id="A", notify_via="side_channel")) as a, \
               TransferEngine(EngineConfig(engine_id="B", notify_via="side_channel")) as b:  # fmt: skip
        if where == "the same port":
            with socket.socket() as s:  # (a port of our own choosing, to serve on again)
                s.bind(("127.0.0.1", 0))
                first_port = s.getsockname()[1]
        else:
            first_port = 0
        host, p1 = await b.serve("127.0.0.1", first_port)
        b.handle_calls("echo", lambda sender, payload: payload)
        peer = await a.connect(host, p1)
        await a.notify(peer, b"one")
        await b.wait_notifications(b"one", timeout=5)
        await _fail_for_good(b, monkeypatch)
        monkeypatch.undo()
        await b._server.close()  # (its socket: the same port must be free to serve on again)
        _, p2 = await b.serve(host, p1 if where == "the same port" else 0)
        again = await a.connect(host, p2)
        assert again is peer and again.address == (host, p2)
        await a.notify(again, b"two")
        await b.wait_notifications(b"two", timeout=5)
        assert await a.call(again, "echo", b"x", timeout=5) == b"x"
        if where == "another port":
            assert a._peers.table.at((host, p1)) is None, "the dead address no longer names the peer"
