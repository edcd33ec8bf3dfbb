"""Push mode, decode's side: register a request's blocks with prefill, wait for the WRITEs, or withdraw.

Decode plans from prefill's layout as in pull mode, and registers with each prefill rank it needs
(an acknowledged call carrying the plan's views and decode's block ids). Each writing rank then
notifies decode after its WRITEs' data (NIXL delivers the notification after the data). A
registration carries ``write_by`` (decode's wall clock): prefill starts no WRITE after it and
cancels one still running then, so decode hands the blocks back to vLLM only once no WRITE can
land in them any more: ``write_by`` plus a margin, unless every writing rank said sooner that
it holds none of its WRITEs (a failed push, `PushFailed`): then at once if each also said that
every WRITE it posted ended DONE (NIXL's UCX backend reports a WRITE done once decode's side
acknowledged its bytes), else after `WRITE_MARGIN_S` for bytes a WRITE stopped by an error had
already sent.

Decode may give up first: vLLM finished the request while it waited (its client went away). vLLM
keeps its blocks until this worker reports it, so decode withdraws the request from every prefill
rank whose push has not arrived (`PUSH_WITHDRAW_TOPIC`, registered or not); each answers whether
it wrote nothing (its registration waited, or was superseded), stopped a push (decode then hears
of it, pushed or failed, once NIXL let go of it), or holds nothing (a push that already ended may
have written). The blocks go back once no rank can write; a rank asked to write that does not
answer (a prefill of an earlier version, a dead one) keeps them held until the deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine, Mapping
from typing import Any

import msgspec

from nixl_async import (
    CallTooLarge,
    EngineIdMismatch,
    HandshakeError,
    Peer,
    TransferCancelled,
    TransferEngine,
    TransferFailed,
)

from .push_book import (
    NOT_HELD,
    PUSH_TOPIC,
    PUSH_WITHDRAW_TOPIC,
    STOPPING,
    WITHDRAWN,
    PushRegistration,
    encode_registration,
    push_failure_notification,
    push_notification,
)
from .push_plan import make_registration, registrations_for
from .settings import WRITE_MARGIN_S, rank_engine_id
from .tp_mapping import remote_ranks
from .worker import KVGeometry, RecvJob, connect_job_rank

__all__ = ["WRITE_MARGIN_S", "PushFailed", "PushWithdrawn", "receive_pushed"]

log = logging.getLogger(f"vllm.{__name__}")

_GONE_BEFORE = b"gone"  # what a prefill of an earlier version answered for a request it had freed


class PushFailed(TransferFailed):
    """A prefill rank said its push failed, with none of its WRITEs left in NIXL: nothing more comes from it.

    `landed`: it said too that every WRITE it posted ended DONE, so none of their bytes can land
    later (else bytes a WRITE stopped by an error had sent may, for `WRITE_MARGIN_S`).
    """

    def __init__(self, message: str, *, peer: str | None = None, landed: bool = False) -> None:
        super().__init__(message, peer=peer)
        self.landed = landed


class PushWithdrawn(TransferCancelled):
    """Decode gave up on the request before its push arrived; raised once no prefill rank can write
    into its blocks any more."""


class _NotRegistered(Exception):
    """A registration call failed (`error`): raised to `receive_pushed`, which withdraws the request."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _Withdrawal(Exception):
    """(Internal) the withdrawal event fired before the request's pushes arrived."""


