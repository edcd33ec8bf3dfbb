"""Discovery through a real etcd when things happen at once: a lookup racing the watch, a record
that goes and comes back, a put etcd refuses, a caller's own timeout."""

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from nixl_async import DiscoveryUnavailable, EngineConfig, EtcdConfig, PeerNotPublished, TransferEngine, discovery
from nixl_async._etcd_http import EtcdError, EtcdHttp
from nixl_async.discovery import RecordOrder
from nixl_async.testing import Register, verify_blocks
from nixl_async.testing.etcd import EtcdServer, etcd_or_skip

from .test_discovery import BLOCK, NAMESPACE, _etcd_config, _etcd_value, _key, _record, _regions, _until


@pytest.fixture(scope="module")
def etcd():
    with etcd_or_skip() as server:
        yield server


async def _reader(etcd) -> TransferEngine:
    engine = TransferEngine(EngineConfig(etcd=_etcd_config(etcd), handshake_timeout_s=10))
    await engine.start()
    return engine


class _HeldLookups:
    """Holds each lookup's answer until released: the reply still on its way while etcd changes."""

    def __init__(self, engine: TransferEngine) -> None:
        self.directory = engine._dialer.require_directory()
        self._real = self.directory.lookup
        self.answered = asyncio.Event()
        self.release = asyncio.Event()
        self.lookups = 0
        self.directory.lookup = self._lookup  # type: ignore[method-assign]

    async def _lookup(self, engine_id, timeout=None):
        found = await self._real(engine_id, timeout)
        self.lookups += 1
        if self.lookups == 1:
            self.answered.set()
            await self.release.wait()
        return found


async def test_a_lookup_answered_before_the_peer_restarted_does_not_undo_the_watch(etcd, nixl_peer_factory):
    """`connect(refresh=True)` reads the record; the peer restarts (same engine id, a new NIXL agent)
    and the follower adopts its new record; then the lookup's answer arrives. Before, it was applied
    last: the live peer was forgotten and loading the dead agent failed (`HandshakeRejected`)."""
    publisher = nixl_peer_factory(etcd_endpoint=etcd.endpoint, etcd_namespace=NAMESPACE)
    reader = await _reader(etcd)
    try:
        regions = _regions()
        reader.register("kv", regions, block_len=BLOCK)
        old = await reader.connect(engine_id=publisher.engine_id)
        held = _HeldLookups(reader)
        refreshing = asyncio.ensure_future(reader.connect(engine_id=publisher.engine_id, refresh=True))
        await held.answered.wait()
        await publisher.reincarnate(publisher.engine_id)
        await _until(lambda: reader.peer(publisher.engine_id).agent_name != old.agent_name, 10.0,
                     "the follower adopted the restarted peer's record")  # fmt: skip
        live = reader.peer(publisher.engine_id)
        held.release.set()
        got = await refreshing
        assert got is live and live.connected, "the older lookup undid the follower's adoption"
        assert held.lookups == 2, "the lookup older than the applied record was not read again"
        await reader.read(got, [0, 1], [5, 6])
        assert verify_blocks(regions, BLOCK, [0, 1], [5, 6], seed=1) == []
    finally:
        await reader.close()


async def test_a_lookup_answered_before_a_new_registration_does_not_undo_the_watch(etcd, nixl_peer_factory):
    """Same agent, memory registered anew: the follower adopts the record with the new layout, then
    the older lookup's answer arrives. Before, it reloaded the older metadata (the new layout gone,
    the old memory keys back) and nothing corrected it."""
    publisher = nixl_peer_factory(etcd_endpoint=etcd.endpoint, etcd_namespace=NAMESPACE)
    reader = await _reader(etcd)
    try:
        reader.register("kv", _regions(), block_len=BLOCK)
        await reader.connect(engine_id=publisher.engine_id)
        held = _HeldLookups(reader)
        refreshing = asyncio.ensure_future(reader.connect(engine_id=publisher.engine_id, refresh=True))
        await held.answered.wait()
        await publisher.request(Register(layout_name="more", num_regions=1, num_blocks=16, seed=7))
        await _until(lambda: "more" in reader.peer(publisher.engine_id).layouts, 10.0, "the follower saw 'more'")
        held.release.set()
        got = await refreshing
        assert "more" in got.layouts, "the older lookup's metadata replaced the newer"
        assert "more" in reader.peer(publisher.engine_id).layouts
    finally:
        await reader.close()


