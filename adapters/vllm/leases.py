"""Lease renewal: a reader whose request waits in its queue keeps the producer's blocks held.

vLLM's scheduler on the reader lists, every ``kv_lease_duration / 6`` seconds, the producer
requests it still has to read (``heartbeat_by_engine``). NixlConnector sends them as a NIXL
notification and assumes the producer extended their leases. We make it a call over the
engine's authenticated side channel instead, and the producer answers until when it now
holds each request (its wall clock), or leaves the request out when it no longer holds it.
So the reader reads only within a lease the producer acknowledged, and learns at once when
blocks are gone (the read is refused as `LeaseExpired` instead of reading reused blocks).

Producer: `answer_renewal` (runs on the engine's loop, as the topic's call handler).
Reader: `heartbeat` (a coroutine on the engine's loop) records replies in `LearnedLeases`,
which `expiry` consults when a read starts; a request being read has a `RequestLease`, which a
renewal moves along with the deadlines of its reads in flight (as vLLM's connector, which keeps
renewing until the read ends: a read longer than the first lease is not failed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

import msgspec

from nixl_async import CallTooLarge, HandshakeError, Transfer, TransferEngine, messages

from .send_book import SendBook
from .settings import connect_rank

__all__ = ["LEASE_TOPIC", "LearnedLeases", "RequestLease", "answer_renewal", "heartbeat"]

log = logging.getLogger(f"vllm.{__name__}")

LEASE_TOPIC = "kv_lease"
GONE = 0.0  # the producer no longer holds the request's blocks
IDS_PER_CALL = 512  # a call stays far below the side channel's request size limit (64 KiB by default)
_ids = messages.decoder(list[str])  # (every bad input a DecodeError: msgspec's own raise some as they are)
_expiries = messages.decoder(dict[str, float])
_encode = msgspec.msgpack.Encoder().encode


def answer_renewal(book: SendBook, payload: bytes, extension_s: float) -> bytes:
    """Extend the leases named in `payload` to now + `extension_s`; reply {request: wall-clock expiry}.

    Raises `msgspec.DecodeError` (a `ValueError`: the call is refused) for a malformed payload.
    """
    request_ids = _ids(payload)
    now, wall = time.perf_counter(), time.time()  # sampled together: the reply converts between them
    held = book.renew(request_ids, now + extension_s)
    return _encode({request_id: wall + (deadline - now) for request_id, deadline in held.items()})


@dataclasses.dataclass(eq=False)
class RequestLease:
    """One request being read: until when its producer holds the blocks (its wall clock, the latest
    word), and the reads in flight on them, which a renewal reaches (`TransferEngine.renew_lease`).

    A producer rank (engine id) this reader is done with (`done_with`: told its blocks are free, or
    its read carrying that notice ended: the engine sends the notice before the read is reported)
    may free them and answer a renewal "gone", which says nothing of the blocks of the ranks still
    being read (vLLM frees a request's blocks only once every rank sent them).
    """

    expires_at: float | None
    margin_s: float  # a read must be done this long before the producer's lease ends
    reads: list[Transfer] = dataclasses.field(default_factory=list)
    told: set[str] = dataclasses.field(default_factory=set)  # ranks notified on their own
    notice_reads: dict[str, Transfer] = dataclasses.field(default_factory=dict)  # rank -> its read carrying it

    def done_with(self, rank: str) -> bool:
        read = self.notice_reads.get(rank)
        return rank in self.told or (read is not None and read.done())

    @property
    def read_by(self) -> float | None:
        """The `lease_expires_at` a read gets: the lease less the margin."""
        return None if self.expires_at is None else self.expires_at - self.margin_s


class LearnedLeases:
    """Reader side: the latest expiry each producer acknowledged, per (engine, request). Loop thread only."""

    FORGOTTEN_KEPT = 4096  # requests forgotten lately: a round asked before they ended must not bring them back

    def __init__(self) -> None:
        self._expiry: dict[tuple[str, str], float] = {}
        self._forgotten: dict[tuple[str, str], None] = {}  # insertion-ordered, the oldest dropped first
        self._reading: dict[tuple[str, str], RequestLease] = {}

    def reading(self, engine_id: str, request_id: str, announced: float | None, margin_s: float) -> RequestLease:
        """A read of the request starts: its lease as known now, kept up to date until `forget`."""
        lease = RequestLease(self.expiry(engine_id, request_id, announced), margin_s)
        self._reading[(engine_id, request_id)] = lease
        self._forgotten.pop((engine_id, request_id), None)  # (read again: renewals of it count again)
        return lease

    def learn(self, engine_id: str, request_ids: list[str], replies: dict[str, dict[str, float]]) -> list[RequestLease]:
        """Record one heartbeat round: every producer rank's reply, by rank engine id (a request is held
        until the earliest of the ranks it still needs: not those its reader is done with).

        Returns the leases of requests being read that moved: their reads in flight are to follow.
        """
        moved = []
        for request_id in request_ids:
            key = (engine_id, request_id)
            if key in self._forgotten:
                continue  # it ended while the round was out (kept, it would stay until that engine's next round)
            reading = self._reading.get(key)
            needed = [reply for rank, reply in replies.items() if reading is None or not reading.done_with(rank)]
            if not needed:
                continue  # done with every rank: its reads have all landed
            acknowledged = min(reply.get(request_id, GONE) for reply in needed)
            known = self._expiry.get(key)
            if known == GONE:
                continue  # released is final; a slower, older reply cannot bring it back
            self._expiry[key] = GONE if acknowledged == GONE else max(acknowledged, known or GONE)
            if (lease := self._reading.get(key)) is not None:
                expires_at = self.expiry(engine_id, request_id, lease.expires_at)
                if expires_at != lease.expires_at:
                    lease.expires_at = expires_at
                    moved.append(lease)
        asked = set(request_ids)
        for key in [k for k in self._expiry if k[0] == engine_id and k[1] not in asked]:
            del self._expiry[key]  # no longer heartbeated: read, or aborted
        return moved

    def expiry(self, engine_id: str, request_id: str, announced: float | None) -> float | None:
        """When the producer's blocks expire: the latest word, the announced lease if none came."""
        learned = self._expiry.get((engine_id, request_id))
        if learned is None:
            return announced
        if learned == GONE or announced is None:
            return learned
        return max(learned, announced)

    def forget(self, engine_id: str, request_id: str) -> None:
        key = (engine_id, request_id)
        self._expiry.pop(key, None)
        self._reading.pop(key, None)
        self._forgotten[key] = None
        if len(self._forgotten) > self.FORGOTTEN_KEPT:
            del self._forgotten[next(iter(self._forgotten))]

    def __len__(self) -> int:
        return len(self._expiry)


