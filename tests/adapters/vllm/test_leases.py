"""Lease renewal between real engines: the reader learns only what producers acknowledged.

Producer ranks are engines answering the adapter's renewal calls from a `SendBook`; the reader
runs `heartbeat` as the worker does. (The whole path in vLLM: `test_pd_end_to_end`.)
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from nixl_async import EngineConfig, LeaseExpired, Transfer, TransferEngine
from nixl_async.testing import TCP_TLS, pattern_block, until_in_flight
from nixl_async_vllm.leases import GONE, LEASE_TOPIC, LearnedLeases, RequestLease, answer_renewal, heartbeat
from nixl_async_vllm.send_book import SendBook
from nixl_async_vllm.worker import _start_leased_read

EXTENSION_S = 2.0


async def _producer(rank: int, book: SendBook) -> TransferEngine:
    engine = await TransferEngine(EngineConfig(engine_id=f"prefill/tp{rank}")).start()
    engine.handle_calls(LEASE_TOPIC, lambda _sender, payload: answer_renewal(book, payload, EXTENSION_S))
    await engine.serve("127.0.0.1", 0)
    return engine


@pytest.fixture
async def cluster():
    books = [SendBook(), SendBook()]
    producers = [await _producer(rank, book) for rank, book in enumerate(books)]
    reader = await TransferEngine(EngineConfig(engine_id="decode/tp0", handshake_timeout_s=1.0)).start()
    addresses = [(*p.address, p.engine_id) for p in producers]
    try:
        yield books, producers, reader, addresses
    finally:
        for engine in (reader, *producers):
            if engine.running:
                await engine.close()


async def test_a_renewal_extends_held_leases_and_reports_released_ones_gone(cluster):
    books, _producers, reader, addresses = cluster
    now = time.perf_counter()
    for book in books:
        book.hold("waiting", now + 0.2)
        book.hold("read", now + 0.2)
        book.notified(b"read:1")
        assert book.collect(now) == ({"read"}, set())  # its reader finished: blocks freed
    leases = LearnedLeases()
    announced = time.time() + 0.2  # what prefill's kv_transfer_params said
    await heartbeat(reader, leases, "prefill", addresses, ["waiting", "read", "never-held"])
    extended = leases.expiry("prefill", "waiting", announced)
    assert extended is not None and abs(extended - (time.time() + EXTENSION_S)) < 0.5
    assert leases.expiry("prefill", "read", announced) == GONE, "a freed request must not be read"
    assert leases.expiry("prefill", "never-held", announced) == GONE
    assert leases.expiry("prefill", "not-asked", announced) == announced
    # ...and the producers really hold it longer: past the original deadline nothing expires.
    assert all(book.collect(now + 1.0) == (set(), set()) for book in books)
    assert all(book.collect(now + EXTENSION_S + 0.5) == (set(), {"waiting"}) for book in books)


async def test_a_request_only_one_rank_still_holds_counts_as_gone(cluster):
    books, _producers, reader, addresses = cluster
    books[0].hold("r", time.perf_counter() + 5)
    leases = LearnedLeases()
    await heartbeat(reader, leases, "prefill", addresses, ["r"])
    assert leases.expiry("prefill", "r", time.time() + 5) == GONE


async def test_a_failed_round_learns_nothing_and_keeps_the_last_acknowledged_lease(cluster):
    books, producers, reader, addresses = cluster
    for book in books:
        book.hold("r", time.perf_counter() + 0.5)
    leases = LearnedLeases()
    await heartbeat(reader, leases, "prefill", addresses, ["r"])
    acknowledged = leases.expiry("prefill", "r", None)
    await producers[1].close()
    failures = []
    started = time.monotonic()
    await heartbeat(reader, leases, "prefill", addresses, ["r"], on_failure=failures.append)
    assert time.monotonic() - started < reader.config.handshake_timeout_s + 1
    assert len(failures) == 1 and leases.expiry("prefill", "r", None) == acknowledged


def test_learned_leases_only_grow_until_gone_and_forget_what_is_no_longer_asked():
    leases = LearnedLeases()
    leases.learn("p", ["a", "b"], {"p/tp0": {"a": 100.0, "b": 100.0}})
    leases.learn("p", ["a", "b"], {"p/tp0": {"a": 90.0, "b": 100.0}})  # an older round answering late
    assert leases.expiry("p", "a", None) == 100.0
    leases.learn("p", ["a", "b"], {"p/tp0": {"a": 120.0}})  # b released
    leases.learn("p", ["a", "b"], {"p/tp0": {"a": 130.0, "b": 140.0}})  # a slow reply from before the release
    assert leases.expiry("p", "b", 50.0) == GONE and leases.expiry("p", "a", 50.0) == 130.0
    leases.learn("p", ["b"], {"p/tp0": {}})
    assert leases.expiry("p", "a", 50.0) == 50.0, "a is no longer heartbeated: read or aborted, forgotten"
    leases.forget("p", "b")
    assert len(leases) == 0


def test_a_round_asked_before_its_request_ended_does_not_bring_it_back():
    """The read ended (forgotten) while a renewal round naming it was out; the round's replies came after.
    Before, they added it again, and it stayed for as long as nothing renewed that producer again (a
    restarted prefill has a new engine id: for good)."""
    leases = LearnedLeases()
    leases.learn("p", ["a"], {"p/tp0": {"a": 100.0}})
    leases.forget("p", "a")
    leases.learn("p", ["a"], {"p/tp0": {"a": 130.0}})
    assert len(leases) == 0 and leases.expiry("p", "a", 50.0) == 50.0
    for i in range(LearnedLeases.FORGOTTEN_KEPT + 10):  # what it remembers of them is bounded
        leases.forget("q", str(i))
    assert len(leases._forgotten) == LearnedLeases.FORGOTTEN_KEPT


async def test_a_long_queue_is_renewed_in_several_calls(cluster):
    """Thousands of waiting requests exceed one call's size limit: every one of them is still renewed."""
    books, _producers, reader, addresses = cluster
    ids = [f"cmpl-{i:08x}-0-{i:08x}" for i in range(3000)]  # ~90 KiB of ids: over the 64 KiB request limit
    for book in books:
        for request_id in ids:
            book.hold(request_id, time.perf_counter() + 0.5)
    leases = LearnedLeases()
    failures = []
    await heartbeat(reader, leases, "prefill", addresses, ids, on_failure=failures.append)
    assert failures == []
    assert all(leases.expiry("prefill", request_id, None) > time.time() + 1 for request_id in ids)


