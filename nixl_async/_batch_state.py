"""A batch's state machine: many rows, each one NIXL request, without I/O.

A batch is what `TransferEngine.start_read_batch` returns: many independent transfers (rows)
with one outcome to await. Per-transfer objects (a `Transfer`, its core and its future) cost more
than NIXL itself when 10 k small transfers are in flight; a batch keeps one of each for all rows.

It keeps the same contract as `TransferCore` (`_state.py`), row by row:

1. A row is one request: posted once, *running* until a check says DONE or ERR, and its handle is
   released only then (a READ released in flight keeps landing).
2. Rows succeed or fail alone: a row that NIXL fails is released and counted, the others go on.
   When every row ended and every handle is released, the batch completes; the engine then
   reports the failed rows, if any, as the batch's error.
3. An error for the whole batch (deadline, cancellation, peer failure, close) posts no more rows
   and waits for the running ones to end (RELEASING), then tells the caller; past the grace the
   caller hears `TransferFenced` (FENCED) and the batch turns quiet later.

Rows are kept in containers, not bit masks: a batch is one object however many rows it has.
"""

from __future__ import annotations

from ._state import Action, Complete, Release, SliceCore, TransferState
from .exceptions import BatchRowsFailed

__all__ = ["BatchCore"]


class BatchCore(SliceCore):
    """The rows of one batch. Every method returns the actions to carry out, in order."""

    __slots__ = ("_arrived", "_ended", "_failed", "_running")

    def __init__(self, rows: int, *, grace_s: float, op: str = "READ", peer: str | None = None,
                 transfer_id: int | None = None) -> None:  # fmt: skip
        if rows < 1:
            raise ValueError("a batch needs at least one row")
        super().__init__(rows, grace_s=grace_s, op=op, peer=peer, transfer_id=transfer_id)
        # A row holds a handle while it is running or ended and not yet released.
        self._running: dict[int, None] = {}  # posted, not yet seen DONE/ERR (insertion-ordered)
        self._ended: set[int] = set()  # seen DONE/ERR, handle not released yet
        self._arrived = bytearray(rows)  # 1: the row's data landed and its handle is released
        self._failed: dict[int, str] = {}  # row -> why it failed (it holds no data)

    # -- views ------------------------------------------------------------------------------
    @property
    def has_running(self) -> bool:
        return bool(self._running)

    def running_list(self) -> list[int]:
        """Rows to check: posted and not yet seen ended, in the order they were posted."""
        return list(self._running)

    def _held(self) -> int:
        return len(self._running) + len(self._ended)

    @property
    def quiet(self) -> bool:
        return not (self._running or self._ended)

    @property
    def can_post_now(self) -> bool:
        """Every row may be in flight at once: any row left can go now."""
        return self.wants_post

    @property
    def arrived(self) -> bytearray:
        """One byte per row: 1 once its data landed and NIXL let go of it (read it, do not change it)."""
        return self._arrived

    @property
    def failed_rows(self) -> dict[int, str]:
        """Rows that failed, with NIXL's answer (they hold no trustworthy data)."""
        return dict(self._failed)

    def to_post(self, budget: int) -> list[int]:
        """Rows to post now (at most `budget`), in order; report each with `posted` or `post_failed`."""
        if self.state is not TransferState.POSTING:
            return []
        end = min(self.num_slices, self._next + max(budget, 0))
        rows = list(range(self._next, end))
        self._next = end
        return rows

    # -- events from NIXL ---------------------------------------------------------------------
    def posted(self, index: int, state: str) -> list[Action]:
        """Row `index` was made and posted; NIXL's `transfer()` answered `state`."""
        self._running[index] = None
        return self.checked(index, state)

    def post_failed(self, index: int, reason: str) -> list[Action]:
        """Making or posting row `index` raised: it holds no handle and fails alone."""
        self._failed[index] = f"posting failed: {reason}"
        self._errored += 1
        return self._complete_if_all_ended()

    def checked(self, index: int, state: str) -> list[Action]:
        """A check (or the post) of running row `index` answered `state`.

        A row still in flight ("PROC") moves behind the others: a sweep that runs out of time
        checks the rows it did not reach first next time.
        """
        if index not in self._running:
            return []
        if state == "PROC":
            del self._running[index]
            self._running[index] = None
            return []
        del self._running[index]
        self._ended.add(index)
        if state != "DONE":
            self._errored += 1
            if self.state is TransferState.POSTING:
                self._failed[index] = f"NIXL state {state}"
        return [Release(index)]

    def released(self, index: int, ok: bool = True) -> list[Action]:
        """Releasing row `index`'s handle succeeded (`ok`) or was refused (retried via `to_release`)."""
        if not ok or index not in self._ended:
            return []
        self._ended.discard(index)
        if self.state is not TransferState.POSTING:
            return self._settled_if_quiet()
        if index not in self._failed:
            self._arrived[index] = 1
            self._done += 1
        return self._complete_if_all_ended()

    def to_release(self) -> list[int]:
        return sorted(self._ended)

    def succeed(self) -> list[Action]:
        """After `Complete`: done, or failed with `BatchRowsFailed` if some rows failed (all are quiet)."""
        if not self._failed:
            return super().succeed()
        first = min(self._failed)
        error = BatchRowsFailed(
            f"{len(self._failed)} of {self.num_slices} rows of {self.op} with {self.peer} failed "
            f"(row {first}: {self._failed[first]})",
            failed_rows=dict(self._failed),
            transfer_id=self.transfer_id,
            peer=self.peer,
        )
        return self.end(error, None)

    def _complete_if_all_ended(self) -> list[Action]:
        if self._done + len(self._failed) == self.num_slices and self.quiet:
            return [Complete()]
        return []