async def heartbeat(
    engine: TransferEngine,
    leases: LearnedLeases,
    engine_id: str,
    addresses: list[tuple[str, int, str]],
    request_ids: list[str],
    *,
    on_failure: Callable[[BaseException], None] | None = None,
) -> None:
    """Renew `request_ids` at every producer rank in `addresses` (host, port, rank engine id).

    A round counts only if every rank answered; otherwise nothing is learned (the reader keeps
    the last acknowledged expiry, which is safe) and `on_failure` hears why. Long queues go in
    several calls of at most `IDS_PER_CALL` ids. Reads in flight follow their request's new lease
    (a producer that answers it no longer holds a request ends them: `LeaseExpired`).
    """
    chunks = [request_ids[i : i + IDS_PER_CALL] for i in range(0, len(request_ids), IDS_PER_CALL)]

    async def renew(host: str, port: int, rank_engine_id: str) -> dict[str, float]:
        peer = await connect_rank(engine, host, port, rank_engine_id)
        reply: dict[str, float] = {}
        for chunk in chunks:
            reply.update(_expiries(await engine.call(peer, LEASE_TOPIC, _encode(chunk))))
        return reply

    try:
        async with asyncio.TaskGroup() as group:  # one failing rank cancels the others' calls
            tasks = [group.create_task(renew(*address)) for address in addresses]
    except* (HandshakeError, CallTooLarge, msgspec.DecodeError) as failures:
        error: BaseException = failures.exceptions[0]
        log.debug("lease renewal with %s failed: %s", engine_id, error)
        if on_failure is not None:
            on_failure(error)
        tasks = []
    if tasks:
        replies = {address[2]: task.result() for address, task in zip(addresses, tasks, strict=True)}
        for lease in leases.learn(engine_id, request_ids, replies):
            if lease.reads and (read_by := lease.read_by) is not None:
                engine.renew_lease(lease.reads, read_by)
