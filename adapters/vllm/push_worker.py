"""Push mode, worker side: decode registers its blocks, prefill WRITEs the KV into them.

Everything that touches the network is a coroutine on the engine's loop; vLLM's worker thread
only hands work over (`start_load_kv`) and collects what ended (`get_transfer_results`).

Decode (`push_receive.receive_pushed`): for each request vLLM allocated, register its blocks with
the prefill ranks it needs and wait for their WRITEs; if vLLM finishes the request meanwhile (its
client went away), withdraw the registrations and hand the blocks back once no WRITE can land.
A prefill rank whose push failed, once none of its WRITEs is left in NIXL, says so
(`push_or_tell`), and whether each of them ended DONE (NIXL's UCX backend reports a WRITE done
once decode's side acknowledged its bytes): when every writing rank has answered, decode fails
the request at once, or after a short margin where a WRITE ended in error, instead of at
``write_by``.

Block sizes: as with vLLM's push connector, prefill's blocks may hold k times decode's tokens
(never fewer). Each prefill block is then cut into k pieces, one per decode block: by token runs
in a head-major block, so one WRITE per run and block group (`write_parts`, with
`tp_mapping.split_for_block_ratio`'s cut, pull's roles swapped). Decode hears from a prefill
rank once, after all of its WRITEs' data.

Prefill: registrations (answered on the loop) and finished requests (from vLLM's metadata)
meet in a `PushBook`; each match runs `push` as a request of the sync facade, so its result is
reported only once NIXL holds none of its transfers. A request's blocks go back to vLLM when
every decode rank's push ended (or was withdrawn), or its lease ran out and no push still reads
them.

Progressive push (``push_progressive``): a registration that arrives while prefill still
computes the request is claimed at the next step, and `push_progressively` WRITEs each layer's
completed blocks as vLLM reports the layer computed (`save_kv_layer`), then commits the request
at its end (see `progressive`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec

from nixl_async import (
    EngineClosedError,
    FinishedRequests,
    LayoutError,
    LeaseExpired,
    Peer,
    Transfer,
    TransferEngine,
    TransferError,
    TransferFailed,
    TransferFenced,
    TransferResult,
)

from .progressive import LayerCoverage, LayerReady, PrefillStep, ProgressiveFeed, RequestDone
from .push_book import (
    NOT_HELD,
    PUSH_TOPIC,
    PUSH_WITHDRAW_TOPIC,
    STOPPING,
    WITHDRAWN,
    PushBook,
    PushRegistration,
    base_request_id,
    decode_registration,
    push_failure_notification,
    push_notification,
)
from .push_plan import WHOLE, WritePart, layer_parts, write_parts
from .push_receive import WRITE_MARGIN_S, PushFailed, PushWithdrawn, receive_pushed
from .send_book import SendBook
from .settings import UnsupportedSetting, connect_rank
from .tp_mapping import expected_consumers
from .worker import LAYOUT, ConnectorWorker, KVGeometry, RecvJob

T = TypeVar("T")

__all__ = ["WRITE_MARGIN_S", "DecodeRestarted", "PushConnectorWorker", "PushFailed", "PushWithdrawn", "push",
           "push_or_tell", "push_progressively", "receive_pushed"]  # fmt: skip

log = logging.getLogger(f"vllm.{__name__}")

PUSH_ID = "push>"  # facade request ids of prefill's pushes: "push>{request}>{decode engine}>{decode request}"


class DecodeRestarted(TransferFailed):
    """The decode rank that registered a request is gone; another agent answers under its engine id
    (a restart): the registration's block ids mean nothing there, so nothing is written."""


async def connect_decode(engine: TransferEngine, reg: PushRegistration) -> Peer:
    """Prefill: the decode rank that made `reg`, or `DecodeRestarted` if another agent answers for it now.

    A peer held from before a restart is handshaken with again first (its old agent is dead, or
    the registration is older than what we hold).
    """
    peer = await connect_rank(engine, reg.decode_host, reg.decode_port, reg.decode_engine_id)
    if reg.decode_agent and peer.agent_name != reg.decode_agent:
        peer = await connect_rank(engine, reg.decode_host, reg.decode_port, reg.decode_engine_id, refresh=True)
        if peer.agent_name != reg.decode_agent:
            raise DecodeRestarted(f"request {reg.decode_request_id} was registered by agent {reg.decode_agent!r} of "
                                  f"{reg.decode_engine_id}, which is now agent {peer.agent_name!r}",
                                  peer=reg.decode_engine_id)  # fmt: skip
    return peer


