"""The transfer driver: carries every transfer from submit to quiet, on the engine's loop.

It is where the state machine (`_state.py`) meets NIXL. For each transfer it posts slices,
checks the running ones, releases handles, and tells the caller (through the transfer's future)
only once NIXL holds none of its handles, or with `TransferFenced` past the grace. What NIXL says
goes into the transfer's `TransferCore`; the actions that come out are carried out by `_apply`.
The engine validates and admits a submit, then hands it here; its poller calls `sweep`.

Per-transfer cost matters at 10 k transfers in flight: one submit keeps three objects the garbage
collector tracks (transfer, core, future; NIXL's handles are plain ints), handles live in one driver-wide dict,
and every transfer shares one bound method for its callbacks.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import zmq

from ._admission import Admission
from ._agent import NIXL_ERRORS, OwnedAgent
from ._notify_transport import NOTIFY_ERRORS, NotificationTransport
from ._peers import Peer, PeerTable
from ._poller import AdaptivePacer
from ._slicing import CopyRates, LinkRates, Route, slice_bytes
from ._state import Action, Complete, Fenced, Finish, Quiet, Release, TransferState
from .config import EngineConfig
from .exceptions import LeaseExpired, NotificationFailed, TransferError, TransferFailed, TransferTimeout
from .layout import DescIds, IdArray
from .stats import EngineStats
from .transfer import Transfer, TransferBatch, TransferFuture, TransferResult, descriptors_per_slice

__all__ = ["COLLECTOR", "TransferCollection", "TransferDriver", "earliest"]

log = logging.getLogger("nixl_async.engine")

_NEVER = float("inf")
# A post slower than this ends the poller's sweep early so other coroutines get the loop.
_SWEEP_BUDGET_S = 0.001
# Hot checks on a transfer start at least this long before it is expected to end.
_HOT_MARGIN_S = 0.0005
_HINT_CHECK_S = 0.1  # how often the sweep looks for busy hints to renew (each has 0.5 s left then)
# Handles are keyed by transfer id * _SLICE_KEY + slice index.
_SLICE_KEY = 1 << 32
_EMPTY_IDS: IdArray = np.empty(0, dtype=np.int64)


class TransferCollection(list[Transfer]):
    """The transfers submitted inside one `collect_transfers()` block; `closed` once it ended."""

    __slots__ = ("closed",)

    def __init__(self) -> None:
        super().__init__()
        self.closed = False


# Where `TransferEngine.collect_transfers()` gathers the transfers submitted in its context.
COLLECTOR: contextvars.ContextVar[TransferCollection | None] = contextvars.ContextVar(
    "nixl_async_collector", default=None
)


def earliest(deadline: float | None, lease_deadline: float | None) -> float | None:
    """A transfer's effective deadline: the caller's own or the producer's lease, whichever comes first."""
    if lease_deadline is None or (deadline is not None and deadline <= lease_deadline):
        return deadline
    return lease_deadline


