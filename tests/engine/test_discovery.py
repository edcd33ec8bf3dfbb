"""Fleet discovery through a real etcd: publish, find by engine id, refresh, leave, and etcd failing."""

import asyncio
import contextlib
import inspect
import socket
import time

import msgspec
import numpy as np
import pytest

from nixl_async import (
    DiscoveryUnavailable,
    EngineConfig,
    EngineIdMismatch,
    EtcdConfig,
    HandshakeRejected,
    HandshakeTimeout,
    IncompatiblePeerError,
    PeerNotPublished,
    ProtocolError,
    TransferEngine,
    discovery,
    messages,
)
from nixl_async._etcd_http import EtcdHttp, prefix_end
from nixl_async.testing import Register, Stats, WaitNotifications, assert_no_live_handles, verify_blocks
from nixl_async.testing.etcd import EtcdServer, etcd_or_skip

BLOCK = 4096
NAMESPACE = "nixl_async_test"


@pytest.fixture(scope="module")
def etcd():
    with etcd_or_skip() as server:
        yield server


def _etcd_config(server: EtcdServer, **fields) -> EtcdConfig:
    return EtcdConfig(server.endpoint, namespace=NAMESPACE, **fields)


async def _engine(etcd_config: EtcdConfig, **fields) -> TransferEngine:
    engine = TransferEngine(EngineConfig(etcd=etcd_config, **fields))
    await engine.start()
    return engine


def _regions(n=2, blocks=64):
    return [np.zeros(blocks * BLOCK, dtype=np.uint8) for _ in range(n)]


def _publisher(factory, server, **spec):
    return factory(etcd_endpoint=server.endpoint, etcd_namespace=NAMESPACE, **spec)


def _key(engine_id: str) -> bytes:
    return f"{NAMESPACE}/engines/{engine_id}".encode()


async def _etcd_value(server: EtcdServer, engine_id: str) -> bytes | None:
    return server.get(_key(engine_id))


async def test_connect_by_engine_id_reads_what_the_publisher_registered_without_asking_it(etcd, nixl_peer_factory):
    publisher = _publisher(nixl_peer_factory, etcd)
    engine = await _engine(_etcd_config(etcd))
    try:
        regions = _regions()
        engine.register("kv", regions, block_len=BLOCK)
        peer = await engine.connect(engine_id=publisher.engine_id)
        assert peer.engine_id == publisher.engine_id
        assert peer.address == publisher.address  # its side channel, as published
        assert peer.layout("kv").num_blocks == 64
        await engine.read(peer, [0, 1, 9], [3, 4, 63])
        assert verify_blocks(regions, BLOCK, [0, 1, 9], [3, 4, 63], seed=1) == []
        assert await engine.connect(engine_id=publisher.engine_id) is peer  # held: no second lookup
        stats = await publisher.request(Stats())
        assert stats["counters"]["handshakes_answered"] == 0, "found through etcd: the publisher was never asked"
        assert engine.snapshot().counters["handshakes_via_etcd"] == 1
    finally:
        await engine.close()
    assert_no_live_handles(engine)


async def test_a_peer_adopted_from_its_record_over_tcp_gets_no_busy_hints_it_would_refuse(etcd, nixl_peer_factory):
    """Busy hints need the notify session a handshake issues; a record carries none (UCX over TCP: really in flight)."""
    publisher = _publisher(nixl_peer_factory, etcd, tcp=True)
    engine = await _engine(_etcd_config(etcd))
    try:
        regions = _regions()
        engine.register("kv", regions, block_len=BLOCK)
        peer = await engine.connect(engine_id=publisher.engine_id)
        await engine.read(peer, list(range(64)), list(range(64)))
        assert verify_blocks(regions, BLOCK, list(range(64)), list(range(64)), seed=1) == []
        assert engine.snapshot().counters.get("busy_hints_sent", 0) == 0
        stats = await publisher.request(Stats())
        assert stats["counters"]["handshake_auth_failures"] == 0, "the publisher refused hints without a session"
    finally:
        await engine.close()


async def test_an_engine_nobody_published_is_a_typed_error(etcd):
    engine = await _engine(_etcd_config(etcd))
    try:
        started = time.monotonic()
        with pytest.raises(PeerNotPublished, match="no engine 'nobody'"):
            await engine.connect(engine_id="nobody")
        assert time.monotonic() - started < 1.0
        with pytest.raises(TypeError):
            await engine.connect("127.0.0.1", 1, engine_id="nobody")
    finally:
        await engine.close()


async def test_a_wildcard_side_channel_address_is_not_published(etcd):
    """Before, `serve("0.0.0.0")` then `publish()` put 0.0.0.0 in etcd: readers on other hosts dialled their own."""
    engine = await _engine(_etcd_config(etcd))
    try:
        await engine.serve("0.0.0.0", 0)
        with pytest.raises(ValueError, match="cannot dial"):
            await engine.publish()
    finally:
        await engine.close()
    engine = await _engine(_etcd_config(etcd))
    try:
        await engine.publish()  # (no side channel yet: the record holds the metadata)
        with pytest.raises(ValueError, match="published in etcd"):
            await engine.serve("0.0.0.0", 0)
        assert engine.address is None
        await engine.serve("127.0.0.1", 0)
    finally:
        await engine.close()