class PushConnectorWorker(ConnectorWorker):
    TRANSFER_MODE = "push"
    # Pushes in flight, and decode's waits for them, are left at the poller's pace in an idle step: the
    # faster pokes were measured for pull reads only (`worker.idle_step_wait`).
    IDLE_POKES_FOR_OWN_REQUESTS = False

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        # Decode heartbeats the id the proxy gave prefill, without the suffix vLLM appends here.
        self._sends = SendBook(base_id=base_request_id)
        # A registration for a request freed here waits a lease for a retry under the same id.
        self._book = PushBook(grace_s=self.settings.lease_s)
        self._doubt_check: tuple[asyncio.TimerHandle, float] | None = None  # (loop thread) timer, its wall time
        # running push -> (its prefill request, decode ranks reading this rank); both threads, under the lock
        self._push_ids: dict[str, tuple[str, int, PushRegistration]] = {}
        self._push_lock = threading.Lock()
        self._cancelled: set[str] = set()  # pushes cancelled (lease ran out, decode withdrew them, prefill aborted)
        self._held_after_abort: set[str] = set()  # aborted; vLLM frees the blocks once we report them sent
        # progressive push (model thread): each request's pushes, this step's hand-over, layer -> region
        self._feeds: dict[str, list[ProgressiveFeed]] = {}
        self._layer_jobs: list[tuple[ProgressiveFeed, LayerReady]] = []
        self._jobs_metadata: Any = None  # the step `_layer_jobs` were set up for
        self._layer_regions: dict[str, int] = {}
        self._pushing: set[str] = set()  # pushes whose coroutine began (under the lock)
        self._withdrawn_pushes: set[str] = set()  # pushes decode withdrew: stopped, or never begun (under the lock)
        # decode (worker thread): each receive job -> the event that withdraws its registrations
        self._withdrawals: dict[str, asyncio.Event] = {}
        self._withdrawn_requests: set[str] = set()  # ... withdrawn: vLLM finished them (not a failure)
        self.sync.handle_calls(PUSH_TOPIC, self._answer_registration)
        self.sync.handle_calls(PUSH_WITHDRAW_TOPIC, self._answer_withdrawal)

    # -- decode ----------------------------------------------------------------------------
    def _start_receive(self, request_id: str, req: Any) -> None:
        if req.remote is None:
            return
        job = self._readable_job(request_id, req, None, None)  # no lease: prefill writes when it is done
        if job is None:
            return
        deadline = time.time() + self.settings.push_registration_timeout_s
        withdrawal = asyncio.Event()  # (bound to the loop when first awaited there)
        # vLLM waits only for a request with blocks (an empty one only lets prefill free the request)
        if self._hand_over(job, bool(job.local_blocks), self._receive_pushed, deadline, withdrawal):
            self._withdrawals[request_id] = withdrawal

    async def _receive_pushed(self, engine: TransferEngine, job: RecvJob, deadline: float,
                              withdrawal: asyncio.Event) -> None:  # fmt: skip
        if self.geometry is None:
            raise LayoutError("register_kv_caches() has not run")
        await receive_pushed(engine, self.geometry, job, self.address, deadline=deadline,
                             margin_s=engine.config.release_grace_s + WRITE_MARGIN_S,
                             withdrawal=withdrawal)  # fmt: skip

    def _withdraw(self, request_ids: list[str]) -> None:
        """vLLM finished these requests while they waited for their push (aborted): withdraw their registrations.

        vLLM holds their blocks until this worker reports them received, which it does once no
        prefill rank can write into them any more.
        """
        for request_id in request_ids:
            withdrawal = self._withdrawals.get(request_id)
            if withdrawal is not None and request_id not in self._withdrawn_requests:
                self._withdrawn_requests.add(request_id)
                self.sync.call_soon(withdrawal.set)

    # -- prefill ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        if self.settings.push_progressive:
            self._layer_regions = self._progressive_regions(kv_caches)

    def _progressive_regions(self, kv_caches: dict[str, Any]) -> dict[str, int]:
        """Which registered region each attention layer's KV lives in (refusing what cannot go layer by layer)."""
        why = None
        if self.group_kinds != ("full",):
            why = f"KV cache groups {self.group_kinds} (one full-attention group needed)"
        elif self._host_caches or self._regions[0].device.type != "cpu":
            why = ("CUDA caches: vLLM reports a layer computed while its kernel may still be queued "
                   "(not handled yet)")  # fmt: skip
        if why is not None:
            raise UnsupportedSetting(f"kv_connector_extra_config['push_progressive'] is not supported here: {why}")
        region_of = {int(t.data_ptr()): i for i, t in enumerate(self._regions)}
        return {name: region_of[int(t.data_ptr())] for name, t in kv_caches.items()}

    def start_load_kv(self, metadata: Any) -> None:
        super().start_load_kv(metadata)
        if metadata is None:
            return
        self._withdraw(getattr(metadata, "push_withdrawn", None) or [])
        self._book.computing(metadata.reqs_in_batch)  # (a retry under a freed request's id is not doubted)
        for request_id in metadata.reqs_not_processed:  # prefill dropped it: stop pushing its layers
            self._abandon(request_id)
        self._held_after_abort.update(getattr(metadata, "push_held_after_abort", None) or [])
        for request_id, blocks in getattr(metadata, "push_finished_blocks", {}).items():
            grouped = tuple(list(map(int, g)) for g in blocks)
            for feed in self._feeds.pop(request_id, []):
                self.sync.call_soon(feed.give, RequestDone(grouped))
            for registration in self._book.finished(request_id, grouped):
                self._start_push(request_id, grouped, registration)

    def _step_jobs(self, steps: dict[str, PrefillStep]) -> list[tuple[ProgressiveFeed, LayerReady]]:
        """This step's hand-over to each progressive push: the blocks it completes (a layer's region set later)."""
        jobs = []
        for request_id, step in steps.items():
            for registration in self._book.claim(request_id):
                self._start_progressive(request_id, step, registration)
            for feed in self._feeds.get(request_id, []):
                if (item := feed.hand_over(step, self.block_size)) is not None:
                    jobs.append((feed, item))
        return jobs

    def save_kv_layer(self, layer_name: str, metadata: Any) -> None:
        """vLLM computed `layer_name` for this step: hand its completed blocks to the progressive pushes.

        vLLM 0.32 calls `start_load_kv` after the forward pass (unless a load must precede it), so
        the step's hand-over is set up here, at its first layer.
        """
        if metadata is not self._jobs_metadata:
            self._jobs_metadata = metadata
            # (before `start_load_kv` tracks them: a registration claimed now may be served at once, counted
            # only for a request the send book knows, else its blocks would wait out the lease)
            self._sends.in_batch(set(getattr(metadata, "reqs_in_batch", None) or ()))
            self._layer_jobs = self._step_jobs(getattr(metadata, "push_steps", None) or {})
        jobs = self._layer_jobs
        if not jobs:
            return
        region = self._layer_regions.get(layer_name)
        if region is not None:
            self.sync.call_soon(_give_layer, region, jobs)

    def _start_progressive(self, request_id: str, step: PrefillStep, registration: PushRegistration) -> None:
        push_id = self._claim_push_id(request_id, registration)
        if push_id is None:
            return
        feed = ProgressiveFeed(push_id, step.prompt_blocks(self.block_size))
        self._feeds.setdefault(request_id, []).append(feed)
        self.sync.submit(push_id, self._push_progressively, registration, feed)

    async def _push_progressively(self, engine: TransferEngine, reg: PushRegistration, feed: ProgressiveFeed) -> None:
        if self.geometry is None:
            raise LayoutError("register_kv_caches() has not run")
        if not self._begin(feed.push_id):
            feed.over = True
            return
        for result in await push_progressively(engine, self.geometry, reg, feed, len(self._regions)):
            if result.nbytes:  # (its commit, a notification alone, is no transfer to vLLM's stats)
                self._results.put(result)

    def _abandon(self, request_id: str) -> None:
        """Prefill will not finish `request_id` (aborted): end its progressive pushes, forget it.

        Decode ranks registered for it are told once no retry under its id came (`PushBook`).
        """
        for feed in self._feeds.pop(request_id, []):
            with self._push_lock:
                if feed.push_id in self._cancelled or feed.push_id not in self._push_ids:
                    continue  # (stopping already, or ended and reported: nothing to cancel, nothing to remember)
                self._cancelled.add(feed.push_id)  # (a lease's end or a withdrawal does not cancel it again)
            self.sync.cancel(feed.push_id)
        self._release(request_id)

    def _answer_registration(self, _sender: str, payload: bytes) -> bytes:
        registration = decode_registration(payload)  # a malformed one raises ValueError: refused
        match = self._book.register(registration, time.time())
        if match is not None:
            self._start_push(*match)
        else:
            self._arm_doubt_check()
        return b"ok"

    def _answer_withdrawal(self, _sender: str, payload: bytes) -> bytes:
        """(Loop thread) A decode rank gave up on a request it registered (or was about to): write nothing
        more for it, and say whether anything may have been written (`push_book`'s answers)."""
        registration = decode_registration(payload)  # (write=False: what is left of it)
        # The book remembers the withdrawal first: a push claimed after this looks (`_claim_push_id`) writes nothing.
        if self._book.withdraw(registration):
            return WITHDRAWN
        base = base_request_id(registration.request_id)
        suffix = f">{registration.decode_engine_id}>{registration.decode_request_id}"
        with self._push_lock:
            pushes = [push_id for push_id, (request_id, _, _) in self._push_ids.items()
                      if push_id.endswith(suffix) and base_request_id(request_id) == base]  # fmt: skip
            self._withdrawn_pushes.update(pushes)  # one not begun yet ends at once (`_begin`)
            begun = [push_id for push_id in pushes if push_id in self._pushing]
            stop = [push_id for push_id in begun if push_id not in self._cancelled]  # (others are stopping)
            self._cancelled.update(stop)
        for push_id in stop:
            log.info("decode withdrew %s: stopping push %s", registration.decode_request_id, push_id)
            self.sync.cancel(push_id)  # once NIXL let go of it, `push_or_tell` tells decode
        if begun:
            return STOPPING
        if pushes:
            return WITHDRAWN
        match = self._book.stand_in(registration, time.time())  # (its decode rank still counts as served)
        if match is not None:
            self._start_push(*match)
        else:
            self._arm_doubt_check()
        return NOT_HELD

    def _begin(self, push_id: str) -> bool:
        """(Loop thread) A push's coroutine begins: False if decode withdrew it meanwhile (it writes nothing)."""
        with self._push_lock:
            if push_id in self._withdrawn_pushes:
                return False
            self._pushing.add(push_id)
            return True

    def _arm_doubt_check(self) -> None:
        """(Loop thread) Tell decode about doubted registrations once their grace ends, even if vLLM idles."""
        when = self._book.next_doubt()
        if when is None or (self._doubt_check is not None and self._doubt_check[1] <= when):
            return
        if self._doubt_check is not None:
            self._doubt_check[0].cancel()
        delay = max(0.0, when - time.time()) + 0.01
        self._doubt_check = asyncio.get_running_loop().call_later(delay, self._check_doubts), when

    def _check_doubts(self) -> None:
        self._doubt_check = None
        self._tell_expired()
        self._arm_doubt_check()

    def _tell_expired(self) -> None:
        """Drop registrations past their write_by; tell the decode ranks of doubted ones their push failed."""
        expired = self._book.expire(time.time())
        for registration in expired.unclaimed:
            if not registration.write:  # (withdrawn, or a rank that only lets us free the request)
                continue
            log.warning("registration of %s by %s was never matched before its deadline", registration.request_id,
                        registration.decode_engine_id)  # fmt: skip
        for registration in expired.doubted:
            if registration.write:  # (a rank that writes nothing only let us free the request)
                log.info("request %s is no longer here and no retry of it came: telling %s", registration.request_id,
                         registration.decode_engine_id)  # fmt: skip
                self.sync.spawn(self._tell_failed, registration)

    async def _tell_failed(self, engine: TransferEngine, registration: PushRegistration) -> None:
        if self.geometry is not None:  # (no push ran for it: nothing was written under it)
            await tell_push_failed(engine, self.geometry.tp_rank, registration, landed=True)

    def _start_push(self, request_id: str, blocks: tuple[list[int], ...], registration: PushRegistration) -> None:
        push_id = self._claim_push_id(request_id, registration)
        if push_id is not None:
            self.sync.submit(push_id, self._push, push_id, blocks, registration)

    def _claim_push_id(self, request_id: str, registration: PushRegistration) -> str | None:
        """The facade id of the push `registration` asks for; None if there is nothing to push (book updated)."""
        # (per decode request: two attempts under one id from the same decode rank are two pushes)
        push_id = f"{PUSH_ID}{request_id}>{registration.decode_engine_id}>{registration.decode_request_id}"
        readers = self._readers(registration)
        with self._push_lock:
            # Withdrawn since the book handed it out, its withdrawal saw no push of it: none may start now.
            write = registration.write and not self._book.withdrawn(registration)
            repeat = write and push_id in self._push_ids
            if write and not repeat:
                self._push_ids[push_id] = (request_id, readers, registration)
        if not write:  # decode reads nothing from this rank: it only lets it free
            self._served(request_id, readers)
            return None
        if repeat:  # the same decode rank registered twice: the push under way serves it
            self._book.ended(request_id)
            return None
        return push_id

    async def _push(self, engine: TransferEngine, push_id: str, blocks: tuple[list[int], ...],
                    reg: PushRegistration) -> None:  # fmt: skip
        if self.geometry is None:
            raise LayoutError("register_kv_caches() has not run")
        if not self._begin(push_id):
            return
        result = await push_or_tell(engine, self.geometry, blocks, reg)
        if result.nbytes:  # (a push with nothing to write, decode's prefix hit whole, is no transfer to vLLM's stats)
            self._results.put(result)

    def _readers(self, registration: PushRegistration) -> int:
        return expected_consumers(remote_tp=self.tp_size, local_tp=registration.decode_tp)

    def _served(self, request_id: str, readers: int) -> None:
        """One more of the `readers` decode ranks of `request_id` is served (or its push failed)."""
        self._sends.notified(f"{request_id}:{readers}".encode())
        self._book.ended(request_id)

    def _own_finished(self, finished: FinishedRequests) -> FinishedRequests:
        """Take prefill's pushes out of what the facade reports: they count toward freeing blocks.

        Decode's withdrawn requests ended as vLLM asked: reported received (their blocks go back), not failed.
        """
        for request_id in [r for r in (*finished.done, *finished.failed) if r in self._withdrawals]:
            self._withdrawals.pop(request_id)
            if request_id in self._withdrawn_requests:
                self._withdrawn_requests.discard(request_id)
                if finished.failed.pop(request_id, None) is not None:
                    finished.done.add(request_id)
        for push_id in [r for r in (*finished.done, *finished.failed, *finished.fenced) if r.startswith(PUSH_ID)]:
            if push_id in finished.fenced:
                log.warning("push %s ended but NIXL still holds its WRITE: its blocks stay held", push_id)
                finished.fenced.pop(push_id)
                continue
            error = finished.failed.pop(push_id, None)
            finished.done.discard(push_id)
            with self._push_lock:
                entry = self._push_ids.pop(push_id, None)
                withdrawn = push_id in self._withdrawn_pushes
                began = push_id in self._pushing
                self._withdrawn_pushes.discard(push_id)
                self._pushing.discard(push_id)
            self._cancelled.discard(push_id)
            if entry is None:
                continue
            request_id, readers, registration = entry
            if withdrawn:
                log.info("push %s ended after decode withdrew it (%s)", push_id,
                         "failed" if error is not None else "done")  # fmt: skip
            elif error is not None:
                log.warning("push %s failed: %s: %s", push_id, type(error).__name__, error)
                self._record("num_failed_transfers", 1)
                if not began:  # cancelled before its coroutine ran: no `push_or_tell` told decode, nothing was written
                    self.sync.spawn(self._tell_failed, registration)
            self._served(request_id, readers)
        return finished

    def _release(self, request_id: str, expired: bool = True) -> bool:
        released = self._book.release(request_id, time.time(), stop=expired)
        if self._book.next_doubt() is not None:
            self.sync.call_soon(self._arm_doubt_check)
        return released

    def _finished_sending(self) -> set[str]:
        closing = self._book.closing()
        for request_id in self._book.stopping():  # lease ran out while a push reads the blocks: stop it
            with self._push_lock:
                running = [p for p, (r, _, _) in self._push_ids.items() if r == request_id and p not in self._cancelled]
                self._cancelled.update(running)
            for push_id in running:
                self.sync.cancel(push_id)
        self._tell_expired()
        # Aborted, and none of our pushes reads the blocks any more (one listed closing above may have
        # ended since: it is reported at the next step).
        freed = self._held_after_abort.difference(closing)
        self._held_after_abort -= freed
        return super()._finished_sending() | freed


