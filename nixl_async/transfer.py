"""The transfer handle callers hold, and how a transfer is cut into posts.

A transfer is posted in *slices* of bounded bytes and descriptors. Over UCX's CMA transport
`transfer()` is a synchronous copy done inside the call, so one 256 MiB post would freeze the
event loop for ~55 ms; the engine sizes slices to about 2 ms of copying at the rate it measured
on recent posts, which bounds every stall while costing ~50 us of NIXL overhead per slice.
A notification rides on the last slice only, which is
posted after every other slice is done, so the receiver never hears "done" before the data is.

A `Transfer` is the caller's handle; what its slices are doing lives in a `TransferCore`
(`_state.py`). Its future is resolved only when the transfer's memory is quiet: after an error
(deadline, cancellation, peer failure, close) the caller hears of it once NIXL holds none of its
handles, or with `TransferFenced` if that takes longer than the grace. A `TransferBatch` is a
transfer whose slices are independent rows (`_batch_state.py`), for thousands of small ones at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Generator, Iterable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from ._batch_state import BatchCore
from ._state import SliceCore, TransferCore, TransferState
from .exceptions import TransferCancelled, TransferError, TransferTimeout
from .layout import DescIds, IdArray

if TYPE_CHECKING:
    from ._slicing import CopyRate, LinkRates

_NO_IDS: IdArray = np.empty(0, dtype=np.int64)

__all__ = ["Transfer", "TransferBatch", "TransferFuture", "TransferResult", "TransferState", "descriptors_per_slice"]


class TransferResult(msgspec.Struct, frozen=True):
    """What a completed transfer did."""

    transfer_id: int
    op: str
    peer: str
    nbytes: int
    descriptors: int
    slices: int
    seconds: float
    notified: bool
    post_seconds: float = 0.0  # time spent inside NIXL's post calls (a CMA post is the copy itself)
    # From the first post to the last slice seen DONE: the time NIXL had it, without admission
    # waits or queueing before the first post (what NIXL's own telemetry calls a transfer's duration).
    wire_seconds: float = 0.0


def descriptors_per_slice(piece_len: int, max_bytes: int, max_descriptors: int) -> int:
    """How many descriptors of `piece_len` bytes one slice carries: at most `max_bytes` and `max_descriptors`."""
    return max(1, min(max_descriptors, max_bytes // max(piece_len, 1)))


class TransferFuture(asyncio.Future[TransferResult]):
    """The future a `Transfer` resolves: cancelling it ends the transfer instead of abandoning it.

    A task awaiting a transfer that gets cancelled (``task.cancel()``, ``asyncio.timeout``, a
    TaskGroup) cancels the future it waits on. A plain future would report "cancelled" at once
    while NIXL may still be writing into the transfer's memory. This one refuses: it asks the
    engine to end the transfer, and the task (which asyncio marks to be cancelled) resumes with
    `CancelledError` only when the future resolves -- once the memory is quiet or reported fenced,
    bounded by `EngineConfig.release_grace_s`. The normal path costs nothing extra.

    Python 3.11's ``asyncio.wait_for(transfer.future, t)`` cancels the future, then returns what it
    resolves to: `TransferCancelled` (or the result), not `TimeoutError`. Bound a wait with
    ``transfer.wait(timeout)``, ``asyncio.timeout`` or `wait_all` instead.
    """

    # Set by the engine: on_cancel(transfer_id). No reference to the Transfer itself, so no cycle
    # keeps finished transfers alive until the garbage collector runs. Slots: no per-future dict.
    __slots__ = ("on_cancel", "transfer_id")

    def __init__(self, *, loop: asyncio.AbstractEventLoop, transfer_id: int = 0,
                 on_cancel: Callable[[int], object] | None = None) -> None:  # fmt: skip
        super().__init__(loop=loop)
        self.transfer_id = transfer_id
        self.on_cancel = on_cancel

    def cancel(self, msg: Any | None = None) -> bool:
        if self.on_cancel is not None and not self.done():
            self.on_cancel(self.transfer_id)
        return False


class Transfer:
    """A submitted read or write. Await it (or `wait()`) for its `TransferResult`.

    Awaiting raises `TransferFailed`, `TransferTimeout`, `TransferCancelled` or `LeaseExpired`
    once NIXL no longer touches the transfer's memory, or `TransferFenced` when NIXL kept a
    handle past `EngineConfig.release_grace_s` (the memory may still be touched: see
    `wait_quiet`). Cancelling the awaiting task (``asyncio.timeout``, a TaskGroup) ends the
    transfer, and the cancellation propagates once the same release happened (bounded by the
    grace): see `TransferFuture`. Use it from the engine's loop only.
    """

    __slots__ = (
        "_abandoned",
        "_cancel_cb",
        "_future",
        "_is_quiet",
        "_quiet",
        "copy_rate",
        "core",
        "deadline",
        "descriptors",
        "done_seen_at",
        "first_post_at",
        "id",
        "last_pending_at",
        "lease_deadline",
        "link",
        "local_dlist",
        "local_ids",
        "nbytes",
        "notify",
        "num_slices",
        "op",
        "peer",
        "per_slice",
        "piece_len",
        "post_seconds",
        "remote_agent",
        "remote_dlist",
        "remote_ids",
        "submitted_at",
        "timeout_deadline",
    )

    def __init__(
        self,
        *,
        transfer_id: int,
        op: str,
        peer: str,
        remote_agent: str,
        local_dlist: Any,
        remote_dlist: Any,
        local_ids: DescIds,
        remote_ids: DescIds,
        per_slice: int,
        notify: bytes | None,
        nbytes: int,
        deadline: float | None,
        submitted_at: float,
        future: asyncio.Future[TransferResult],
        cancel_cb: Callable[[Transfer, TransferError], None],
        link: LinkRates,
        copy_rate: CopyRate | None = None,
        slices_in_flight: int = 2,
        release_grace_s: float = 1.0,
        core: SliceCore | None = None,
    ) -> None:
        self.id = transfer_id
        self.op = op
        self.peer = peer
        self.remote_agent = remote_agent
        self.link = link  # the peer's: learns from this transfer's posts and completion
        self.copy_rate = copy_rate  # its route's: learns from posts that copy inline (None: no bytes)
        self.local_dlist = local_dlist
        self.remote_dlist = remote_dlist
        # Descriptor ids, posted `per_slice` at a time (views are cut when a slice is posted:
        # with 10 k transfers in flight, fewer live containers means cheaper garbage collections).
        self.local_ids = local_ids
        self.remote_ids = remote_ids
        self.per_slice = per_slice
        self.descriptors = len(local_ids)
        self.num_slices = -(-self.descriptors // per_slice)
        self.notify = notify
        self.nbytes = nbytes
        self.piece_len = nbytes // self.descriptors if self.descriptors else 0
        self.deadline = deadline
        self.lease_deadline: float | None = None  # loop time past which the producer may reuse its blocks
        self.timeout_deadline = deadline  # the caller's own: a renewed lease moves `deadline` up to it
        self.submitted_at = submitted_at
        self.post_seconds = 0.0
        self.first_post_at = 0.0  # perf_counter at the first post (0: not posted yet)
        self.core: SliceCore = core or TransferCore(
            self.num_slices,
            max_running=slices_in_flight,
            grace_s=release_grace_s,
            chain_last=op == "WRITE" and notify is not None,
            op=op,
            peer=peer,
            transfer_id=transfer_id,
        )
        # perf_counter stamps: the last sweep that saw a slice still in flight, and when the last
        # slice was seen DONE. The true completion lies between them (benchmarks use this).
        self.last_pending_at = 0.0
        self.done_seen_at = 0.0
        self._future = future
        self._is_quiet = False
        self._abandoned = False  # the engine closed with NIXL still holding it: never quiet
        self._quiet: asyncio.Future[None] | None = None  # made only when someone waits for it
        self._cancel_cb = cancel_cb

    def __repr__(self) -> str:
        return (
            f"<Transfer #{self.id} {self.op} peer={self.peer} {self.nbytes}B "
            f"{self.core.slices_done}/{self.num_slices} slices {self.state}>"
        )

    admitted = 1  # transfers' room it holds in the engine's admission (a batch: one per row)

    @property
    def post_bytes(self) -> int:
        """Bytes one post of this transfer moves at most (its first slice)."""
        return min(self.per_slice, self.descriptors) * self.piece_len

    def slice_ids(self, index: int) -> tuple[DescIds, DescIds]:
        """Slice `index`'s (local, remote) descriptor ids."""
        if self.num_slices == 1:
            return self.local_ids, self.remote_ids
        start = index * self.per_slice
        return self.local_ids[start : start + self.per_slice], self.remote_ids[start : start + self.per_slice]

    @property
    def state(self) -> TransferState:
        return self.core.state

    @property
    def slices_done(self) -> int:
        """Slices that arrived while the transfer ran (those ending DONE after an error are not counted)."""
        return self.core.slices_done

    @property
    def slices_posted(self) -> int:
        """Slices handed to NIXL so far (quiet, with `slices_errored` 0 and every slice posted, a WRITE's
        notification, riding its last slice, reached the target however the transfer was reported)."""
        return self.core.slices_posted

    @property
    def quiet(self) -> bool:
        """NIXL holds none of this transfer's handles: its memory is the caller's again."""
        return self._is_quiet

    @property
    def slices_errored(self) -> int:
        """Slices (a batch: rows) NIXL ended in an error state, or whose post failed.

        Once `quiet`, 0 says every slice posted ended DONE. For a WRITE with NIXL's UCX backend
        that means the peer acknowledged its bytes and none comes later (the backend reports a
        WRITE done only after flushing the endpoint), even if the transfer was cancelled. A
        slice that ended in error may have sent bytes that the peer's UCX worker still places
        after NIXL let go of it: a peer lending those blocks to someone else should wait a margin.
        """
        return self.core.slices_errored

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> TransferResult:
        """The result of a finished transfer (raises its error; `InvalidStateError` if running)."""
        return self._future.result()

    def exception(self) -> BaseException | None:
        return self._future.exception()

    @property
    def future(self) -> asyncio.Future[TransferResult]:
        """The underlying future, for ``asyncio.wait`` over many transfers. To await them all, use
        `wait_all`: ``asyncio.gather`` returns at the first error or cancellation while the others
        still move bytes."""
        return self._future

    def cancel(self, reason: str = "cancelled by caller") -> bool:
        """Cancel the transfer: nothing more is posted, its handles are released once NIXL lets go.

        Returns at once (False if it had already ended); await the transfer (or `wait_quiet`) to
        know when its memory is quiet. A WRITE whose last slice, carrying its notification, is
        already out completes all the same if every slice lands (the target was told it did).
        """
        if self.state is not TransferState.POSTING:
            return False
        self._cancel_cb(self, TransferCancelled(reason, transfer_id=self.id, peer=self.peer))
        return True

    async def wait_quiet(self, timeout: float | None = None) -> bool:
        """Wait until NIXL holds none of this transfer's handles; False if `timeout` passed first.

        Also False (at once) once the engine has closed with NIXL still holding one: nothing
        checks it any more, so its memory stays fenced (the engine keeps it alive) for good.
        """
        if self._is_quiet:
            return True
        if self._abandoned:
            return False
        if self._quiet is None:
            self._quiet = self._future.get_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._quiet)
        except TimeoutError:
            return False
        return self._is_quiet

    async def wait(self, timeout: float | None = None) -> TransferResult:
        """Wait for completion; on `timeout` the transfer is ended and `TransferTimeout` raised (a WRITE
        whose notifying last slice is already out completes all the same if it lands: see `cancel`).

        As with awaiting, the error is raised once the memory is quiet (or as `TransferFenced`).
        """
        if timeout is None or self._future.done():
            return await self
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(self._future)  # shielded: a timeout here is a TransferTimeout
        except TimeoutError:
            if self.state is TransferState.POSTING:
                error = TransferTimeout(f"transfer timed out after {timeout}s", transfer_id=self.id, peer=self.peer)
                self._cancel_cb(self, error)
        except asyncio.CancelledError:
            self.cancel("the awaiting task was cancelled")
            with contextlib.suppress(TransferError):  # the transfer's own outcome: the cancellation wins
                await self._outcome()
            raise
        return await self._outcome()

    def __await__(self) -> Generator[Any, None, TransferResult]:
        return self._future.__await__()

    async def _outcome(self) -> TransferResult:
        """The result once the future is resolved; cancellations meanwhile wait too (the grace bounds it)."""
        if await _until_resolved([self._future]):
            raise asyncio.CancelledError
        return self._future.result()

    # -- used by the engine ---------------------------------------------------------------
    def finish(self, result: TransferResult | BaseException) -> None:
        """Resolve the caller's future (a success, an error, or `TransferFenced`)."""
        if self._future.done():  # told once: a fenced transfer turning quiet is not told again
            return
        if isinstance(result, BaseException):
            self._future.set_exception(result)
            # Mark retrieved: a caller that never awaits a failed transfer is not an error.
            self._future.exception()
        else:
            self._future.set_result(result)

    def mark_quiet(self) -> None:
        self._is_quiet = True
        self._wake_quiet_waiters()

    def abandon(self) -> None:
        """The engine closed with NIXL still holding this transfer: it will never be seen quiet."""
        self._abandoned = True
        self._wake_quiet_waiters()

    def _wake_quiet_waiters(self) -> None:
        if self._quiet is not None and not self._quiet.done():
            self._quiet.set_result(None)