async def test_a_renewal_call_too_large_for_the_producer_is_a_failed_round_not_an_escape(cluster):
    """The producer's side channel takes less than one call of ids (its max_request_bytes): `CallTooLarge`,
    unsent. Before session 40 it escaped the round (logged as a failed background task, `on_failure` never told)."""
    books, _producers, reader, _addresses = cluster
    small = await TransferEngine(EngineConfig(engine_id="prefill/tp2", max_request_bytes=2048)).start()
    small.handle_calls(LEASE_TOPIC, lambda _sender, payload: answer_renewal(books[0], payload, EXTENSION_S))
    await small.serve("127.0.0.1", 0)
    try:
        ids = [f"cmpl-{i:08x}-0-{i:08x}" for i in range(200)]  # ~6 KiB in one call
        failures: list[BaseException] = []
        await heartbeat(reader, LearnedLeases(), "prefill", [(*small.address, small.engine_id)], ids,
                        on_failure=failures.append)  # fmt: skip
        assert len(failures) == 1 and "max_request_bytes" in str(failures[0])
    finally:
        await small.close()


BLOCK = 1 << 20
BLOCKS = 32


def _held(books: list[SendBook], seconds: float) -> tuple[LearnedLeases, RequestLease]:
    """Every producer rank holds request "r" for `seconds`, as announced to the reader, who starts reading it."""
    for book in books:
        book.hold("r", time.perf_counter() + seconds)
    leases = LearnedLeases()
    return leases, leases.reading("prefill", "r", time.time() + seconds, margin_s=0.1)