async def push_or_tell(
    engine: TransferEngine, geometry: KVGeometry, blocks: tuple[list[int], ...], reg: PushRegistration
) -> TransferResult:
    """`push`; if it fails and none of its WRITEs is left in NIXL, tell decode at once.

    Decode would otherwise hold the request's blocks until ``write_by`` (vLLM's push connector
    does the same), minutes by default: told, it fails the request (vLLM recomputes it) at once
    if every WRITE it posted ended DONE, else after the margin that bytes a WRITE which ended in
    error had sent may take to land.
    """
    started: list[Transfer] = []
    try:
        return await push(engine, geometry, blocks, reg, started=started)
    except BaseException as exc:
        # (fenced: NIXL may still write into its blocks; notified: its last WRITE landed though the push
        # was stopped meanwhile, and decode was told so: a failure notice now would contradict it)
        if not isinstance(exc, TransferFenced | DecodeRestarted) and not _notified(started):
            await _despite_cancels(tell_push_failed(engine, geometry.tp_rank, reg, landed=_landed(engine, started)))
        raise


def _notified(started: list[Transfer]) -> bool:
    """Whether a WRITE in `started` carrying decode's notification went through (decode heard it landed):
    it completed, or every slice, the notifying last one too, ended DONE though it is reported as
    failed (its lease ran out just before NIXL finished it)."""
    return any(t.notify is not None and t.done() and (t.exception() is None or _all_landed(t)) for t in started)


