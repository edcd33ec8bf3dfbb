"""The transfer handle callers hold, and how a transfer is cut into posts.

A transfer is posted in *slices* of bounded bytes and descriptors. Over UCX's CMA transport
`transfer()` is a synchronous copy done inside the call, so one 256 MiB post would freeze the
event loop for ~55 ms; the engine sizes slices to about 2 ms of copying at the rate it measured
on recent posts, which bounds every stall while costing ~50 us of NIXL overhead per slice.
A notification rides on the last slice only, which is
posted after every other slice is done, so the receiver never hears "done" before the data is.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Generator
from typing import Any

import msgspec

from .exceptions import TransferCancelled, TransferTimeout
from .layout import IdArray

__all__ = ["Transfer", "TransferResult", "TransferState", "plan_slices"]


class TransferState(enum.StrEnum):
    POSTING = "posting"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


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


def plan_slices(
    local_ids: IdArray, remote_ids: IdArray, piece_len: int, max_bytes: int, max_descriptors: int
) -> list[tuple[IdArray, IdArray]]:
    """Cut paired descriptor ids into slices of at most `max_bytes` and `max_descriptors`."""
    per_slice = max(1, min(max_descriptors, max_bytes // max(piece_len, 1)))
    n = len(local_ids)
    if n <= per_slice:
        return [(local_ids, remote_ids)]
    return [(local_ids[i : i + per_slice], remote_ids[i : i + per_slice]) for i in range(0, n, per_slice)]


class Transfer:
    """A submitted read or write. Await it (or `wait()`) for its `TransferResult`.

    Awaiting raises `TransferFailed`, `TransferTimeout` or `TransferCancelled`. Awaiting is
    awaiting its future, so cancelling the awaiting task (``asyncio.timeout``, a TaskGroup)
    cancels the future, and the engine's poller then stops the transfer and releases its NIXL
    handles on its next sweep. Use it from the engine's loop only.
    """

    __slots__ = (
        "_cancel_cb",
        "_future",
        "deadline",
        "descriptors",
        "done_seen_at",
        "id",
        "last_pending_at",
        "lease_deadline",
        "local_dlist",
        "nbytes",
        "next_slice",
        "notify",
        "op",
        "peer",
        "piece_len",
        "post_seconds",
        "posted",
        "remote_agent",
        "remote_dlist",
        "slices",
        "slices_done",
        "state",
        "submitted_at",
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
        slices: list[tuple[IdArray, IdArray]],
        notify: bytes | None,
        nbytes: int,
        deadline: float | None,
        submitted_at: float,
        future: asyncio.Future[TransferResult],
        cancel_cb: Callable[[Transfer, BaseException], None],
    ) -> None:
        self.id = transfer_id
        self.op = op
        self.peer = peer
        self.remote_agent = remote_agent
        self.local_dlist = local_dlist
        self.remote_dlist = remote_dlist
        self.slices = slices
        self.notify = notify
        self.nbytes = nbytes
        self.descriptors = int(sum(len(s[0]) for s in slices))
        self.piece_len = nbytes // self.descriptors if self.descriptors else 0
        self.deadline = deadline
        self.lease_deadline: float | None = None  # loop time past which the producer may reuse its blocks
        self.submitted_at = submitted_at
        self.state = TransferState.POSTING
        self.post_seconds = 0.0
        self.next_slice = 0
        self.slices_done = 0
        self.posted: list[Any] = []  # NIXL handles in flight
        # perf_counter stamps: the last sweep that saw a slice still in flight, and when the last
        # slice was seen DONE. The true completion lies between them (benchmarks use this).
        self.last_pending_at = 0.0
        self.done_seen_at = 0.0
        self._future = future
        self._cancel_cb = cancel_cb

    def __repr__(self) -> str:
        return (
            f"<Transfer #{self.id} {self.op} peer={self.peer} {self.nbytes}B "
            f"{self.slices_done}/{len(self.slices)} slices {self.state}>"
        )

    def done(self) -> bool:
        return self._future.done()

    def result(self) -> TransferResult:
        """The result of a finished transfer (raises its error; `InvalidStateError` if running)."""
        return self._future.result()

    def exception(self) -> BaseException | None:
        return self._future.exception()

    @property
    def future(self) -> asyncio.Future[TransferResult]:
        """The underlying future, for bulk waits (``asyncio.wait``/``gather`` over many transfers)."""
        return self._future

    def cancel(self, reason: str = "cancelled by caller") -> bool:
        """Cancel the transfer and release its handles. False if it had already finished."""
        if self.state is not TransferState.POSTING:
            return False
        self._cancel_cb(self, TransferCancelled(reason, transfer_id=self.id, peer=self.peer))
        return True

    async def wait(self, timeout: float | None = None) -> TransferResult:
        """Wait for completion; on `timeout` the transfer is cancelled and `TransferTimeout` raised."""
        if timeout is None or self._future.done():
            return await self._future
        try:
            async with asyncio.timeout(timeout):
                # shielded: the timeout must not cancel the future, so that it is recorded as a
                # timeout here rather than as a cancelled awaiter by the poller
                return await asyncio.shield(self._future)
        except TimeoutError:
            error = TransferTimeout(f"transfer timed out after {timeout}s", transfer_id=self.id, peer=self.peer)
            self._cancel_cb(self, error)
            raise error from None
        except asyncio.CancelledError:  # the caller itself was cancelled: so is the transfer
            self.cancel("the awaiting task was cancelled")
            raise

    def __await__(self) -> Generator[Any, None, TransferResult]:
        return self._future.__await__()

    # -- used by the engine ---------------------------------------------------------------
    @property
    def is_last_slice_next(self) -> bool:
        return self.next_slice == len(self.slices) - 1

    def finish(self, result: TransferResult | BaseException) -> None:
        if self._future.done():  # cancelled by an awaiter: the state already says so
            return
        if isinstance(result, BaseException):
            self._future.set_exception(result)
            # Mark retrieved: a caller that never awaits a failed transfer is not an error.
            self._future.exception()
        else:
            self._future.set_result(result)