class _HeldListing:
    """Holds the first full listing's answer until released: read at etcd before the peer changed,
    applied after (the follower's first listing, or one after a broken watch, on a large fleet)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.read, self.release = asyncio.Event(), asyncio.Event()
        real = EtcdHttp.get_prefix

        async def held(client, prefix, *, keys_only=False):
            result = await real(client, prefix, keys_only=keys_only)
            if not keys_only and not self.read.is_set():
                self.read.set()
                await self.release.wait()
            return result

        monkeypatch.setattr(EtcdHttp, "get_prefix", held)


@pytest.mark.parametrize("change", ["restart", "register"])
async def test_a_listing_read_before_a_lookup_does_not_undo_it(etcd, nixl_peer_factory, monkeypatch, change):
    """The listing was read, the peer changed (a restart: a new agent; or memory registered anew), a
    lookup adopted its new record, then the listing's answer came. Before, the listing reset the order
    and its older record was applied: the live peer was forgotten (its transfers ended), or, its dead
    agent refused, marked stale, so the next connect forgot it."""
    publisher = nixl_peer_factory(etcd_endpoint=etcd.endpoint, etcd_namespace=NAMESPACE)
    held = _HeldListing(monkeypatch)
    reader = await _reader(etcd)
    try:
        regions = _regions()
        reader.register("kv", regions, block_len=BLOCK)
        old = await reader.connect(engine_id=publisher.engine_id)
        await held.read.wait()
        if change == "restart":
            await publisher.reincarnate(publisher.engine_id)
        else:
            await publisher.request(Register(layout_name="more", num_regions=1, num_blocks=16, seed=7))
        await asyncio.sleep(0.5)  # (the publisher puts its new record)
        new = await reader.connect(engine_id=publisher.engine_id, refresh=True)
        assert new.agent_name != old.agent_name if change == "restart" else "more" in new.layouts
        held.release.set()
        await asyncio.sleep(1.0)  # the listing is applied, and the watch follows it
        assert new.connected and not new.stale, "the older listing undid the lookup"
        assert await reader.connect(engine_id=publisher.engine_id) is new
        await reader.read(new, [0, 1], [5, 6], remote="kv")
        assert verify_blocks(regions, BLOCK, [0, 1], [5, 6], seed=1) == []
    finally:
        await reader.close()


async def test_a_lookup_answered_before_the_record_went_is_not_published(etcd, nixl_peer_factory):
    """The record is read, then the peer closes (its record goes, the follower marks the peer), then
    the lookup's answer arrives. Before, it was adopted: loading the closed peer's agent failed with
    `HandshakeRejected`; it is now read again and says what is so."""
    publisher = nixl_peer_factory(etcd_endpoint=etcd.endpoint, etcd_namespace=NAMESPACE)
    reader = await _reader(etcd)
    try:
        reader.register("kv", _regions(), block_len=BLOCK)
        peer = await reader.connect(engine_id=publisher.engine_id)
        held = _HeldLookups(reader)
        refreshing = asyncio.ensure_future(reader.connect(engine_id=publisher.engine_id, refresh=True))
        await held.answered.wait()
        await publisher.astop()
        await _until(lambda: peer.unpublished, 5.0, "the follower saw the record go")
        held.release.set()
        with pytest.raises(PeerNotPublished):
            await refreshing
    finally:
        await reader.close()


async def test_a_record_that_comes_back_as_it_was_is_published_again(etcd, nixl_peer_factory):
    """The publisher's lease goes (a partition, etcd wiped) and it puts the same record back. Before,
    the peer stayed marked for good: every next connect looked it up and reloaded it."""
    publisher = nixl_peer_factory(etcd_endpoint=etcd.endpoint, etcd_namespace=NAMESPACE, etcd_lease_ttl_s=2)
    reader = await _reader(etcd)
    try:
        reader.register("kv", _regions(), block_len=BLOCK)
        peer = await reader.connect(engine_id=publisher.engine_id)
        directory = reader._dialer.require_directory()
        found, _ = await directory._client.get(_key(publisher.engine_id))
        assert found is not None
        await directory._client.revoke(found.lease)
        await _until(lambda: peer.unpublished, 5.0, "the follower saw the record go")
        await _until(lambda: _etcd_value(etcd, publisher.engine_id), 5.0, "the publisher put its record back")
        await _until(lambda: not peer.unpublished, 5.0, "the record came back as it was: the peer is published")
        via_etcd = reader.snapshot().counters["handshakes_via_etcd"]
        assert await reader.connect(engine_id=publisher.engine_id) is peer
        assert reader.snapshot().counters["handshakes_via_etcd"] == via_etcd, "looked up again"
    finally:
        await reader.close()


@contextlib.asynccontextmanager
async def _record_grown_too_big(lease_ttl_s: int) -> AsyncIterator[tuple[EtcdServer, discovery.EtcdDirectory]]:
    """An etcd refusing requests over 4 KiB, and a directory that published a small record, then one too big."""
    with etcd_or_skip(options=["--max-request-bytes=4096"]) as small:
        directory = discovery.EtcdDirectory(EtcdConfig(small.endpoint, namespace=NAMESPACE, lease_ttl_s=lease_ttl_s),
                                            timeout=2.0)  # fmt: skip
        try:
            await directory.publish(_record("big", "1"))
            directory.republish(_record("big", "2" * 8000))
            yield small, directory
        finally:
            await directory.close()


async def test_a_put_etcd_keeps_refusing_does_not_stop_the_lease_renewals():
    """A new record over etcd's request size limit: its put fails every time. Before, each retry came
    before the renewal, so the lease ran out and the live engine's record left etcd."""
    async with _record_grown_too_big(lease_ttl_s=2) as (small, directory):
        for _ in range(8):  # two lease TTLs
            await asyncio.sleep(0.5)
            assert await _etcd_value(small, "big") is not None, "a live engine's record left etcd"
        assert directory._keeper is not None and not directory._keeper.done()