def _all_landed(transfer: Transfer) -> bool:
    """Every slice, the last too, was posted and ended DONE (a notification alone, with no slice, is not)."""
    return (transfer.num_slices > 0 and transfer.quiet and transfer.slices_errored == 0
            and transfer.slices_posted == transfer.num_slices)  # fmt: skip


def _landed(engine: TransferEngine, started: list[Transfer]) -> bool:
    """Whether decode's side acknowledged every byte the settled WRITEs in `started` posted, so none can
    land later: each slice ended DONE, which NIXL's UCX backend reports only after flushing the
    endpoint (remote completion). Other backends promise no such thing: False, as when one may still."""
    if engine.config.backends != ("UCX",):
        return False
    return all(t.quiet and t.slices_errored == 0 for t in started)


async def tell_push_failed(engine: TransferEngine, rank: int, reg: PushRegistration, *, landed: bool = False) -> None:
    """Tell the decode rank of `reg` that prefill rank `rank` writes nothing more for it (best effort:
    failing that, decode waits until its deadline, as it would have). `landed`: nothing it wrote can
    land later either (said only to a decode that understands it)."""
    notice = push_failure_notification(reg.decode_request_id, rank, reg.write_by,
                                       landed=landed and reg.landed_notice)  # fmt: skip
    try:
        peer = await connect_decode(engine, reg)
        await engine.notify(peer, notice)
    except Exception as exc:
        log.info("could not tell %s that no push of %s comes: %s", reg.decode_engine_id, reg.request_id, exc)