async def test_connect_by_engine_id_needs_etcd_configured(nixl_engine):
    with pytest.raises(RuntimeError, match=r"EngineConfig\.etcd"):
        await nixl_engine.connect(engine_id="anyone")
    with pytest.raises(RuntimeError, match=r"EngineConfig\.etcd"):
        await nixl_engine.publish()


async def test_a_record_under_another_engines_key_is_refused(etcd, nixl_peer_factory):
    publisher = _publisher(nixl_peer_factory, etcd)
    value = await _etcd_value(etcd, publisher.engine_id)
    assert value is not None
    etcd.put(_key("impostor"), value)  # someone else's record
    etcd.put(_key("garbage"), b"\x00not msgpack")
    etcd.put(_key("not-utf8"), b"\x81\xa4type\xa2\xff\xfe")  # msgspec: UnicodeDecodeError, not DecodeError
    etcd.put(_key("deep"), b"\x82\xa4type\xb0published_engine\xa1x" + b"\x91" * 1000 + b"\xc0")  # RecursionError
    engine = await _engine(_etcd_config(etcd))
    try:
        with pytest.raises(EngineIdMismatch, match="impostor"):
            await engine.connect(engine_id="impostor")
        for name in ("garbage", "not-utf8", "deep"):  # (before: the last two raised msgspec's own errors untyped)
            with pytest.raises(ProtocolError, match="undecodable etcd record"):
                await engine.connect(engine_id=name)
        assert not engine.peers
    finally:
        await engine.close()


async def test_an_incompatible_engine_found_in_etcd_is_refused(etcd, nixl_peer_factory):
    publisher = _publisher(nixl_peer_factory, etcd, compat={"model": "a"})
    engine = await _engine(_etcd_config(etcd), compat={"model": "b"})
    try:
        with pytest.raises(IncompatiblePeerError, match="compatibility hash"):
            await engine.connect(engine_id=publisher.engine_id)
        assert not engine.peers
    finally:
        await engine.close()


async def test_an_engine_found_in_etcd_sending_larger_tcp_segments_is_refused(etcd, nixl_peer_factory):
    """Its record is adopted without asking it, so the reader's own check is what stops the READ."""
    publisher = _publisher(nixl_peer_factory, etcd, tcp_segment_bytes=1 << 20)
    engine = await _engine(_etcd_config(etcd))
    try:
        with pytest.raises(IncompatiblePeerError, match=r"at most 524288 bytes .* up to 1048576"):
            await engine.connect(engine_id=publisher.engine_id)
        assert not engine.peers
        counters = (await publisher.request(Stats()))["counters"]
        assert counters.get("handshakes_served", 0) == counters.get("handshakes_rejected", 0) == 0
    finally:
        await engine.close()


@pytest.mark.parametrize(("segment", "version"), [(None, 1), (512 << 10, 2)])
async def test_a_record_of_larger_tcp_segments_is_one_older_engines_refuse(etcd, nixl_peer_factory, segment, version):
    """Engines from before tcp_segment_bytes adopt records without asking and know version 1 only:
    a record whose engine sends larger segments than UCX's default carries version 2."""
    publisher = _publisher(nixl_peer_factory, etcd, tcp_segment_bytes=segment)
    record = msgspec.msgpack.decode(await _etcd_value(etcd, publisher.engine_id))
    assert record["version"] == version
    assert record["metadata"]["tcp_segment_bytes"] == (segment or 64 << 10)
    engine = await _engine(_etcd_config(etcd))  # ours reads either
    try:
        engine.register("kv", _regions(), block_len=BLOCK)
        peer = await engine.connect(engine_id=publisher.engine_id)
        await engine.read(peer, [0], [0])
    finally:
        await engine.close()


async def test_side_channel_notifications_handshake_at_the_published_address(etcd, nixl_peer_factory):
    """A notify session is issued by the peer per asker: etcd gives the address, the handshake the session."""
    publisher = _publisher(nixl_peer_factory, etcd)
    engine = await _engine(_etcd_config(etcd), notify_via="side_channel")
    try:
        engine.register("kv", _regions(1, 4), block_len=BLOCK)
        peer = await engine.connect(engine_id=publisher.engine_id)
        assert peer.notify_session
        await engine.notify(peer, b"found-in-etcd")
        assert await publisher.request(WaitNotifications(message=b"found-in-etcd", timeout=10)) == [engine.engine_id]
        stats = await publisher.request(Stats())
        assert stats["counters"]["handshakes_answered"] == 1
    finally:
        await engine.close()


async def _until(condition, timeout: float, what: str) -> float:
    """Seconds until `condition()` (or what it returns, awaited) is true; AssertionError past `timeout`."""
    started = time.monotonic()
    while not ((await found) if inspect.isawaitable(found := condition()) else found):
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what}: not within {timeout}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - started