@pytest.fixture
async def read_in_flight(monkeypatch, nixl_peer_factory):
    """Make `(reader over UCX/TCP, its regions, peer process, start)`; `start(lease)` starts a read of every
    block into a `RequestLease`'s reads, as the worker's `receive` does, and stops the peer (SIGSTOP)
    once it is in flight, so it stays so."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, seed=3, tcp=True)
    reader = await TransferEngine(EngineConfig(engine_id="decode-tcp/tp0", handshake_timeout_s=1.0)).start()
    regions = [np.zeros(BLOCKS * BLOCK, np.uint8)]
    reader.register("kv", regions, block_len=BLOCK)
    peer = await reader.connect(*proc.address)

    async def start(lease: RequestLease) -> Transfer:
        ids = list(range(BLOCKS))
        transfer = await reader.start_read(peer, ids, ids, lease_expires_at=lease.read_by)
        lease.reads.append(transfer)
        await until_in_flight(transfer)
        proc.pause()
        return transfer

    try:
        yield reader, regions, proc, start
    finally:
        proc.resume()
        await reader.close()


async def test_a_renewal_keeps_the_read_in_flight_going_past_the_first_lease(cluster, read_in_flight):
    """vLLM's connector renews until the read ends. Before, a read took the lease it started with and
    failed past it, however often the producer renewed (a KV load longer than ~2/3 of a lease)."""
    books, _producers, _reader, addresses = cluster
    reader, regions, proc, start = read_in_flight
    leases, lease = _held(books, 0.4)
    transfer = await start(lease)
    await heartbeat(reader, leases, "prefill", addresses, ["r"])
    assert lease.expires_at is not None and lease.expires_at > time.time() + 1
    await asyncio.sleep(0.6)  # past the announced lease, the peer still stopped
    proc.resume()
    assert (await transfer).nbytes == BLOCKS * BLOCK
    assert np.array_equal(regions[0][-BLOCK:], pattern_block(3, 0, BLOCKS - 1, BLOCK))


async def test_a_producer_that_let_the_blocks_go_ends_the_read_in_flight(cluster, read_in_flight):
    _books, _producers, _reader, addresses = cluster  # (the books hold nothing: every request is gone)
    reader, regions, proc, start = read_in_flight
    leases = LearnedLeases()
    lease = leases.reading("prefill", "r", time.time() + 30, margin_s=0.1)
    transfer = await start(lease)
    await heartbeat(reader, leases, "prefill", addresses, ["r"])
    assert lease.expires_at == GONE
    proc.resume()
    with pytest.raises(LeaseExpired):
        await transfer
    snapshot = regions[0].copy()
    await asyncio.sleep(0.3)
    assert np.array_equal(snapshot, regions[0]), "bytes landed after the read was reported ended"


def test_a_request_read_again_after_it_was_forgotten_takes_renewals_again():
    leases = LearnedLeases()
    leases.learn("p", ["a"], {"p/tp0": {"a": 100.0}})
    leases.forget("p", "a")  # its read ended
    lease = leases.reading("p", "a", 50.0, margin_s=1.0)  # ...and it is read again
    assert [moved.expires_at for moved in leases.learn("p", ["a"], {"p/tp0": {"a": 130.0}})] == [130.0]
    assert lease.expires_at == 130.0


@pytest.fixture
async def room_full(monkeypatch, nixl_peer_factory):
    """(reader over UCX/TCP allowed one transfer in flight, its regions, peer, peer process, holding): the room is
    taken by `holding`, a read of every block with the peer stopped (SIGSTOP); `proc.resume()` frees it."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, seed=3, tcp=True)
    config = EngineConfig(engine_id="decode-full/tp0", handshake_timeout_s=1.0, max_inflight_transfers=1)
    async with TransferEngine(config) as reader:
        regions = [np.zeros(BLOCKS * BLOCK, np.uint8)]
        reader.register("kv", regions, block_len=BLOCK)
        peer = await reader.connect(*proc.address)
        ids = list(range(BLOCKS))
        holding = await reader.start_read(peer, ids, ids)
        await until_in_flight(holding)
        proc.pause()
        try:
            yield reader, regions, peer, proc, holding
        finally:
            proc.resume()
            await holding.wait_quiet(10)