async def test_a_lost_lease_and_a_refused_put_are_retried_every_second_not_spun_on(monkeypatch):
    """The lease is gone and etcd refuses the record (over its size limit): the keeper tries again every
    second. A review found the renewal's "put again now" overriding the failed put's retry time: tens of
    thousands of puts a second."""
    calls = []
    real_put = EtcdHttp.put

    async def counted_put(self, key, value, lease):
        calls.append(lease)
        return await real_put(self, key, value, lease)

    monkeypatch.setattr(EtcdHttp, "put", counted_put)
    async with _record_grown_too_big(lease_ttl_s=3) as (_, directory):
        await directory._client.revoke(directory._lease_id)  # the lease lapses meanwhile
        calls.clear()
        await asyncio.sleep(3.0)
        assert 1 <= len(calls) <= 8, f"{len(calls)} puts in 3 s"


async def test_a_callers_timeout_longer_than_the_handshake_timeout_is_kept_for_etcd():
    """`connect(engine_id=..., timeout=3)` with a 1 s handshake timeout: etcd may take the 3 s
    (before, the lookup gave up after 1 s)."""
    with socket.socket() as silent:  # accepts connections (backlog) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        engine = TransferEngine(EngineConfig(etcd=EtcdConfig(f"127.0.0.1:{silent.getsockname()[1]}"),
                                             handshake_timeout_s=1.0))  # fmt: skip
        await engine.start()
        try:
            started = time.monotonic()
            with pytest.raises(DiscoveryUnavailable, match="did not answer"):
                await engine.connect(engine_id="anyone", timeout=3.0)
            assert 2.9 < time.monotonic() - started < 5.0
        finally:
            await engine.close()


def test_record_order_refuses_an_older_read_unless_etcd_went_back():
    order = RecordOrder()
    assert order.claim("a", 5)
    assert not order.claim("a", 4), "an older read applied over a newer one"
    assert order.claim("a", 4, behind=5), "read twice older than the same revision: etcd was wiped"
    assert order.applied("a") == 4
    assert order.relisted(100, {"b": 40}, asked_at=time.monotonic()) == set()
    assert order.applied("b") == 40 and order.applied("a") == 100  # absent from the listing: gone as of it
    assert order.claim("b", 41) and not order.claim("a", 99) and order.claim("a", 100)
    assert np.array_equal([order.applied(i) for i in "ab"], [100, 41])
    asked_at = time.monotonic()  # a listing asked for now is read at revision 150...
    assert order.claim("c", 160)  # ...and a lookup read later applies first
    assert order.claim("b", 45)  # (an older claim made meanwhile: the listing's is newer)
    assert order.relisted(150, {"b": 120, "c": 140}, asked_at) == {"c"}
    assert [order.applied(i) for i in "abc"] == [150, 120, 160]
    assert order.relisted(170, {"c": 140}, time.monotonic()) == set()  # the next listing starts over
    assert order.applied("c") == 140


async def test_etcd_answering_unavailable_is_retried_within_the_timeout(etcd, nixl_peer_factory, monkeypatch):
    """A cluster electing a leader answers UNAVAILABLE (gRPC 14, "leader changed") for a moment. Before,
    the first such answer was `DiscoveryUnavailable`; it is tried again as an unreachable etcd is. Other
    errors still fail at once."""
    publisher = nixl_peer_factory(etcd_endpoint=etcd.endpoint, etcd_namespace=NAMESPACE)
    reader = await _reader(etcd)
    real_post, refusals = EtcdHttp._post, []

    async def post(self, path, body, answer):
        if path == "/v3/kv/range" and len(refusals) < 3:
            refusals.append(path)
            raise EtcdError(14, "etcdserver: leader changed")
        return await real_post(self, path, body, answer)

    monkeypatch.setattr(EtcdHttp, "_post", post)
    try:
        peer = await reader.connect(engine_id=publisher.engine_id)
        assert peer.engine_id == publisher.engine_id and len(refusals) == 3
        monkeypatch.setattr(EtcdHttp, "_post", lambda *_: _raise(EtcdError(3, "etcdserver: request is too large")))
        started = time.monotonic()
        with pytest.raises(DiscoveryUnavailable, match="too large"):
            await reader.connect(engine_id="someone-else")
        assert time.monotonic() - started < 0.5
    finally:
        monkeypatch.setattr(EtcdHttp, "_post", real_post)
        await reader.close()


async def _raise(error: Exception):
    raise error