async def test_a_new_registration_is_republished_and_a_connected_engine_refreshes(etcd, nixl_peer_factory):
    publisher = _publisher(nixl_peer_factory, etcd)
    engine = await _engine(_etcd_config(etcd))
    try:
        regions = _regions(1, 16)
        engine.register("kv", regions, block_len=BLOCK)
        peer = await engine.connect(engine_id=publisher.engine_id)
        assert set(peer.layouts) == {"kv"}
        await publisher.request(Register(layout_name="more", num_regions=1, num_blocks=16, seed=7))
        await _until(lambda: "more" in engine.peer(publisher.engine_id).layouts, 5.0, "the new layout reached us")
        refreshed = await engine.connect(engine_id=publisher.engine_id)
        await engine.read(refreshed, [0, 5], [2, 15], remote="more")
        assert verify_blocks(regions, BLOCK, [0, 5], [2, 15], seed=7) == []
        assert engine.snapshot().counters["published_peers_refreshed"] >= 1
    finally:
        await engine.close()
    assert_no_live_handles(engine)


class _Blackhole:
    """A TCP relay to etcd whose open connections can be made to carry nothing more, as in a network
    partition (no reset: the other end cannot tell). New connections still go through."""

    def __init__(self, target: str, delay_s: float = 0.0):
        self.host, port = target.split(":")
        self.port = int(port)
        self.frozen = asyncio.Event()
        self.delay_s = delay_s  # each chunk held this long each way (a slow link)

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader, writer):
        if self.frozen.is_set():
            self.frozen = asyncio.Event()  # a connection made after the partition: a working one
        frozen = self.frozen
        upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.port)

        async def pump(src, dst):
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    if frozen.is_set():
                        await asyncio.sleep(3600)  # cancelled at close
                    await asyncio.sleep(self.delay_s)
                    dst.write(data)
                    await dst.drain()

        await asyncio.gather(pump(reader, upstream_writer), pump(upstream_reader, writer))

    async def close(self):
        self._server.close()


async def test_a_watch_cut_off_without_a_reset_is_started_again(etcd, nixl_peer_factory, monkeypatch):
    """A partition leaves the follower's watch connection open and silent: the watch restarts once it has
    been quiet for its idle limit, and the records changed meanwhile still reach us."""
    monkeypatch.setattr(discovery, "_WATCH_IDLE_S", 1.0)
    relay = _Blackhole(etcd.endpoint)
    publisher = _publisher(nixl_peer_factory, etcd)
    engine = await _engine(EtcdConfig(await relay.start(), namespace=NAMESPACE))
    try:
        await engine.connect(engine_id=publisher.engine_id)
        await asyncio.sleep(0.3)  # the follower's watch is up
        relay.frozen.set()
        await publisher.request(Register(layout_name="more", num_regions=1, num_blocks=16, seed=7))
        await _until(lambda: "more" in engine.peer(publisher.engine_id).layouts, 10.0, "the change reached us")
    finally:
        await engine.close()
        await relay.close()


async def test_a_quiet_watch_starts_again_without_listing_every_record(etcd, nixl_peer_factory, monkeypatch):
    """Restarting a watch that carried nothing costs a listing of keys only, while they stand as known."""
    monkeypatch.setattr(discovery, "_WATCH_IDLE_S", 0.3)
    listings: list[bool] = []
    real = EtcdHttp.get_prefix

    async def counted(self, prefix, *, keys_only=False):
        listings.append(keys_only)
        return await real(self, prefix, keys_only=keys_only)

    monkeypatch.setattr(EtcdHttp, "get_prefix", counted)
    publisher = _publisher(nixl_peer_factory, etcd)
    engine = await _engine(_etcd_config(etcd))
    try:
        await engine.connect(engine_id=publisher.engine_id)
        await asyncio.sleep(1.5)
        assert listings.count(False) == 1 and listings.count(True) >= 2, listings
        await publisher.request(Register(layout_name="more", num_regions=1, num_blocks=16, seed=7))
        await _until(lambda: "more" in engine.peer(publisher.engine_id).layouts, 5.0, "the change reached us")
    finally:
        await engine.close()