class TransferBatch(Transfer):
    """Many independent reads (or writes) with one peer, one NIXL request per row, awaited as one.

    Made by `TransferEngine.start_read_batch`/`start_write_batch`. Every row may be in flight at
    once and each succeeds or fails alone; `arrived()` says which rows have landed so far.
    Awaiting gives one `TransferResult` for all rows once every row ended and NIXL holds none of
    their handles (slices = rows). If some rows failed it raises `BatchRowsFailed` (naming them)
    instead; an error for the whole batch (deadline, cancellation, peer failure, close) raises as
    for a `Transfer`, with `TransferFenced` if a row's handle outlives the grace.
    """

    __slots__ = ("_rows_local", "_rows_remote")

    def __init__(
        self,
        *,
        rows_local: IdArray | list[IdArray],
        rows_remote: IdArray | list[IdArray],
        descriptors: int,
        **kwargs: Any,
    ) -> None:
        """`rows_local`/`rows_remote`: each row's descriptor ids; `kwargs` as for `Transfer` (no ids, no slicing)."""
        rows = len(rows_local)
        core = BatchCore(rows, grace_s=kwargs.get("release_grace_s", 1.0), op=kwargs["op"], peer=kwargs["peer"],
                         transfer_id=kwargs["transfer_id"])  # fmt: skip
        super().__init__(local_ids=_NO_IDS, remote_ids=_NO_IDS, per_slice=1, core=core, **kwargs)
        self._rows_local, self._rows_remote = rows_local, rows_remote
        self.num_slices, self.descriptors = rows, descriptors
        self.piece_len = self.nbytes // descriptors

    @property
    def rows(self) -> int:
        return self.num_slices

    @property
    def admitted(self) -> int:  # type: ignore[override]
        return self.num_slices

    @property
    def post_bytes(self) -> int:
        return len(self._rows_local[0]) * self.piece_len

    def slice_ids(self, index: int) -> tuple[DescIds, DescIds]:
        return self._rows_local[index], self._rows_remote[index]

    def arrived(self) -> np.ndarray:
        """One bool per row: its data landed and NIXL let go of it (a copy; rows only ever turn True)."""
        assert isinstance(self.core, BatchCore)
        return np.frombuffer(self.core.arrived, dtype=np.bool_).copy()

    def failed_rows(self) -> dict[int, str]:
        """Rows NIXL failed so far, with its answer: their blocks hold no trustworthy data."""
        assert isinstance(self.core, BatchCore)
        return self.core.failed_rows