async def push(
    engine: TransferEngine,
    geometry: KVGeometry,
    blocks: tuple[list[int], ...],
    reg: PushRegistration,
    *,
    started: list[Transfer] | None = None,
) -> TransferResult:
    """Prefill: WRITE one request's `blocks` into what decode rank `reg` registered, then notify it.

    Every part of `write_parts` is written (none starts after ``reg.write_by``); the
    notification rides on the smallest part, started once all others completed, so decode
    hears it only after every byte. If a part fails, the others are cancelled and settled (NIXL
    holds none of their handles) before the error is raised, and decode is not notified. The
    result sums the parts (bytes, descriptors, slices). When it ends, each WRITE it began is added
    to `started` (the caller's list, to see how they ended).
    """
    parts = write_parts(geometry, blocks, reg)  # refused here, before anything is written
    peer = await connect_decode(engine, reg)
    notify = push_notification(reg.decode_request_id, geometry.tp_rank)
    own: list[Transfer] = []
    try:
        if len(parts) <= 1:  # one WRITE (or only the notification: nothing to write)
            part = parts[0] if parts else WritePart([], [], WHOLE, WHOLE)
            write = await engine.start_write(peer, part.prefill_blocks, part.decode_blocks, local=part.prefill_view,
                                             remote=part.decode_view, notify=notify,
                                             lease_expires_at=reg.write_by)  # fmt: skip
            own.append(write)
            return await write
        return await _write_parts(engine, peer, parts, notify, reg, own)
    except BaseException as exc:
        # Quiet, or TransferFenced: a cancelled task resumes with CancelledError even when its WRITE
        # was reported fenced, and `push_or_tell` must not tell decode the push is over then.
        if not await _settled(engine, own):
            log.error("push of %s to %s: NIXL still holds WRITEs after cancelling them", reg.request_id,
                      reg.decode_engine_id)  # fmt: skip
            reason = exc if isinstance(exc, TransferError) else TransferFailed(
                f"push of {reg.request_id} to {reg.decode_engine_id} stopped: {type(exc).__name__}: {exc}",
                peer=reg.decode_engine_id)  # fmt: skip
            raise TransferFenced.of(reason, slices=sum(not t.quiet for t in own)) from exc
        raise
    finally:
        if started is not None:
            started.extend(own)