class TransferDriver:
    """Owns the transfers in flight (and the fenced ones) and everything NIXL holds for them."""

    def __init__(
        self,
        config: EngineConfig,
        stats: EngineStats,
        admission: Admission,
        table: PeerTable,
        notify: NotificationTransport,
        pacer: AdaptivePacer,
        wakeup: Callable[[], None],
        check_by: Callable[[float], None],
    ) -> None:
        self._config = config
        self._stats = stats
        self._admission = admission
        self._table = table
        self._notify = notify
        self._pacer = pacer
        self._wakeup = wakeup
        self._check_by = check_by  # transfers posted at submit: the poller's first check (their `hot_from`)
        self.agent: OwnedAgent | None = None  # set while the engine runs (and while it closes)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.active: dict[int, Transfer] = {}  # not yet told, or told but still releasing
        self.fenced: dict[int, Transfer] = {}  # told the caller, NIXL still holds handles
        self._handles: dict[int, Any] = {}  # see _SLICE_KEY
        self._ids = itertools.count(1)
        self.copy_rates = CopyRates(config)  # size slices of inline copies, per route (each peer has its wire rate)
        self.hot_from = -_NEVER  # perf_counter time from which the poller should check hot
        # ...of transfers submitted since the running sweep began: a submit while the sweep yields
        # (its awaiters submit their next) cannot wake the poller, and the sweep's list left them out
        self._submitted_hot_from = _NEVER
        self._hints_checked_at = -_NEVER  # loop time the sweep last looked for busy hints to renew
        self._next_deadline = _NEVER  # no transfer's deadline comes before this
        # One bound method each, shared by every transfer (a bound method per transfer is one
        # more object for the garbage collector).
        self._end_cb = self.end
        self._awaiter_cancelled_cb = self._on_awaiter_cancelled

    # -- views ------------------------------------------------------------------------------
    def live(self) -> list[Transfer]:
        """Transfers whose handles NIXL may still hold."""
        return [*self.active.values(), *self.fenced.values()]

    def busy_agents(self) -> set[str]:
        """Remote agents some live transfer uses."""
        return {t.remote_agent for t in self.live()}

    # -- submitting -----------------------------------------------------------------------------
    def submit(
        self,
        op: str,
        peer: Peer,
        local: tuple[Any, DescIds],
        remote: tuple[Any, DescIds],
        piece_len: int,
        notify: bytes | None,
        deadline: float | None,
        lease_deadline: float | None,
        route: Route,
    ) -> Transfer:
        """Start an admitted transfer: `local`/`remote` are (prepared descriptor list, descriptor ids)."""
        rows = ((local[1], remote[1], notify),)
        return self.submit_many(op, peer, local[0], remote[0], piece_len, rows, deadline, lease_deadline, route)[0]

    def submit_many(
        self,
        op: str,
        peer: Peer,
        local_dlist: Any,
        remote_dlist: Any,
        piece_len: int,
        rows: Iterable[tuple[DescIds, DescIds, bytes | None]],
        deadline: float | None,
        lease_deadline: float | None,
        route: Route,
    ) -> list[Transfer]:
        """Start admitted transfers over the same descriptor lists, one per (local ids, remote ids, notify) row.

        What the transfers share (slice size, deadline, peer bookkeeping) is worked out once.
        """
        agent, loop, config = self.agent, self.loop, self._config
        assert agent is not None and loop is not None
        now = loop.time()
        started: list[Transfer] = []
        posting, notify_only = False, 0
        hot_from = _NEVER  # of the transfers posted here (-_NEVER: one still wants a post)
        collected = COLLECTOR.get()
        rows = iter(rows)
        unheld: DescIds | None = None  # a row's admitted room not yet held by its transfer
        try:
            copy_rate = self.copy_rates.of(route)
            per_slice = descriptors_per_slice(piece_len, slice_bytes(config, copy_rate, peer.link),
                                              config.max_post_descriptors)  # fmt: skip
            first = earliest(deadline, lease_deadline)
            self._expect(peer, now, first)
            # Small transfers are posted here, for as long as one sweep's budget lasts; the poller posts
            # the rest of a large batch, yielding as it goes, so a batch never stalls the loop for long.
            clock = time.perf_counter()
            inline_until = clock + _SWEEP_BUDGET_S
            for lidx, ridx, notify in rows:
                if not len(lidx):  # no blocks: only the notification (a full prefix-cache hit); holds no room
                    started.append(self.notify_only(op, peer, notify))
                    notify_only += 1
                    continue
                unheld = lidx
                transfer_id = next(self._ids)
                transfer = Transfer(
                    transfer_id=transfer_id,
                    op=op,
                    peer=peer.engine_id,
                    remote_agent=peer.agent_name,
                    local_dlist=local_dlist,
                    remote_dlist=remote_dlist,
                    local_ids=lidx,
                    remote_ids=ridx,
                    per_slice=per_slice,
                    notify=notify,
                    nbytes=len(lidx) * piece_len,
                    deadline=first,
                    submitted_at=now,
                    future=TransferFuture(loop=loop, transfer_id=transfer_id, on_cancel=self._awaiter_cancelled_cb),
                    cancel_cb=self._end_cb,
                    link=peer.link,
                    copy_rate=copy_rate,
                    slices_in_flight=config.slices_in_flight,
                    release_grace_s=config.release_grace_s,
                )
                transfer.lease_deadline, transfer.timeout_deadline = lease_deadline, deadline
                self.active[transfer_id] = transfer  # from here on `_retire` gives the admitted room back
                unheld = None
                started.append(transfer)
                if collected is not None:
                    collected.append(transfer)
                if transfer.post_bytes <= config.min_post_bytes and (
                    len(started) == 1 or time.perf_counter() < inline_until
                ):
                    self._pump_inline(agent, transfer, 1)  # the fast path: small transfers finish here
                # (a bigger first slice, or a late one of a batch, is posted by the poller)
                if transfer.core.state is TransferState.POSTING:
                    posting = True
                    if hot_from > -_NEVER:
                        hot_from = min(hot_from, self._hot_from(transfer, clock))
        except BaseException:
            # Give back the room admitted for rows that never became transfers (those that did
            # give theirs back when they end, as usual).
            for ids in ([unheld] if unheld is not None else []) + [row[0] for row in rows]:
                if len(ids):
                    self._admission.release(len(ids) * piece_len)
            raise
        finally:
            self._stats.counters["transfers_submitted"] += len(started) - notify_only
            if posting:
                self._pacer.activity(loop.time())
                self._submitted_hot_from = min(self._submitted_hot_from, hot_from)
                if hot_from == -_NEVER:
                    self._wakeup()  # a slice still to post
                else:
                    self._check_by(hot_from)
        return started

    def submit_batch(
        self,
        op: str,
        peer: Peer,
        local_dlist: Any,
        remote_dlist: Any,
        rows: tuple[IdArray | list[IdArray], IdArray | list[IdArray]],
        descriptors: int,
        nbytes: int,
        deadline: float | None,
        lease_deadline: float | None,
        route: Route,
    ) -> TransferBatch:
        """Start an admitted batch: row i of `rows` (local, remote descriptor ids) is one request.

        Rows are posted here for one sweep's budget; the poller posts the rest, yielding as it goes.
        """
        agent, loop, config = self.agent, self.loop, self._config
        assert agent is not None and loop is not None
        now = loop.time()
        try:  # (until the batch is active, the room admitted for it is given back here)
            first = earliest(deadline, lease_deadline)
            self._expect(peer, now, first)
            transfer_id = next(self._ids)
            batch = TransferBatch(
                rows_local=rows[0],
                rows_remote=rows[1],
                descriptors=descriptors,
                transfer_id=transfer_id,
                op=op,
                peer=peer.engine_id,
                remote_agent=peer.agent_name,
                local_dlist=local_dlist,
                remote_dlist=remote_dlist,
                notify=None,
                nbytes=nbytes,
                deadline=first,
                submitted_at=now,
                future=TransferFuture(loop=loop, transfer_id=transfer_id, on_cancel=self._awaiter_cancelled_cb),
                cancel_cb=self._end_cb,
                link=peer.link,
                copy_rate=self.copy_rates.of(route),
                release_grace_s=config.release_grace_s,
            )
        except BaseException:
            self._admission.release(nbytes, count=len(rows[0]))
            raise
        batch.lease_deadline, batch.timeout_deadline = lease_deadline, deadline
        self.active[transfer_id] = batch  # from here on `_retire` gives the admitted room back
        if (collected := COLLECTOR.get()) is not None:
            collected.append(batch)
        self._stats.counters["transfers_submitted"] += 1
        self._stats.counters["batch_rows_submitted"] += batch.rows
        self._pump_inline(agent, batch, batch.rows, time.perf_counter() + _SWEEP_BUDGET_S)
        self._pacer.activity(loop.time())
        self._submitted_hot_from = -_NEVER  # (its rows left to post, or its first checks: the poller's)
        self._wakeup()
        return batch

    def _expect(self, peer: Peer, now: float, deadline: float | None) -> None:
        """Before a submit: hint `peer` that transfers are coming, and make sweeps watch for `deadline`."""
        if peer.link.busy_hint_due(now):
            self._send_busy_hint(peer)
        if deadline is not None and deadline < self._next_deadline:
            self._next_deadline = deadline

    def _pump_inline(self, agent: OwnedAgent, transfer: Transfer, max_posts: int, until: float = _NEVER) -> None:
        """`pump` inside a submit. An error that is not NIXL's (NIXL's fail the transfer or a row) ends the
        transfer: slices may be in flight, so the caller gets it and hears the error once it is quiet,
        never an exception from the submit while bytes may still land in memory it thinks is free."""
        try:
            self.pump(agent, transfer, max_posts, until=until)
        except Exception as exc:
            log.error("posting transfer #%d to %s failed; ending it", transfer.id, transfer.peer, exc_info=exc)
            self.end(transfer, TransferFailed(f"posting failed: {type(exc).__name__}: {exc}",
                                              transfer_id=transfer.id, peer=transfer.peer))  # fmt: skip

    def notify_only(self, op: str, peer: Peer, notify: bytes | None) -> Transfer:
        """A transfer with no blocks (a full prefix-cache hit): only the notification goes out."""
        assert self.loop is not None
        now = self.loop.time()
        self._table.touch(peer, now)  # (a use: a peer only notified is not evicted as idle)
        transfer = Transfer(
            transfer_id=next(self._ids),
            op=op,
            peer=peer.engine_id,
            remote_agent=peer.agent_name,
            local_dlist=None,
            remote_dlist=None,
            local_ids=_EMPTY_IDS,
            remote_ids=_EMPTY_IDS,
            per_slice=1,
            notify=notify,
            nbytes=0,
            deadline=None,
            submitted_at=now,
            future=TransferFuture(loop=self.loop),
            cancel_cb=self._end_cb,
            link=peer.link,
        )
        try:
            if notify is not None:
                self._notify.send(peer, notify)
                self._notify.sent(now)
        except NOTIFY_ERRORS as exc:
            if not isinstance(exc, zmq.Again):  # (a full queue is no fault of the peer's)
                peer.stale = True  # a restarted peer, a dropped agent: the next connect() handshakes again
            error = NotificationFailed(f"notification to {peer.engine_id} failed: {exc}",
                                   transfer_id=transfer.id, peer=peer.engine_id)  # fmt: skip
            transfer.core.end(error, now)
            transfer.mark_quiet()
            transfer.finish(error)
            return transfer
        transfer.core.succeed()
        transfer.mark_quiet()
        transfer.finish(TransferResult(transfer.id, op, peer.engine_id, 0, 0, 0, 0.0, notify is not None))
        return transfer

    # -- ending -------------------------------------------------------------------------------
    def end(self, transfer: Transfer, error: TransferError) -> None:
        """End a transfer with an error: post nothing more; the caller hears once it is quiet."""
        assert self.loop is not None
        self._apply(transfer, transfer.core.end(error, self.loop.time()))
        if transfer.core.state is TransferState.RELEASING:
            self._wakeup()  # the poller watches its running slices until they end

    def end_all(self, make_error: Callable[[Transfer], TransferError], agent_name: str | None = None) -> None:
        """End every active transfer (or those with `agent_name`) with `make_error(transfer)`."""
        for transfer in list(self.active.values()):
            if agent_name is None or transfer.remote_agent == agent_name:
                self.end(transfer, make_error(transfer))

    def fence_releasing(self, now: float = _NEVER) -> None:
        """Report fenced every ended transfer NIXL still holds past its grace at `now` (by default,
        whatever its grace: the engine is closing). Sweeps do this for the transfers they watch; a
        poller whose sweeps keep breaking calls it, or their callers would wait for ever."""
        for transfer in list(self.active.values()):
            self._apply(transfer, transfer.core.tick(now))

    def _on_awaiter_cancelled(self, transfer_id: int) -> None:
        """A task awaiting the transfer was cancelled (see `TransferFuture`): end the transfer."""
        transfer = self.active.get(transfer_id)
        if transfer is not None:
            transfer.cancel("the awaiting task was cancelled")

    # -- the sweep ------------------------------------------------------------------------------
    async def sweep(self, agent: OwnedAgent, loop: asyncio.AbstractEventLoop) -> bool:
        """Advance every live transfer once; end those past their deadline. Returns whether anything moved."""
        activity = False
        swept = time.perf_counter()
        started = loop.time()
        renew_hints = started >= self._hints_checked_at + _HINT_CHECK_S  # not on every sweep: 10 k transfers
        if renew_hints:
            self._hints_checked_at = started
        finished = False
        hot_from = self._submitted_hot_from = _NEVER
        small_post = self._config.min_post_bytes
        live = self.live()
        last = len(live)
        for n, transfer in enumerate(live, 1):
            if finished and transfer.core.wants_post and transfer.post_bytes > small_post:
                # Let the awaiters of finished transfers run (and submit their next) before a post,
                # which can be a copy of a few ms. With nothing to post, one sweep ends them all;
                # small posts (a batch's rows the submit left to us) wait for the sweep's budget.
                await asyncio.sleep(0)
                finished = False
                swept = time.perf_counter()
            if transfer.quiet:
                continue  # ended while we yielded
            if type(transfer) is TransferBatch:  # its rows, for what is left of the sweep's budget
                pumped = self.pump(agent, transfer, transfer.rows, swept, swept + _SWEEP_BUDGET_S)
            else:
                pumped = self.pump(agent, transfer, 1, swept)
            if pumped:
                activity = True
                finished = finished or transfer.done()
            if transfer.state is TransferState.RELEASING:  # past its grace it is reported fenced
                self._apply(transfer, transfer.core.tick(loop.time()))
            if transfer.id in self.active:  # fenced ones never keep the poller hot
                if renew_hints and transfer.link.busy_hint_due(started):  # a long transfer: renew it
                    self._send_busy_hint(self._table.of_agent(transfer.remote_agent))
                if hot_from > -_NEVER:
                    hot_from = min(hot_from, self._hot_from(transfer, swept))
            # A post can be a multi-ms copy, and 10k state checks add up: bound the stall. (After
            # the last transfer the poller yields anyway: a second yield costs a loop iteration.)
            if (activity or not n % 256) and n < last and time.perf_counter() - swept > _SWEEP_BUDGET_S:
                await asyncio.sleep(0)
                swept = time.perf_counter()
        self.hot_from = min(hot_from, self._submitted_hot_from)
        now = loop.time()
        if now >= self._next_deadline:
            self._expire(now)
        return activity

    @staticmethod
    def _hot_from(transfer: Transfer, now: float) -> float:
        """When the poller should start checking `transfer` on every turn (-_NEVER: now, it wants a post;
        _NEVER: not any more, it is long overdue at `now`, a recent `perf_counter`)."""
        if not transfer.first_post_at or transfer.core.can_post_now:
            return -_NEVER
        start, stop = transfer.link.wire.spin_window(transfer.first_post_at, transfer.nbytes, _HOT_MARGIN_S)
        return start if now < stop else _NEVER

    def _send_busy_hint(self, peer: Peer | None) -> None:
        """Keep `peer` progressing its worker while transfers with it may be in flight (see `LinkRates`)."""
        if peer is not None:
            self._notify.hint_busy(peer, LinkRates.BUSY_HINT_S)

    def _expire(self, now: float) -> None:
        """End transfers past their deadline; remember the next deadline so sweeps skip this."""
        posting = [t for t in self.active.values() if t.state is TransferState.POSTING]
        for transfer in [t for t in posting if t.deadline is not None and now >= t.deadline]:
            self._timed_out(transfer)
        self._next_deadline = min(
            (t.deadline for t in self.active.values() if t.deadline is not None and t.state is TransferState.POSTING),
            default=_NEVER,
        )

    def _timed_out(self, transfer: Transfer) -> None:
        assert self.loop is not None
        if transfer.lease_deadline is not None and self.loop.time() >= transfer.lease_deadline:
            self.end(transfer, LeaseExpired(f"the lease from {transfer.peer} ran out during the {transfer.op}",
                                            transfer_id=transfer.id, peer=transfer.peer))  # fmt: skip
            return
        self.end(transfer, TransferTimeout(f"{transfer.op} with {transfer.peer} missed its deadline",
                                           transfer_id=transfer.id, peer=transfer.peer))  # fmt: skip

    def renew_lease(self, transfer: Transfer, lease_deadline: float) -> bool:
        """The producer moved `transfer`'s lease to `lease_deadline` (loop time); its deadline follows,
        never past the caller's own. Ended at once if that is past. False: no lease, or already ended."""
        assert self.loop is not None
        if (transfer.lease_deadline is None or transfer.core.state is not TransferState.POSTING
                or self.active.get(transfer.id) is not transfer):  # fmt: skip
            return False
        transfer.lease_deadline = lease_deadline
        transfer.deadline = earliest(transfer.timeout_deadline, lease_deadline)
        if self.loop.time() >= lease_deadline:
            self._timed_out(transfer)
        elif transfer.deadline is not None and transfer.deadline < self._next_deadline:
            self._next_deadline = transfer.deadline
        return True

    def pump(self, agent: OwnedAgent, transfer: Transfer, max_posts: int, swept: float = 0.0,
             until: float = _NEVER) -> bool:  # fmt: skip
        """Advance one transfer: check its running slices, post new ones (at most `max_posts`).

        `swept` is when the poller's sweep began, recorded while slices are in flight. `until`
        (perf_counter time) bounds a batch's checks and posts: past it, the rest wait for the
        next sweep (a batch's core moves each checked row behind those not yet checked). Checks
        and posts each get at least half a budget, so a batch behind others that used the sweep's
        time still moves (without it, one check per sweep: its rows seen landed seconds late).
        Returns whether anything moved (a slice ended or was posted, or the transfer ended).
        """
        core = transfer.core
        base = transfer.id * _SLICE_KEY
        moved = False
        bounded = until < _NEVER
        if bounded:
            until = max(until, time.perf_counter() + _SWEEP_BUDGET_S / 2)
        for index in core.running_list():
            try:
                state = agent.state(self._handles[base + index])
            except NIXL_ERRORS as exc:
                state = f"ERR ({exc})"
            if state != "PROC":
                moved = True
                self._apply(transfer, core.checked(index, state))
            elif bounded:
                core.checked(index, state)
            if bounded and time.perf_counter() > until:
                break
        if core.has_running:
            transfer.last_pending_at = swept
        for index in core.to_release():  # releases NIXL refused earlier
            self._apply(transfer, [Release(index)])
        chained = transfer.op == "WRITE" and transfer.notify is not None
        last = transfer.num_slices - 1
        if bounded:  # posts get time of their own, as checks did
            until = max(until, time.perf_counter() + _SWEEP_BUDGET_S / 2)
        for posts in range(max_posts):
            if core.state is not TransferState.POSTING or (posts and bounded and time.perf_counter() > until):
                break
            if not core.can_post_now:
                break
            if transfer.deadline is not None and self.loop is not None and self.loop.time() >= transfer.deadline:
                # Nothing is posted past it (a sweep checks deadlines after its posts). Checked before a
                # slice is handed out: one handed out counts as posted (`slices_posted`).
                self._timed_out(transfer)
                return True
            if not (next_slice := core.to_post(1)):
                break
            index = next_slice[0]
            # A WRITE's notification rides on its last slice (NIXL orders it after the data at
            # the target). A READ's is sent once the data has landed here: chained to the READ it
            # keeps the READ "PROC" until the *producer's* worker is progressed.
            notif = transfer.notify if chained and index == last else None
            lidx, ridx = transfer.slice_ids(index)
            # Only a post that may copy inline tells a copy rate: over a link whose posts return before
            # the data moves (TCP), its CPU clock is not read (two clock reads per post at 10 k in flight).
            timed = transfer.link.inline is not False
            started, cpu_started = time.perf_counter(), time.thread_time() if timed else 0.0
            if not transfer.first_post_at:
                transfer.first_post_at = started
            try:
                handle = agent.make_xfer(transfer.op, transfer.local_dlist, lidx, transfer.remote_dlist, ridx,
                                         notif or b"")  # fmt: skip
            except Exception as exc:  # a transfer ends here; a batch's row fails alone, the next one goes on
                moved = True  # (NIXL's errors, or a binding refusing an argument: NIXL took nothing)
                self._apply(transfer, core.post_failed(index, str(exc) if isinstance(exc, NIXL_ERRORS) else repr(exc)))
                continue
            self._handles[base + index] = handle
            # The core counts the handle running before the post: whatever raises from here on (a
            # KeyboardInterrupt, a bug), the transfer's end watches it until NIXL says it ended and
            # releases it then (not posted: NIXL says NOT_POSTED), never while bytes may still land.
            core.posted(index, "PROC")
            try:
                state = agent.post(handle)
            except NIXL_ERRORS as exc:
                state = f"ERR ({exc})"
            took = time.perf_counter() - started
            copy_s = time.thread_time() - cpu_started if timed else 0.0
            actions = core.checked(index, state)
            transfer.post_seconds += took
            self._stats.histograms["post_us"].record(took)
            moved = True
            if state == "DONE" and timed and transfer.copy_rate is not None:  # copied inside the call: a copy rate
                # The copy is this thread's CPU time; the rest is waiting (for the GIL, mostly). Counted
                # as copying, that wait shrank the slices, and smaller slices meant more waits (H100,
                # 1 GiB read beside a busy Python thread: 1 MiB slices, 0.1 GB/s).
                transfer.copy_rate.observe(len(lidx) * transfer.piece_len, copy_s, took)
            if not notif:  # (a notification can keep a post in flight that copied inline)
                transfer.link.posted(state)
            self._apply(transfer, actions)
        return moved

    # -- carrying out actions -------------------------------------------------------------------
    def _apply(self, transfer: Transfer, actions: list[Action]) -> None:
        """Carry out what a transfer's state machine asked for."""
        for action in actions:
            match action:
                case Release(index=index):
                    key = transfer.id * _SLICE_KEY + index
                    handle = self._handles.get(key)
                    ok = handle is None or self._agent().release_xfer(handle)
                    if ok:
                        self._handles.pop(key, None)
                    self._apply(transfer, transfer.core.released(index, ok))
                case Complete():
                    self._apply(transfer, self._check_complete(transfer))
                case Finish(error=None):
                    self._complete(transfer)
                case Finish(error=TransferError() as error):
                    self._failed(transfer, error)
                case Fenced(error=error):
                    error.quiet = transfer.wait_quiet
                    # Its room stays taken until NIXL lets go (Quiet): the admission limits bound what
                    # NIXL holds, and a stalled peer's fenced reads must not make room for more of them.
                    self.active.pop(transfer.id, None)
                    self.fenced[transfer.id] = transfer
                    self._stats.counters["transfers_fenced"] += 1
                    log.warning("transfer #%d with %s: %s", transfer.id, transfer.peer, error)
                    transfer.finish(error)
                case Quiet():
                    if self.fenced.pop(transfer.id, None) is not None:
                        self._give_room_back(transfer)
                    self._stats.counters["transfers_unfenced"] += 1
                    transfer.mark_quiet()

    def _agent(self) -> OwnedAgent:
        assert self.agent is not None
        return self.agent

    def _check_complete(self, transfer: Transfer) -> list[Action]:
        """Every byte arrived: refuse data that came past the lease, send a READ's notification."""
        assert self.loop is not None
        core = transfer.core
        if transfer.lease_deadline is not None and self.loop.time() >= transfer.lease_deadline:
            # The data arrived, but maybe after the producer reused the blocks: not to be trusted.
            expired = LeaseExpired(f"the lease from {transfer.peer} ran out during the {transfer.op}",
                                   peer=transfer.peer, transfer_id=transfer.id)  # fmt: skip
            return core.end(expired, self.loop.time())
        transfer.done_seen_at = time.perf_counter()
        if transfer.op == "READ" and transfer.notify is not None:
            try:
                peer = self._table.of_agent(transfer.remote_agent)
                if peer is None:
                    raise KeyError(f"no connected peer has agent {transfer.remote_agent}")
                self._notify.send(peer, transfer.notify)
            except NOTIFY_ERRORS as exc:
                error = NotificationFailed(f"the data was read, but notifying {transfer.peer} failed: {exc}",
                                           transfer_id=transfer.id, peer=transfer.peer)  # fmt: skip
                error.result = self._result(transfer, self.loop.time(), notified=False)  # the blocks hold the data
                return core.end(error, self.loop.time())
        return core.succeed()

    def _result(self, transfer: Transfer, now: float, *, notified: bool) -> TransferResult:
        return TransferResult(
            transfer.id,
            transfer.op,
            transfer.peer,
            transfer.nbytes,
            transfer.descriptors,
            transfer.num_slices,
            now - transfer.submitted_at,
            notified,
            transfer.post_seconds,
            transfer.done_seen_at - (transfer.first_post_at or transfer.done_seen_at),
        )

    def _complete(self, transfer: Transfer) -> None:
        assert self.loop is not None
        if transfer.first_post_at and transfer.core.error is None:  # (one ended meanwhile measures a stall)
            transfer.link.wire.observe(transfer.nbytes, transfer.done_seen_at - transfer.first_post_at)
        now = self.loop.time()
        elapsed = now - transfer.submitted_at
        self._retire(transfer)
        if (peer := self._table.of_agent(transfer.remote_agent)) is not None:
            self._table.touch(peer, now)  # a transfer longer than the TTL is still use
        counters = self._stats.counters
        counters["transfers_done"] += 1
        counters["bytes_" + transfer.op.lower()] += transfer.nbytes
        if transfer.notify is not None:
            self._notify.sent(now)
        self._stats.histograms["transfer_us"].record(elapsed)
        transfer.mark_quiet()
        transfer.finish(self._result(transfer, now, notified=transfer.notify is not None))

    def _failed(self, transfer: Transfer, error: TransferError) -> None:
        """A transfer ended with `error` and its memory is quiet: tell the caller."""
        self._retire(transfer)
        if isinstance(error, TransferFailed):
            peer = self._table.of_agent(transfer.remote_agent)
            if peer is not None:
                peer.stale = True  # the next connect() handshakes again
        kind = {TransferState.CANCELLED: "cancelled", TransferState.TIMED_OUT: "timeouts"}.get(
            transfer.state, "failures"
        )
        self._stats.counters["transfers_" + kind] += 1
        transfer.mark_quiet()
        transfer.finish(error)

    def _retire(self, transfer: Transfer) -> None:
        if self.active.pop(transfer.id, None) is not None:
            self._give_room_back(transfer)

    def _give_room_back(self, transfer: Transfer) -> None:
        self._admission.release(transfer.nbytes, count=transfer.admitted)