class _Exposure:
    """Until when (decode's wall clock) a prefill WRITE may still land in the request's blocks."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.until = 0.0

    def may_write(self) -> None:
        """A registration to write may have reached prefill: only the deadline bounds its WRITEs."""
        self.until = self.deadline

    def settled(self, bytes_may_land: bool) -> None:
        """No rank can start or continue a WRITE; bytes one had sent may still land for the margin."""
        self.until = min(self.deadline, time.time() + WRITE_MARGIN_S) if bytes_may_land else 0.0

    async def wait(self) -> None:
        await asyncio.sleep(max(0.0, self.until - time.time()))


async def receive_pushed(
    engine: TransferEngine,
    geometry: KVGeometry,
    job: RecvJob,
    address: tuple[str, int],
    *,
    deadline: float,
    margin_s: float,
    withdrawal: asyncio.Event | None = None,
) -> None:
    """Decode: register `job`'s blocks with every prefill rank it needs and wait for their WRITEs.

    `deadline` is this host's wall clock. Raises `LayoutError` for what push cannot place
    (before any registration is sent), `NotificationTimeout` at `deadline` (never earlier once a
    registration was sent: a prefill rank may write until ``deadline - margin_s``), and
    `PushFailed` once every writing rank answered and one said its push failed with none of its
    WRITEs left, or that it no longer holds the request and no retry of it came (at once if every
    failed rank said its WRITEs all ended DONE, else after `WRITE_MARGIN_S` more: bytes a WRITE
    that ended in error had sent may still be landing). Once
    `withdrawal` is set, the registrations are withdrawn and `PushWithdrawn` is raised as soon as
    no prefill rank can write into the blocks (see the module's docstring). A registration call that
    fails (refused, unanswered, too large to send) withdraws the request from every rank the same way,
    then raises the call's error.
    """
    write_by = deadline - margin_s
    ranks = remote_ranks(local_tp=geometry.tp_size, local_rank=geometry.tp_rank, remote_tp=job.remote_tp)
    if not job.local_blocks:  # nothing to receive: only let prefill free the request
        peers = await asyncio.gather(*(connect_job_rank(engine, job, rank) for rank in ranks))
        registration = make_registration(geometry, job, decode_engine_id=engine.engine_id, decode_address=address,
                                         write_by=write_by, write=False, decode_agent=engine.agent_name)  # fmt: skip
        payload = encode_registration(registration)
        await asyncio.gather(*(engine.call(peer, PUSH_TOPIC, payload) for peer in peers))
        return
    first = await connect_job_rank(engine, job, ranks[0])
    registrations = registrations_for(geometry, job, first, decode_engine_id=engine.engine_id, decode_address=address,
                                      write_by=write_by, decode_agent=engine.agent_name)  # fmt: skip
    peers = await asyncio.gather(*(connect_job_rank(engine, job, rank) for rank, _ in registrations))
    # Waiting from now: a fast WRITE's notification may come before the registration's reply (one that
    # comes before its waiter is kept for it).
    waits = {rank: asyncio.ensure_future(_pushed_from(engine, job, rank, write_by, deadline))
             for rank, registration in registrations if registration.write}  # fmt: skip
    sent: list[int] = []  # ranks whose registration to write may have reached prefill
    exposure = _Exposure(deadline)
    try:
        try:
            await _unless_withdrawn(_register_and_wait(engine, job, registrations, peers, waits, sent, exposure),
                                    withdrawal)  # fmt: skip
        except _Withdrawal:
            await _withdraw_registrations(engine, registrations, peers, sent, waits, exposure)
            raise PushWithdrawn(f"request {job.request_id} was given up before its push arrived") from None
        except _NotRegistered as failed:
            # Ranks registered before may write: withdraw the request from every rank, so the blocks go
            # back once none can (not at the deadline), then fail with the registration's own error.
            await _withdraw_registrations(engine, registrations, peers, sent, waits, exposure)
            if waits and all(_arrived(wait) for wait in waits.values()):
                return  # every writing rank's push arrived: only a reply was lost
            raise failed.error from None
    except BaseException:
        for wait in waits.values():
            wait.cancel()
        await asyncio.gather(*waits.values(), return_exceptions=True)
        await exposure.wait()  # vLLM must not get the blocks back while a WRITE may still land in them
        raise


async def _register_and_wait(
    engine: TransferEngine,
    job: RecvJob,
    registrations: list[tuple[int, PushRegistration]],
    peers: list[Peer],
    waits: Mapping[int, asyncio.Future[None]],
    sent: list[int],
    exposure: _Exposure,
) -> None:
    for (rank, registration), peer in zip(registrations, peers, strict=True):
        if registration.write:  # even if the reply is lost, the registration may have arrived
            sent.append(rank)
            exposure.may_write()
        try:
            reply = await engine.call(peer, PUSH_TOPIC, encode_registration(registration))
        except (CallTooLarge, EngineIdMismatch) as exc:  # refused before prefill's handler could take it
            _not_sent(registration, sent, exposure)
            raise _NotRegistered(exc) from exc
        except (HandshakeError, ValueError) as exc:  # it may have arrived (a lost reply): the rank may write
            raise _NotRegistered(exc) from exc
        if reply == _GONE_BEFORE:
            _not_sent(registration, sent, exposure)  # this one will not write: only those registered before may
            raise _NotRegistered(PushFailed(f"prefill {peer.engine_id} no longer holds request "
                                            f"{job.remote_request_id}", peer=peer.engine_id))  # fmt: skip
    if waits:
        await asyncio.wait(waits.values())  # (unlike gather, cancelling this leaves the waits to the withdrawal)
    errors = [error for wait in waits.values() if (error := wait.exception()) is not None]
    if errors and all(isinstance(e, PushFailed) for e in errors):
        # Every writing rank answered, and those that failed hold no WRITE any more: no need to wait
        # for the deadline, only for bytes a WRITE stopped by an error had sent (the notice may overtake them).
        exposure.settled(bytes_may_land=not all(isinstance(e, PushFailed) and e.landed for e in errors))
    if errors:
        raise errors[0]


def _not_sent(registration: PushRegistration, sent: list[int], exposure: _Exposure) -> None:
    """The registration just tried will not write: only ranks registered before it may."""
    if registration.write:
        sent.pop()
        if not sent:
            exposure.settled(bytes_may_land=False)


async def _unless_withdrawn(work: Coroutine[Any, Any, None], withdrawal: asyncio.Event | None) -> None:
    """Await `work`; if `withdrawal` is set first, cancel it and raise `_Withdrawal`."""
    if withdrawal is None:
        await work
        return
    if withdrawal.is_set():
        work.close()  # (never started)
        raise _Withdrawal
    task = asyncio.ensure_future(work)
    given_up = asyncio.ensure_future(withdrawal.wait())
    try:
        await asyncio.wait([task, given_up], return_when=asyncio.FIRST_COMPLETED)
    finally:
        given_up.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, given_up, return_exceptions=True)
    if task.cancelled() and given_up.done() and not given_up.cancelled():
        raise _Withdrawal
    task.result()  # its outcome when it ended first (or with the withdrawal: its pushes arrived)


async def _withdraw_registrations(
    engine: TransferEngine,
    registrations: list[tuple[int, PushRegistration]],
    peers: list[Peer],
    sent: list[int],
    waits: Mapping[int, asyncio.Future[None]],
    exposure: _Exposure,
) -> None:
    """Withdraw the request from every prefill rank whose push has not arrived, and settle `exposure`
    once none can write any more (a rank that does not answer as expected leaves it at the deadline).

    Ranks never registered with are told too: a reader that writes nothing stands in for their
    registration, so they free the request once computed instead of holding it for a lease.
    """
    arrived = {rank for rank, wait in waits.items() if _arrived(wait)}
    asked = [(rank, registration, peer) for (rank, registration), peer in zip(registrations, peers, strict=True)
             if rank not in arrived]  # fmt: skip
    replies = await asyncio.gather(
        *(engine.call(peer, PUSH_WITHDRAW_TOPIC, encode_registration(msgspec.structs.replace(r, write=False)))
          for _, r, peer in asked),
        return_exceptions=True,
    )  # fmt: skip
    may_have_written = set(sent)
    stopping = []
    for (rank, registration, peer), reply in zip(asked, replies, strict=True):
        if rank not in may_have_written:
            continue  # (never asked to write: whatever it answers, it writes nothing)
        if reply not in (WITHDRAWN, STOPPING, NOT_HELD):
            why = f"{type(reply).__name__}: {reply}" if isinstance(reply, BaseException) else repr(reply)
            log.info("could not withdraw request %s from %s (%s): its blocks stay held until the deadline",
                     registration.decode_request_id, peer.engine_id, why)  # fmt: skip
            return
        if reply == WITHDRAWN:  # never written
            may_have_written.discard(rank)
            waits[rank].cancel()
        elif reply == STOPPING:  # told (pushed or failed) once NIXL let go of its WRITEs, by the deadline at the latest
            stopping.append(waits[rank])
    if stopping:
        await asyncio.wait(stopping)
    for wait in stopping:
        if wait.cancelled() or not isinstance(wait.exception(), PushFailed | None):
            return  # (its deadline passed, or nobody knows: the exposure stays at the deadline)
    landed = {rank for rank, wait in waits.items() if _landed(wait)}
    exposure.settled(bytes_may_land=bool(may_have_written - landed))


def _arrived(wait: asyncio.Future[None]) -> bool:
    """Whether a rank's push arrived (its notification came after every byte of its WRITEs)."""
    return wait.done() and not wait.cancelled() and wait.exception() is None


def _landed(wait: asyncio.Future[None]) -> bool:
    """Whether every byte a rank wrote is in place: its push arrived, or failed with every WRITE ended DONE."""
    if _arrived(wait):
        return True
    error = wait.exception() if wait.done() and not wait.cancelled() else None
    return isinstance(error, PushFailed) and error.landed


async def _pushed_from(engine: TransferEngine, job: RecvJob, rank: int, write_by: float, deadline: float) -> None:
    """Until prefill rank `rank`'s push arrived (its WRITE's notification), or it said the push failed
    (`PushFailed`); `NotificationTimeout` at `deadline` (this host's wall clock)."""
    timeout = max(0.0, deadline - time.time())
    arrived = asyncio.ensure_future(engine.wait_notifications(push_notification(job.request_id, rank), 1,
                                                              timeout=timeout))  # fmt: skip
    failed, landed = (
        asyncio.ensure_future(engine.wait_notifications(
            push_failure_notification(job.request_id, rank, write_by, landed=notice_landed), 1, timeout=timeout))
        for notice_landed in (False, True)
    )  # fmt: skip
    waits = (arrived, failed, landed)
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    if not arrived.cancelled() and arrived.exception() is None:
        return
    for wait in (landed, failed):
        if not wait.cancelled() and wait.exception() is None:
            prefill = rank_engine_id(job.remote_engine_id, rank)
            raise PushFailed(f"prefill {prefill} could not push request {job.remote_request_id}", peer=prefill,
                             landed=wait is landed)  # fmt: skip
    errors = [w.exception() for w in waits if not w.cancelled()]
    raise next(e for e in errors if e is not None)