async def _write_parts(engine: TransferEngine, peer: Any, parts: list[WritePart], notify: bytes,
                       reg: PushRegistration, started: list[Transfer]) -> TransferResult:  # fmt: skip
    """`push` of several parts: the smallest carries the notification, started once all others completed."""
    last = min(range(len(parts)), key=lambda i: len(parts[i].decode_blocks))
    began = time.perf_counter()
    for part in parts[:last] + parts[last + 1 :]:
        started.append(await engine.start_write(peer, part.prefill_blocks, part.decode_blocks,
                                                local=part.prefill_view, remote=part.decode_view,
                                                lease_expires_at=reg.write_by))  # fmt: skip
    await asyncio.wait([t.future for t in started], return_when=asyncio.FIRST_EXCEPTION)
    for transfer in started:
        error = transfer.exception() if transfer.done() else None
        if error is not None:
            raise error
    results = [t.result() for t in started]
    part = parts[last]
    final = await engine.start_write(peer, part.prefill_blocks, part.decode_blocks, local=part.prefill_view,
                                     remote=part.decode_view, notify=notify, lease_expires_at=reg.write_by)  # fmt: skip
    started.append(final)
    results.append(await final)
    return msgspec.structs.replace(
        results[-1], nbytes=sum(r.nbytes for r in results), descriptors=sum(r.descriptors for r in results),
        slices=sum(r.slices for r in results), seconds=time.perf_counter() - began,
        post_seconds=sum(r.post_seconds for r in results),
        wire_seconds=max(r.wire_seconds for r in results[:-1]) + results[-1].wire_seconds,
    )  # fmt: skip