async def test_a_renewal_reaches_a_read_still_waiting_for_room(cluster, room_full):
    """A read queued behind the admission limits has no transfer yet for a renewal to move. Before, it
    failed as `LeaseExpired` at the lease it was submitted with, though the producer held the blocks on."""
    books, _producers, _reader, addresses = cluster
    reader, regions, peer, proc, holding = room_full
    leases, lease = _held(books, 0.4)
    waiting = asyncio.create_task(_start_leased_read(reader, lease, peer, [0], [0]))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    await heartbeat(reader, leases, "prefill", addresses, ["r"])  # renewed while it waits
    await asyncio.sleep(0.5)  # past the lease it was submitted with
    proc.resume()
    await holding
    await (await waiting)
    assert np.array_equal(regions[0][:BLOCK], pattern_block(3, 0, 0, BLOCK))


@pytest.mark.parametrize("done_by", ["told", "its read landed"])
async def test_a_rank_the_reader_is_done_with_answering_gone_ends_no_other_ranks_read(cluster, read_in_flight, done_by):
    """Decode reads one prefill rank and is done with the other (told it, or read its share with the notice
    on): that rank frees the request and answers renewals without it. Before, the round counted as "gone"
    for the whole request and ended the read still running on the first rank (`LeaseExpired`), whose
    blocks vLLM keeps until every rank has sent them."""
    books, _producers, _reader, addresses = cluster
    reader, _regions, proc, start = read_in_flight
    books[0].hold("r", time.perf_counter() + 0.4)  # rank 0's read is in flight; rank 1 freed it already
    leases = LearnedLeases()
    lease = leases.reading("prefill", "r", time.time() + 0.4, margin_s=0.1)
    rank1 = addresses[1][2]
    if done_by == "told":
        lease.told.add(rank1)
    else:
        landed = await reader.start_read(reader.peer(proc.engine_id), [0], [0])
        await landed
        lease.notice_reads[rank1] = landed
    transfer = await start(lease)
    await heartbeat(reader, leases, "prefill", addresses, ["r"])
    assert lease.expires_at is not None and lease.expires_at > time.time() + 1, "rank 0's renewal was not learned"
    await asyncio.sleep(0.6)  # past the announced lease, the peer still stopped
    proc.resume()
    assert (await transfer).nbytes == BLOCKS * BLOCK
    books[0].drop("r")
    await heartbeat(reader, leases, "prefill", addresses, ["r"])  # every rank it needs gone: gone
    assert lease.expires_at == GONE


async def test_a_read_renewed_while_it_waited_for_room_keeps_the_renewed_lease(cluster, room_full):
    """Room came before the old lease ran out: the read was posted with the lease it was submitted with, and
    ended at it (`LeaseExpired`) unless another renewal round came first, though the producer held the blocks."""
    books, _producers, _reader, addresses = cluster
    reader, _regions, peer, proc, holding = room_full
    leases, lease = _held(books, 0.8)
    ids = list(range(BLOCKS))
    waiting = asyncio.create_task(_start_leased_read(reader, lease, peer, ids, ids))
    await asyncio.sleep(0.05)
    await heartbeat(reader, leases, "prefill", addresses, ["r"])  # renewed while it waits
    proc.resume()  # the room frees long before the old lease
    await holding
    transfer = await waiting
    await until_in_flight(transfer)
    proc.pause()
    await asyncio.sleep(0.9)  # past the lease it was submitted with, no renewal round since
    proc.resume()
    assert (await transfer).nbytes == BLOCKS * BLOCK