async def test_an_etcd_reply_cut_midway_is_a_typed_error():
    async def cut(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{"header":{')
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(cut, "127.0.0.1", 0)
    endpoint = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    engine = await _engine(EtcdConfig(endpoint), handshake_timeout_s=1.0)
    try:
        for attempt in (lambda: engine.connect(engine_id="anyone"), engine.publish):
            with pytest.raises(DiscoveryUnavailable):
                await attempt()
    finally:
        await engine.close()
        server.close()


async def test_a_streaming_endpoints_error_keeps_its_grpc_code():
    """etcd's gateway answers a keepalive (and a watch) error as ``{"error": {"grpc_code": ...}}`` with HTTP 200.
    Before, the keepalive's failed to decode (untyped) and the watch's code was read as 0, so UNAVAILABLE
    (a leader election) was not retried as such."""
    from nixl_async._etcd_http import EtcdError

    unavailable = b'{"error":{"grpc_code":14,"http_code":503,"message":"etcdserver: leader changed"}}'

    async def answer(reader, writer):
        head = (await reader.readuntil(b"\r\n\r\n")).lower()
        await reader.readexactly(int(head.split(b"content-length:")[1].split(b"\r\n")[0]))
        body = unavailable + b"\n"
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    client = EtcdHttp(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        with pytest.raises(EtcdError) as keepalive:
            await client.keep_alive(7)
        with pytest.raises(EtcdError) as watch:
            async for _event in client.watch_prefix(b"k/", 1, 5.0, 5.0):
                pass
        assert keepalive.value.code == watch.value.code == 14
        assert "leader changed" in str(keepalive.value)
    finally:
        await client.close()
        server.close()


async def test_close_removes_the_record_and_a_connected_engine_notices(etcd, nixl_peer_factory):
    publisher = _publisher(nixl_peer_factory, etcd)
    engine = await _engine(_etcd_config(etcd))
    try:
        peer = await engine.connect(engine_id=publisher.engine_id)
        await publisher.astop()
        assert await _etcd_value(etcd, publisher.engine_id) is None, "close() must remove the record at once"
        await _until(lambda: peer.unpublished, 5.0, "the connected engine saw the record go")
        with pytest.raises(PeerNotPublished):
            await engine.connect(engine_id=publisher.engine_id)
    finally:
        await engine.close()


async def test_a_killed_engine_disappears_when_its_lease_runs_out(etcd, nixl_peer_factory):
    publisher = _publisher(nixl_peer_factory, etcd, etcd_lease_ttl_s=2)
    assert await _etcd_value(etcd, publisher.engine_id) is not None
    await publisher.akill()
    started = time.monotonic()
    while await _etcd_value(etcd, publisher.engine_id) is not None:
        assert time.monotonic() - started < 4.0, "a dead engine's record outlived its 2 s lease"
        await asyncio.sleep(0.1)


async def test_a_live_engine_keeps_its_record_past_the_lease(etcd, nixl_peer_factory):
    publisher = _publisher(nixl_peer_factory, etcd, etcd_lease_ttl_s=2)
    await asyncio.sleep(5.0)  # more than two leases: renewals keep it
    assert await _etcd_value(etcd, publisher.engine_id) is not None
    del publisher


async def test_etcd_down_is_a_typed_error_and_connected_engines_keep_transferring(nixl_peer_factory):
    with etcd_or_skip() as server:  # its own: this test stops it
        first = _publisher(nixl_peer_factory, server, etcd_lease_ttl_s=3)
        second = _publisher(nixl_peer_factory, server, etcd_lease_ttl_s=3)
        engine = await _engine(_etcd_config(server), handshake_timeout_s=1.5)
        try:
            regions = _regions()
            engine.register("kv", regions, block_len=BLOCK)
            peer = await engine.connect(engine_id=first.engine_id)
            server.wipe()  # down, and back later as a new etcd: no keys, no leases, revisions from 1
            started = time.monotonic()
            with pytest.raises(DiscoveryUnavailable, match=r"did not answer|failed"):
                await engine.connect(engine_id=second.engine_id)
            assert time.monotonic() - started < 1.5 + 0.5
            with pytest.raises(DiscoveryUnavailable):
                await engine.publish()
            await engine.read(peer, [0, 1], [10, 11])  # transfers never touch etcd
            assert verify_blocks(regions, BLOCK, [0, 1], [10, 11], seed=1) == []
            server.start()
            # Publishers notice their lease is gone and put their records back; readers watch again.
            for publisher in (first, second):
                for _ in range(100):
                    if await _etcd_value(server, publisher.engine_id) is not None:
                        break
                    await asyncio.sleep(0.1)
                else:
                    raise AssertionError("a publisher did not put its record back after etcd came back")
            second_peer = await engine.connect(engine_id=second.engine_id)
            assert second_peer.engine_id == second.engine_id
            await first.request(Register(layout_name="after", num_regions=1, num_blocks=4, seed=9))
            await _until(lambda: "after" in engine.peer(first.engine_id).layouts, 10.0, "a change after the restart")
        finally:
            await engine.close()


async def test_an_etcd_that_never_answers_is_a_typed_error_within_the_timeout():
    with socket.socket() as silent:  # accepts connections (backlog) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"127.0.0.1:{silent.getsockname()[1]}"
        engine = await _engine(EtcdConfig(endpoint), handshake_timeout_s=1.0)
        try:
            for attempt in (lambda: engine.connect(engine_id="anyone"), engine.publish):
                started = time.monotonic()
                with pytest.raises(DiscoveryUnavailable, match="did not answer"):
                    await attempt()
                assert 0.9 < time.monotonic() - started < 1.6
        finally:
            await engine.close()


def test_published_record_round_trips():
    reply = messages.MetadataReply(
        version=messages.PROTOCOL_VERSION, engine_id="e", agent_name="e/1", agent_metadata=b"md",
        compat_hash="h", layouts=[],
    )  # fmt: skip
    for metadata in (reply, None):
        record = messages.PublishedEngine(engine_id="e", compat_hash="h", host="10.0.0.2", port=5600, metadata=metadata)
        assert messages.decode_published(messages.encode(record)) == record


async def test_with_a_shared_secret_the_memory_keys_stay_behind_the_side_channel(etcd, nixl_peer_factory):
    """etcd has no authentication here: a record must not let anyone without the secret reach the memory."""
    secret = b"discovery-secret-0123456789"
    publisher = _publisher(nixl_peer_factory, etcd, auth_secret=secret)
    record = messages.decode_published(await _etcd_value(etcd, publisher.engine_id))
    assert record.metadata is None and record.host and record.fingerprint
    stranger = await _engine(_etcd_config(etcd))
    member = await _engine(_etcd_config(etcd), auth_secret=secret)
    try:
        with pytest.raises(HandshakeRejected, match="requires authentication"):
            await stranger.connect(engine_id=publisher.engine_id)
        regions = _regions(2, 8)
        member.register("kv", regions, block_len=BLOCK)
        peer = await member.connect(engine_id=publisher.engine_id)
        await member.read(peer, [3], [30])
        assert verify_blocks(regions, BLOCK, [3], [30], seed=1) == []
        stats = await publisher.request(Stats())
        assert stats["counters"]["handshakes_answered"] == 1 and stats["counters"]["handshake_auth_failures"] == 0
    finally:
        await stranger.close()
        await member.close()


async def test_a_stale_record_at_a_live_engines_address_does_not_displace_it(etcd, nixl_peer_factory):
    """A record is a claim: an engine that died leaves one naming an address another engine now serves."""
    live = nixl_peer_factory()
    ghost = _publisher(nixl_peer_factory, etcd)
    value = messages.decode_published(await _etcd_value(etcd, ghost.engine_id))
    claim = msgspec.structs.replace(value, host=live.address[0], port=live.address[1])
    etcd.put(_key(ghost.engine_id), messages.encode(claim))  # the ghost "was" at the live one's address
    engine = await _engine(_etcd_config(etcd))
    try:
        regions = _regions()
        engine.register("kv", regions, block_len=BLOCK)
        live_peer = await engine.connect(*live.address)
        transfer = await engine.start_read(live_peer, list(range(64)), list(range(64)))
        await engine.connect(engine_id=ghost.engine_id)
        await transfer
        assert live_peer.connected and engine.peer(live.engine_id) is live_peer
        assert await engine.connect(*live.address) is live_peer
    finally:
        await engine.close()


async def test_a_stale_record_naming_another_engines_address_loads_nothing_of_it(etcd, nixl_peer_factory):
    """A reader that handshakes at the published address (side-channel notifications) names the engine it
    expects: the live engine there refuses, and nothing of it is adopted."""
    live = nixl_peer_factory()
    ghost = _publisher(nixl_peer_factory, etcd)
    value = messages.decode_published(await _etcd_value(etcd, ghost.engine_id))
    etcd.put(_key(ghost.engine_id), messages.encode(msgspec.structs.replace(value, host=live.address[0],
                                                                            port=live.address[1])))  # fmt: skip
    engine = await _engine(_etcd_config(etcd), notify_via="side_channel")
    try:
        with pytest.raises(EngineIdMismatch):
            await engine.connect(engine_id=ghost.engine_id)
        assert engine.peers == [] and engine.live_handles().get("remote_agents", 0) == 0
    finally:
        await engine.close()


@pytest.mark.parametrize(
    "endpoint",
    ["", "etcd", "etcd:", ":2379", "a:1,b:2", "http://etcd:2379", "etcd:port", "etcd:0", "etcd:99999", "etcd:\u0661"],
)  # (the last three taken before)
def test_etcd_config_refuses_what_it_cannot_use(endpoint):
    with pytest.raises(ValueError, match="endpoint"):
        EtcdConfig(endpoint)


@pytest.mark.parametrize("fields", [{"lease_ttl_s": 1}, {"lease_ttl_s": 2.5}, {"namespace": ""}, {"namespace": "x/"}])
def test_etcd_config_refuses_bad_fields(fields):
    with pytest.raises(ValueError):
        EtcdConfig("etcd:2379", **fields)


def test_etcd_settings_are_checked_by_name():
    with pytest.raises(ValueError, match=r"EngineConfig\.etcd"):
        EngineConfig(etcd="127.0.0.1:2379")
    with pytest.raises(ValueError, match="endpoint"):
        EtcdConfig(2379)
    assert EtcdConfig("[::1]:2379").host == "[::1]"  # as gRPC dials it


def test_prefix_end_bounds_exactly_the_keys_under_a_prefix():
    assert prefix_end(b"ns/engines/") == b"ns/engines0"
    assert prefix_end(b"a\xff") == b"b" and prefix_end(b"\xff\xff") == b"\x00"


def _record(engine_id: str, tag: str) -> messages.PublishedEngine:
    return messages.PublishedEngine(engine_id=engine_id, compat_hash="c", host="h" + tag, port=1, fingerprint=tag)


async def test_our_record_deleted_by_another_publisher_of_our_id_comes_back(etcd):
    """Two processes publish one engine id (a misconfiguration): the second's record replaces ours,
    and its close revokes its lease, which deletes the key while our lease lives on. The renewal
    notices and publishes again; before, our record stayed gone for as long as we ran."""
    config = EtcdConfig(etcd.endpoint, namespace=NAMESPACE, lease_ttl_s=2)
    ours, theirs = (discovery.EtcdDirectory(config, timeout=2.0) for _ in range(2))
    try:
        await ours.publish(_record("twice", "ours"))
        await theirs.publish(_record("twice", "theirs"))
        await theirs.close()
        assert await _etcd_value(etcd, "twice") is None
        await _until(lambda: _etcd_value(etcd, "twice"), 3.0, "our record never came back")
        assert messages.decode_published(await _etcd_value(etcd, "twice")).host == "hours"
    finally:
        await ours.close()
        await theirs.close()


async def test_publishing_again_after_the_lease_ran_out_takes_a_new_lease(etcd):
    """The lease ran out (a partition longer than its TTL, or etcd wiped) before the renewal saw it:
    `publish()` puts the record on a new lease; before, it raised `DiscoveryUnavailable` ("lease not
    found") with etcd up, and the renewal then failed every second until something put it again."""
    directory = discovery.EtcdDirectory(EtcdConfig(etcd.endpoint, namespace=NAMESPACE, lease_ttl_s=3), timeout=2.0)
    try:
        await directory.publish(_record("lapsed", "1"))
        await directory._client.revoke(directory._lease_id)  # stands for a lease that ran out
        assert await _etcd_value(etcd, "lapsed") is None
        await directory.publish(_record("lapsed", "2"))
        await asyncio.sleep(2.5)  # past two renewals
        assert messages.decode_published(await _etcd_value(etcd, "lapsed")).host == "h2"
        assert directory._keeper is not None and not directory._keeper.done()
    finally:
        await directory.close()


async def test_a_changed_record_naming_another_engine_in_its_metadata_replaces_no_peer(etcd):
    """A record appears under a followed peer's key whose agent metadata says it is engine Y, one we
    handshook with: following it must not swap Y's agent for that process's (we would read its memory
    as Y's). `connect(engine_id=...)` already refused such a record; the follower now does too."""
    config = _etcd_config(etcd)
    engines = {name: TransferEngine(EngineConfig(engine_id=name, etcd=config if name in "XR" else None))
               for name in "XYIR"}  # fmt: skip
    try:
        for engine in engines.values():
            await engine.start()
            engine.register("kv", _regions(1, 16), block_len=BLOCK)
        published, real, other, reader = (engines[n] for n in "XYIR")
        await published.publish()
        y = await reader.connect(*await real.serve(), expected_engine_id="Y")
        x = await reader.connect(engine_id="X")
        impostor = msgspec.structs.replace(other._metadata(), engine_id="Y")
        record = messages.PublishedEngine(engine_id="X", compat_hash=impostor.compat_hash, metadata=impostor,
                                          fingerprint="changed")  # fmt: skip
        etcd.put(_key("X"), messages.encode(record))
        await _until(lambda: x.stale or reader.peer("Y").agent_name != real.agent_name, 5.0, "record not followed")
        assert reader.peer("Y") is y and y.agent_name == real.agent_name and not y.stale, "Y's agent was swapped"
        assert other.agent_name not in {peer.agent_name for peer in reader.peers}
    finally:
        for engine in engines.values():
            await engine.close()


async def test_a_close_during_a_publish_leaves_no_record_and_no_session(etcd):
    """`close()` while `publish()` waits for etcd (a slow link: 0.3 s each way): the publish ends
    first, then the close revokes the lease it took. Before, the close found no lease yet and
    returned; the publish's grant then took a lease nobody revoked (alive for its 30 s) and its
    retries opened a new HTTP session after the close."""
    leases_before = await _leases(etcd)
    relay = _Blackhole(etcd.endpoint, delay_s=0.3)
    directory = discovery.EtcdDirectory(EtcdConfig(await relay.start(), namespace=NAMESPACE, lease_ttl_s=30),
                                        timeout=5.0)  # fmt: skip
    try:
        publishing = asyncio.ensure_future(directory.publish(_record("closing", "1")))
        await asyncio.sleep(0.2)  # its lease grant is on the way
        await directory.close()
        with contextlib.suppress(Exception):
            await publishing
        assert await _etcd_value(etcd, "closing") is None, "a record outlived the close"
        assert await _leases(etcd) <= leases_before, "a lease outlived the close"
        assert directory._client._session is None, "an HTTP session was opened after the close"
    finally:
        await directory.close()
        await relay.close()


class _Leases(msgspec.Struct):
    leases: list[dict] = []


async def _leases(server: EtcdServer) -> set[str]:
    """The ids of every lease etcd holds."""
    client = EtcdHttp(server.endpoint)
    try:
        found = await client._post("/v3/lease/leases", {}, _Leases)
    finally:
        await client.close()
    return {lease["ID"] for lease in found.leases}


async def test_a_watch_that_cannot_connect_gives_up_at_its_connect_bound():
    """An etcd host that drops our packets (a partition, a dead host): before, the watch's connect was
    bounded only by the kernel's SYN retries (minutes), so changes after etcd came back went unseen that long."""
    from nixl_async._etcd_http import EtcdUnreachable

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []  # a full accept queue: further SYNs are dropped, as by a host that is gone
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    client = EtcdHttp(f"127.0.0.1:{port}")
    started = time.monotonic()
    try:
        with pytest.raises(EtcdUnreachable):
            async with asyncio.timeout(10):
                async for _event in client.watch_prefix(b"nixl_async/", 1, idle_s=30.0, connect_s=0.5):
                    pass
        assert time.monotonic() - started < 3
    finally:
        await client.close()
        for sock in (*fillers, listener):
            sock.close()


async def test_a_server_that_fails_for_good_leaves_etcd_and_can_serve_again(etcd, monkeypatch):
    """The handshake server dies and cannot rebind: the published record stops naming its address (before: readers
    kept dialling a dead address, through every lease renewal), and `serve()` works again (before: "already
    serving on :0", so only a new engine could serve)."""
    import zmq

    engine = await _engine(_etcd_config(etcd), engine_id="fails-for-good")
    try:
        engine.register("kv", _regions(1, 4), block_len=BLOCK)
        await engine.serve("127.0.0.1", 0)
        await engine.publish()
        assert messages.decode_published(await _etcd_value(etcd, engine.engine_id)).port == engine.address[1]
        server = engine._server
        sock = server._socket

        async def broken(*args, **kwargs):
            raise RuntimeError("a bug in replying")

        def no_bind(host, port):
            raise zmq.ZMQError(98, "address in use")

        monkeypatch.setattr(sock, "send_multipart", broken)
        monkeypatch.setattr(server, "_bind", no_bind)
        asker = await _engine(_etcd_config(etcd), engine_id="asker-of-the-dead")
        try:
            with pytest.raises(HandshakeTimeout):
                await asker.connect("127.0.0.1", server.port, timeout=1)
            for _ in range(500):
                record = messages.decode_published(await _etcd_value(etcd, engine.engine_id))
                if record.port == 0:
                    break
                await asyncio.sleep(0.01)
            assert server.failed is not None and engine.address is None and (record.host, record.port) == ("", 0)
            host, port = await engine.serve("127.0.0.1", 0)
            for _ in range(500):
                record = messages.decode_published(await _etcd_value(etcd, engine.engine_id))
                if record.port == port:
                    break
                await asyncio.sleep(0.01)
            assert (record.host, record.port) == (host, port)
            assert (await asker.connect(host, port, timeout=5)).engine_id == engine.engine_id
        finally:
            await asker.close()
    finally:
        await engine.close()


async def test_a_record_looked_up_while_a_handshake_waited_does_not_replace_what_it_answered(etcd, monkeypatch):
    """An audit of session 39: a lookup decided to adopt the record (no peer held) before the per-engine lock; a
    handshake holding that lock (waiting for the peer's previous agent to go) finished, and the record was then
    adopted over it: its notify session and measured clock offset were lost."""
    async with TransferEngine(EngineConfig(engine_id="reader", etcd=_etcd_config(etcd))) as reader, \
               TransferEngine(EngineConfig(engine_id="published", etcd=_etcd_config(etcd))) as published:  # fmt: skip
        address = await published.serve("127.0.0.1", 0)
        await published.publish()
        first = await reader.connect(*address)
        busy = {first.agent_name}
        monkeypatch.setattr(reader._driver, "busy_agents", lambda: busy)  # its agent stays in use a moment
        reader.disconnect(first)  # ...so it is retiring
        handshake = asyncio.ensure_future(reader.connect(*address))  # waits for it, holding the engine's lock
        while not reader._peers._adopting:
            await asyncio.sleep(0.001)
        lookup = asyncio.ensure_future(reader.connect(engine_id="published"))  # no peer held: the record, directly
        await asyncio.sleep(0.3)
        busy.clear()
        handshaken = await handshake
        assert handshaken.notify_session
        found = await lookup
        assert found is handshaken and found.notify_session == handshaken.notify_session
        assert reader.peer("published") is handshaken and handshaken.notify_session
        # (the record may be newer than what the handshake was answered: the next connect handshakes again)
        assert handshaken.stale


async def test_a_handshaken_peer_whose_record_moves_is_handshaken_again_where_it_serves(etcd):
    """An audit of session 39: the follower moved only peers adopted from a record; one we handshook with (its
    notify session issued by the server it left) kept its old address, and notifications to it were lost."""
    config = {"etcd": _etcd_config(etcd), "notify_via": "side_channel"}
    async with TransferEngine(EngineConfig(engine_id="follower", **config)) as reader, \
               TransferEngine(EngineConfig(engine_id="moving", **config)) as moving:  # fmt: skip
        await moving.serve("127.0.0.1", 0)
        await moving.publish()
        peer = await reader.connect(engine_id="moving")
        assert peer.notify_session
        await moving._server.close()
        moving._server.failed = RuntimeError("its loop died and it could not bind again")
        new_address = await moving.serve("127.0.0.1", 0)  # (its record now names the new port)
        for _ in range(500):
            if peer.stale:
                break
            await asyncio.sleep(0.01)
        stale = peer.stale
        again = await reader.connect(engine_id="moving")
        assert again.address == new_address, (stale, again is peer)
        await reader.notify(again, b"here")
        await moving.wait_notifications(b"here", timeout=5)
        # Another name for the same server (its port unchanged) is no move: republished as it was, the record
        # leaves the peer as it is (the review of this fix: each later record made it handshake again).
        named = await reader.connect("localhost", new_address[1])
        assert named is again and named.address == ("localhost", new_address[1]) and not named.stale
        moving._changed()  # (the same record, put again)
        await asyncio.sleep(0.5)
        assert not named.stale


async def test_a_record_change_seen_while_a_lookup_waited_for_the_old_agent_is_not_lost(etcd, monkeypatch):
    """A discovery audit of session 39: a lookup adopting record R1 waited for the peer's previous agent to go;
    the follower saw R2 meanwhile but held no peer, and dropped it; R1 was then loaded, neither stale nor
    refreshed, for good. Now the peer adopted from what preceded a seen change of other metadata is stale."""
    async with TransferEngine(EngineConfig(engine_id="keeps-up", etcd=_etcd_config(etcd))) as reader, \
               TransferEngine(EngineConfig(engine_id="changing-1", etcd=_etcd_config(etcd))) as changing:  # fmt: skip
        changing.register("kv", _regions(1, 16), block_len=BLOCK)
        await changing.publish()
        first = await reader.connect(engine_id="changing-1")
        busy = {first.agent_name}
        real_busy = reader._driver.busy_agents
        monkeypatch.setattr(reader._driver, "busy_agents", lambda: busy | real_busy())
        reader.disconnect(first)  # its agent is retiring
        connecting = asyncio.ensure_future(reader.connect(engine_id="changing-1"))
        await _until(lambda: reader._peers._adopting, 5.0, "the lookup waiting for the old agent")
        before = reader._dialer._order.applied("changing-1")
        changing.register("more", _regions(1, 16), block_len=BLOCK)  # record R2
        await _until(lambda: reader._dialer._order.applied("changing-1") > before, 5.0, "the follower seeing R2")
        busy.clear()
        assert (await connecting).stale
        again = await reader.connect(engine_id="changing-1")
        assert sorted(again.layouts) == ["kv", "more"]


@pytest.mark.parametrize("refresh", [False, True])
async def test_a_record_change_seen_while_a_handshake_was_answered_is_not_lost(etcd, monkeypatch, refresh):
    """The same audit: with side-channel notifications (the vLLM adapter's) a lookup handshakes; the peer answered
    with M1, then changed (R2) while the reply was on its way. The follower dropped R2 (no peer held yet), or
    marked the held peer stale and the handshake's adoption cleared it: M1 stayed, for good."""
    from nixl_async import _dialer

    config = {"etcd": _etcd_config(etcd), "notify_via": "side_channel"}
    async with TransferEngine(EngineConfig(engine_id=f"reader-{refresh}", **config)) as reader, \
               TransferEngine(EngineConfig(engine_id=f"changing-{refresh}", **config)) as changing:  # fmt: skip
        changing.register("kv", _regions(1, 16), block_len=BLOCK)
        await changing.serve("127.0.0.1", 0)
        await changing.publish()
        if refresh:
            await reader.connect(engine_id=changing.engine_id)
        real = _dialer.fetch_metadata
        answered, release = asyncio.Event(), asyncio.Event()

        async def reply_on_its_way(*args, **kwargs):
            reply = await real(*args, **kwargs)
            answered.set()
            await release.wait()  # (a slow link, a busy loop)
            return reply

        monkeypatch.setattr(_dialer, "fetch_metadata", reply_on_its_way)
        connecting = asyncio.ensure_future(reader.connect(engine_id=changing.engine_id, refresh=refresh))
        await answered.wait()
        before = reader._dialer._order.applied(changing.engine_id)
        changing.register("more", _regions(1, 16), block_len=BLOCK)  # record R2
        await _until(lambda: reader._dialer._order.applied(changing.engine_id) > before, 5.0, "the follower seeing R2")
        release.set()
        assert (await connecting).stale
        monkeypatch.undo()
        again = await reader.connect(engine_id=changing.engine_id)
        assert sorted(again.layouts) == ["kv", "more"]


async def test_a_peer_held_by_address_is_followed_once_asked_for_by_engine_id(etcd):
    """The same audit: connect(engine_id=P) returned the peer held from connect(host, port) without following
    its record: a change never marked it stale, and once P left etcd it was still returned (no
    PeerNotPublished)."""
    async with TransferEngine(EngineConfig(engine_id="follows", etcd=_etcd_config(etcd))) as reader:
        held = await TransferEngine(EngineConfig(engine_id="by-address", etcd=_etcd_config(etcd))).start()
        try:
            held.register("kv", _regions(1, 16), block_len=BLOCK)
            address = await held.serve("127.0.0.1", 0)
            await held.publish()
            peer = await reader.connect(*address, expected_engine_id="by-address")
            assert await reader.connect(engine_id="by-address") is peer
            held.register("more", _regions(1, 16), block_len=BLOCK)
            await _until(lambda: peer.stale, 5.0, "the follower marking the held peer stale")
        finally:
            await held.close()
        await _until(lambda: peer.unpublished, 5.0, "the follower seeing its record go")
        with pytest.raises(PeerNotPublished):
            await reader.connect(engine_id="by-address")
