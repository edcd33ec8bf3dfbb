"""Admission: a strict FIFO over an in-flight count and an in-flight byte budget (asyncio, no NIXL).

Why FIFO: the engine used to wake every waiter on each retire and let them all re-race for room.
A small transfer fits in almost any gap, a large one only once most of the budget is free, so
while small transfers keep arriving the large one loses every race and can wait forever (and
every retire woke the whole herd to find that out). Here the queue decides, not the race:

- A waiter is admitted only at the head of the queue and only when it fits:
  ``count + 1 <= max_count and bytes + nbytes <= max_bytes``. A transfer larger than ``max_bytes``
  fits once nothing is in flight (an oversized transfer alone still goes). A batch of transfers
  waits as one waiter, for room for all of them (an oversized batch, too, goes alone).
- No barging: `acquire` queues whenever anyone is waiting, even if it would fit right now.
  The head's room is therefore never eaten by newcomers, so every waiter is admitted once
  the transfers ahead of it (in flight and queued) finish.
- A grant is a hand-off: `release` (or a waiter leaving the head) admits the head, then the
  next heads while they fit, by reserving their count and bytes and resolving their futures.
  Nobody else is woken, and a woken waiter never re-checks anything.
- A waiter that leaves (cancelled, or its deadline passed) is dropped from the queue; if it
  held up the head, the next head gets its chance at once. One granted and cancelled in the
  same tick (its future resolved, the task not yet resumed) gives the grant back.
- `close` admits every waiter at once and every later `acquire` returns at once, over the
  limits, so closing never hangs; the caller checks its own closed state right after.

Contract: every `acquire` that returns must be paired with exactly one `release` of the same
byte count, including when the caller fails between the two (e.g. because the engine closed).
"""

from __future__ import annotations

import asyncio
from collections import deque

__all__ = ["Admission"]

# Cancelled waiters are dropped lazily (skipped when they reach the head); the queue is
# compacted when more than this many, and more than half of it, are dead.
_COMPACT_AT = 64


class _Waiter:
    __slots__ = ("count", "future", "nbytes")

    def __init__(self, count: int, nbytes: int, future: asyncio.Future[None]) -> None:
        self.count = count  # transfers admitted together (a batch)
        self.nbytes = nbytes  # their bytes, all together
        self.future = future


class Admission:
    """Admit transfers in arrival order within `max_count` in flight and `max_bytes` in flight.

    Runs on one event loop; not thread-safe. Counters: `waits` (acquires that had to queue),
    `timeouts` (waiters whose deadline passed), `cancels` (waiters cancelled otherwise).
    """

    def __init__(self, max_count: int, max_bytes: int) -> None:
        if max_count < 1:
            raise ValueError("max_count must be at least 1")
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._count = 0
        self._bytes = 0
        self._queue: deque[_Waiter] = deque()  # live waiters in arrival order, plus cancelled ones not yet skipped
        self._waiting = 0  # live (neither granted nor gone) waiters in the queue
        self._closed = False
        self.waits = 0
        self.timeouts = 0
        self.cancels = 0

    # -- state ----------------------------------------------------------------------------
    @property
    def count(self) -> int:
        """Admitted and not yet released (granted waiters not yet resumed included)."""
        return self._count

    @property
    def bytes(self) -> int:
        """Bytes admitted and not yet released."""
        return self._bytes

    @property
    def waiting(self) -> int:
        """Acquires queued for room."""
        return self._waiting

    @property
    def closed(self) -> bool:
        return self._closed

    # -- operations -----------------------------------------------------------------------
    async def acquire(self, nbytes: int, deadline: float | None = None, *, count: int = 1) -> None:
        """Wait for room for a transfer of `nbytes`, in arrival order; the caller must `release` it later.

        `count` > 1 admits a batch of transfers together (`nbytes` is all of theirs): room for all
        of them at once, or none; each is `release`d on its own.

        `deadline` is in loop time (`loop.time()`); None waits for as long as it takes. With room
        and nobody queued, this returns at once, whatever the deadline.

        Raises `TimeoutError` when the deadline passes first, and `CancelledError` when the
        caller is cancelled; either way nothing stays reserved. After `close` it returns at once.
        """
        if self.try_acquire(nbytes, count=count):
            return
        waiter = _Waiter(count, nbytes, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._waiting += 1
        self.waits += 1
        try:
            async with asyncio.timeout_at(deadline):
                await waiter.future
        except BaseException as exc:
            if isinstance(exc, TimeoutError):
                self.timeouts += 1
            else:
                self.cancels += 1
            self._leave(waiter)
            raise

    def try_acquire(self, nbytes: int, *, count: int = 1) -> bool:
        """Take the room at once if `acquire` would not wait (room and nobody queued, or closed: then over the
        limits); False leaves everything as it was."""
        if nbytes < 0 or count < 1:
            raise ValueError("nbytes must be >= 0 and count >= 1")
        if self._closed or (self._waiting == 0 and self._fits(count, nbytes)):
            self._reserve(count, nbytes)
            return True
        return False

    def release(self, nbytes: int, *, count: int = 1) -> None:
        """Give back what `count` transfers of `nbytes` in all took, and admit the next waiters that fit."""
        if self._count < count or count < 1 or nbytes < 0 or nbytes > self._bytes:
            raise ValueError(f"release({nbytes}, count={count}) without a matching acquire "
                             f"({self._count} held, {self._bytes} bytes)")  # fmt: skip
        self._count -= count
        self._bytes -= nbytes
        self._grant()

    def close(self) -> None:
        """Admit every waiter now, over the limits, and every later `acquire` at once."""
        self._closed = True
        self._grant()

    # -- internals ------------------------------------------------------------------------
    def _fits(self, count: int, nbytes: int) -> bool:
        if self._count == 0:
            return True  # an oversized transfer (or batch) alone still goes
        return self._count + count <= self.max_count and self._bytes + nbytes <= self.max_bytes

    def _reserve(self, count: int, nbytes: int) -> None:
        self._count += count
        self._bytes += nbytes

    def _grant(self) -> None:
        """Admit heads while they fit (all of them once closed); skip the cancelled ones."""
        queue = self._queue
        while queue:
            head = queue[0]
            if head.future.done():  # cancelled while queued
                queue.popleft()
                continue
            if not (self._closed or self._fits(head.count, head.nbytes)):
                return
            queue.popleft()
            self._waiting -= 1
            self._reserve(head.count, head.nbytes)
            head.future.set_result(None)

    def _leave(self, waiter: _Waiter) -> None:
        """`waiter`'s acquire is failing: undo its grant, or drop it from the queue."""
        future = waiter.future
        if future.done() and not future.cancelled():
            # Granted, but cancelled before it resumed: it is out of the queue already.
            self._count -= waiter.count
            self._bytes -= waiter.nbytes
            self._grant()
            return
        if not future.done():  # not expected (cancelling the task cancels the future), but be sure
            future.cancel()
        self._waiting -= 1
        if self._waiting == 0:
            self._queue.clear()
        elif len(self._queue) - self._waiting > max(_COMPACT_AT, self._waiting):
            self._queue = deque(w for w in self._queue if not w.future.done())
        self._grant()  # it may have been the head that held the others up