async def wait_all(transfers: Iterable[Transfer]) -> list[TransferResult]:
    """Await every transfer: their results in order, or else an error once all ended (of the failed ones
    it first sees, the earliest in their order).

    ``asyncio.gather`` over their futures returns at the first error, or when its task is
    cancelled, while the other transfers still move bytes into memory the caller now takes for
    free. Here, once one fails or the awaiting task is cancelled, the others are cancelled too
    and the error (or the cancellation) is raised only when NIXL holds none of their memory, or
    each was reported fenced (bounded by `EngineConfig.release_grace_s`).
    """
    transfers = list(transfers)
    futures = [t._future for t in transfers]
    if not futures:
        return []
    try:
        await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
    except asyncio.CancelledError:
        for transfer in transfers:
            transfer.cancel("the task awaiting it was cancelled")
        await _until_resolved(futures)
        raise
    failed = next((t for t in transfers if t.done() and t.exception() is not None), None)
    if failed is None:
        return [t.result() for t in transfers]
    for transfer in transfers:
        transfer.cancel(f"transfer {failed.id}, awaited with it, failed")
    if await _until_resolved(futures):
        raise asyncio.CancelledError
    error = failed.exception()
    assert error is not None
    raise error


async def _until_resolved(futures: list[asyncio.Future[Any]]) -> bool:
    """Wait until every one of `futures` is resolved, also through cancellations (the transfers' grace
    bounds it); whether the waiting task was cancelled meanwhile."""
    cancelled = False
    while pending := [f for f in futures if not f.done()]:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
    return cancelled