async def _settled(engine: TransferEngine, started: list[Transfer]) -> bool:
    """Cancel what is left of a failed push and wait until NIXL holds none of it; False if it still does
    after the grace (or the engine closed meanwhile: then nobody knows)."""
    try:
        return await _despite_cancels(engine.settle(started, timeout=engine.config.release_grace_s + 0.5))
    except (asyncio.CancelledError, EngineClosedError):
        return False


async def _despite_cancels(work: Coroutine[Any, Any, T]) -> T:
    """Run `work` to its end, bounded as it is, even if this task is cancelled again meanwhile.

    A push being stopped is stopped once: a second cancel (prefill aborting the request, then decode
    withdrawing it) must not cut short settling its WRITEs or telling decode, which would otherwise
    hold the request's blocks until its deadline. The cancel is not lost: the push ends anyway.
    """
    task = asyncio.ensure_future(work)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            if task.done():
                return task.result()


# -- prefill: progressive push ----------------------------------------------------------------
def _give_layer(region: int, jobs: list[tuple[ProgressiveFeed, LayerReady]]) -> None:
    """Loop thread: layer `region` of this step is computed; queue it for each progressive push."""
    for feed, job in jobs:
        feed.give(dataclasses.replace(job, region=region))


async def push_progressively(
    engine: TransferEngine, geometry: KVGeometry, reg: PushRegistration, feed: ProgressiveFeed, regions: int
) -> list[TransferResult]:
    """Prefill: WRITE each layer of a request as the feed reports it computed, then commit it.

    Every layer's WRITEs stop at ``reg.write_by``, as a whole push does. At `RequestDone`, once
    every WRITE has landed: if each block's every layer was written from the block the request
    ends with, decode is notified (the commit); otherwise (claimed late, a layer unreported, the
    request moved to other blocks, block sizes that differ) the whole request is written again
    with the notification. A push that fails or is cancelled (prefill aborted the request) settles
    its WRITEs and, once NIXL holds none of them, tells decode, as `push_or_tell` does.
    """
    started: list[Transfer] = []
    try:
        peer = await connect_decode(engine, reg)
        parts = write_parts(geometry, (list(range(feed.prompt_blocks)),), reg)  # planned on positions
        layered = peer.layout(LAYOUT).num_regions == regions and all(
            p.prefill_view.split == p.decode_view.split == 1 and len(p.prefill_blocks) == len(p.decode_blocks)
            for p in parts
        )
        coverage = LayerCoverage(regions)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + (reg.write_by - time.time())
        while True:
            try:
                async with asyncio.timeout_at(give_up):
                    item = await feed.queue.get()
            except TimeoutError:
                raise LeaseExpired(f"decode gives up on {reg.decode_request_id} before prefill finished it",
                                   peer=reg.decode_engine_id) from None  # fmt: skip
            if isinstance(item, RequestDone):
                break
            if not layered or not coverage.accepts(item):
                continue
            for part in layer_parts(parts, item, geometry.pages_per_block):
                started.append(await engine.start_write(peer, part.prefill_blocks, part.decode_blocks,
                                                        local=part.prefill_view, remote=part.decode_view,
                                                        lease_expires_at=reg.write_by))  # fmt: skip
            coverage.wrote(item)
        results = [await transfer for transfer in started]
        if layered and len(item.blocks) == 1 and coverage.whole(item.blocks[0]):
            await engine.notify(peer, push_notification(reg.decode_request_id, geometry.tp_rank))
            return results
        log.info("progressive push of %s to %s: not every layer of every block went as computed; writing the whole "
                 "request", reg.request_id, reg.decode_engine_id)  # fmt: skip
        return [*results, await push(engine, geometry, item.blocks, reg, started=started)]
    except BaseException as exc:
        # (fenced, or another decode at that address: say nothing; decode waits for its deadline)
        # (nor after the whole request's notifying WRITE landed: decode was told it arrived)
        if (not isinstance(exc, TransferFenced | DecodeRestarted) and await _settled(engine, started)
                and not _notified(started)):  # fmt: skip
            await _despite_cancels(tell_push_failed(engine, geometry.tp_rank, reg, landed=_landed(engine, started)))
        raise
    finally:
        feed.over = True
