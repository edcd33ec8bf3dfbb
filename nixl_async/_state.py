"""The transfer state machine: slices, handles and the failure contract, without I/O.

The engine feeds it what NIXL said (a post returned DONE/PROC/ERR, a check returned a state, a
release succeeded or was refused), the caller's intent (end it with this error) and the time;
it answers with actions (release slice i's handle, finish the caller's future, report the
memory fenced, report it quiet). It never sees a handle, a loop or a clock of its own, so every
path is tested by driving it with events alone (`tests/core/test_state.py`).

The rules it keeps:

1. A slice is *running* from the post that returned PROC until a check says DONE or ERR. A
   running slice's handle is never released: NIXL accepts the release of a READ in flight over
   UCX/TCP and the bytes keep landing (measured: ~14.6 MB after the release returned).
2. A transfer ended by an error (deadline, cancellation, peer failure, close) posts nothing
   more and goes RELEASING: its running slices are watched until they end, and every handle is
   released. Only then is the caller told (the memory is *quiet*).
3. If that takes longer than the grace, the caller is told now, with `TransferFenced` (its
   memory may still be written), and the transfer goes FENCED until NIXL lets go; then QUIET.
4. A WRITE's notification rides on its last slice, which is posted alone, after every other
   slice is done, so the target never hears "done" before the data is there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .exceptions import LeaseExpired, TransferCancelled, TransferError, TransferFailed, TransferFenced, TransferTimeout

__all__ = ["Complete", "Fenced", "Finish", "Quiet", "Release", "SliceCore", "TransferCore", "TransferState"]


class TransferState(enum.StrEnum):
    POSTING = "posting"  # slices are being posted or are in flight
    RELEASING = "releasing"  # ended by an error; waiting for NIXL to stop and let go of its handles
    FENCED = "fenced"  # the caller was told its memory is fenced; still waiting for NIXL
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"


_ERROR_STATES: dict[type[TransferError], TransferState] = {
    TransferCancelled: TransferState.CANCELLED,
    TransferTimeout: TransferState.TIMED_OUT,
}


@dataclass(frozen=True, slots=True)
class Release:
    """Release slice `index`'s handle (it has ended: nothing more lands)."""

    index: int


@dataclass(frozen=True, slots=True)
class Complete:
    """Every slice arrived and was released: the engine checks what remains, then `succeed()`s."""


@dataclass(frozen=True, slots=True)
class Finish:
    """Tell the caller: `error` None means success. The memory is quiet."""

    error: TransferError | None


@dataclass(frozen=True, slots=True)
class Fenced:
    """Tell the caller now, with `error` (a `TransferFenced`): the memory is not quiet yet."""

    error: TransferFenced


@dataclass(frozen=True, slots=True)
class Quiet:
    """A fenced transfer's handles are all released at last."""


Action = Release | Complete | Finish | Fenced | Quiet


class SliceCore:
    """What the driver asks of a core, and what a transfer's and a batch's cores share: how one
    ended by an error goes RELEASING, then quiet (or FENCED past the grace, then quiet).
    Subclasses keep the slices (a batch's rows) and their handles."""

    __slots__ = (
        "_done",
        "_error",
        "_errored",
        "_next",
        "_release_by",
        "grace_s",
        "num_slices",
        "op",
        "peer",
        "state",
        "transfer_id",
    )

    def __init__(self, num_slices: int, *, grace_s: float, op: str, peer: str | None, transfer_id: int | None) -> None:
        self.num_slices = num_slices
        self.grace_s = grace_s
        self.op, self.peer, self.transfer_id = op, peer, transfer_id
        self.state = TransferState.POSTING
        self._next = 0  # the next slice to post
        self._done = 0  # slices that arrived and were released
        self._errored = 0  # slices that ended in an error state, or whose post failed
        self._error: TransferError | None = None
        self._release_by: float | None = float("inf")  # None: the grace starts at the next tick

    @property
    def quiet(self) -> bool:
        """No handle of this transfer is alive in NIXL."""
        return not self._held()

    @property
    def slices_done(self) -> int:
        return self._done

    @property
    def slices_posted(self) -> int:
        return self._next

    @property
    def slices_errored(self) -> int:
        """Slices NIXL ended in an error state (or whose post failed), whatever the transfer's state.

        The others ended DONE, which for a WRITE means its bytes are in the target's memory: a
        WRITE's bytes may still land there after its handle is gone only if this is non-zero.
        """
        return self._errored

    @property
    def error(self) -> TransferError | None:
        return self._error

    @property
    def release_by(self) -> float | None:
        """When a RELEASING transfer turns FENCED: inf if not releasing, None until the next tick."""
        return self._release_by

    # -- what subclasses keep -------------------------------------------------------------------
    def _held(self) -> int:
        """How many handles are alive in NIXL."""
        raise NotImplementedError

    @property
    def has_running(self) -> bool:
        """Some slice is posted and not yet seen ended."""
        raise NotImplementedError

    def running_list(self) -> list[int]:
        """The slices to check: posted and not yet seen ended, in order."""
        raise NotImplementedError

    @property
    def wants_post(self) -> bool:
        """Some slice is still to be posted (now or once a running one ends)."""
        return self.state is TransferState.POSTING and self._next < self.num_slices

    @property
    def can_post_now(self) -> bool:
        """A slice could be posted right now."""
        raise NotImplementedError

    def to_post(self, budget: int) -> list[int]:
        """Slices to post now (at most `budget`); post them in order and report each with `posted`."""
        raise NotImplementedError

    def posted(self, index: int, state: str) -> list[Action]:
        """Slice `index` was made and posted; NIXL's `transfer()` answered `state`."""
        raise NotImplementedError

    def post_failed(self, index: int, reason: str) -> list[Action]:
        """Making or posting slice `index` raised: no handle of it is alive."""
        raise NotImplementedError

    def checked(self, index: int, state: str) -> list[Action]:
        """A check (or the post) of running slice `index` answered `state` ("DONE", "PROC", "ERR"...)."""
        raise NotImplementedError

    def released(self, index: int, ok: bool = True) -> list[Action]:
        """Releasing slice `index`'s handle succeeded (`ok`) or was refused (retried via `to_release`)."""
        raise NotImplementedError

    def to_release(self) -> list[int]:
        """Ended slices whose handle is not released yet (a release NIXL refused): try again."""
        raise NotImplementedError

    def succeed(self) -> list[Action]:
        """After `Complete`, the engine found nothing wrong (lease, notification): done."""
        if self.state is not TransferState.POSTING or self._done != self.num_slices:
            raise RuntimeError(f"succeed() in state {self.state} with {self._done}/{self.num_slices} slices")
        self.state = TransferState.DONE
        return [Finish(None)]

    def end(self, error: TransferError, now: float | None) -> list[Action]:
        """End the transfer with `error` (deadline, cancellation, failure, close). Idempotent.

        The grace counts from `now`, or from the next `tick` when the caller has no clock at hand.
        """
        if self.state is not TransferState.POSTING:
            return []
        self._error = error
        self.state = TransferState.RELEASING
        self._release_by = None if now is None else now + self.grace_s
        return [*(Release(i) for i in self.to_release()), *self._settled_if_quiet()]

    def tick(self, now: float) -> list[Action]:
        """Time passed: a transfer still RELEASING after its grace is reported fenced."""
        if self.state is not TransferState.RELEASING:
            return []
        if self._release_by is None:
            self._release_by = now + self.grace_s
        if now < self._release_by:
            return []
        assert self._error is not None
        self.state = TransferState.FENCED
        self._release_by = float("inf")
        return [Fenced(TransferFenced.of(self._error, slices=self._held()))]

    def _fail(self, message: str) -> list[Action]:
        return self.end(TransferFailed(message, transfer_id=self.transfer_id, peer=self.peer), None)

    def _settled_if_quiet(self) -> list[Action]:
        if self._held():
            return []
        assert self._error is not None
        was_fenced = self.state is TransferState.FENCED
        self.state = _ERROR_STATES.get(type(self._error), TransferState.FAILED)
        self._release_by = float("inf")
        return [Quiet()] if was_fenced else [Finish(self._error)]


class TransferCore(SliceCore):
    """One transfer's slices and state. Every method returns the actions to carry out, in order."""

    __slots__ = ("_landed", "_last_posted", "_running", "_unreleased", "chain_last", "max_running", "notifies")

    def __init__(
        self,
        num_slices: int,
        *,
        max_running: int,
        grace_s: float,
        chain_last: bool = False,
        op: str = "READ",
        peer: str | None = None,
        transfer_id: int | None = None,
    ) -> None:
        """`chain_last`: the last slice carries a notification, so it goes alone after the others."""
        if num_slices < 0 or max_running < 1:
            raise ValueError("a transfer needs a slice count >= 0 and at least one slice in flight")
        super().__init__(num_slices, grace_s=grace_s, op=op, peer=peer, transfer_id=transfer_id)
        self.max_running = max_running
        self.notifies = chain_last
        self.chain_last = chain_last and num_slices > 1
        self._landed = False  # ended, yet every slice landed, the notifying one included (see _settled_if_quiet)
        self._last_posted = False  # the last slice (a notifying WRITE's notification) reached NIXL
        # Bit masks (bit i = slice i), not sets or tuples: with 10 k transfers in flight every
        # container the garbage collector tracks makes its full collections slower; ints are not tracked.
        self._running = 0  # posted, not yet seen DONE/ERR
        self._unreleased = 0  # have a handle: running, or ended but not released yet

    # -- views ------------------------------------------------------------------------------
    @property
    def has_running(self) -> bool:
        return bool(self._running)

    def running_list(self) -> list[int]:
        return _bits(self._running) if self._running else []

    @property
    def quiet(self) -> bool:
        return not self._unreleased

    def _held(self) -> int:
        return self._unreleased.bit_count()

    @property
    def can_post_now(self) -> bool:
        """A slice could be posted right now (one is left and the in-flight window has room)."""
        return self.state is TransferState.POSTING and self._may_post(self._running.bit_count())

    def _may_post(self, running: int) -> bool:
        """Whether slice `_next` may be posted with `running` slices in flight."""
        if self._next >= self.num_slices or running >= self.max_running:
            return False
        # a chained last slice goes out only once every other one is done
        return not (self.chain_last and self._next == self.num_slices - 1 and (running or self._done < self._next))

    def to_post(self, budget: int) -> list[int]:
        if self.state is not TransferState.POSTING:
            return []
        out: list[int] = []
        running = self._running.bit_count()
        while len(out) < budget and self._may_post(running + len(out)):
            out.append(self._next)
            self._next += 1
        return out

    # -- events from NIXL ---------------------------------------------------------------------
    def posted(self, index: int, state: str) -> list[Action]:
        bit = 1 << index
        if index == self.num_slices - 1:
            self._last_posted = True
        self._unreleased |= bit
        self._running |= bit
        return self.checked(index, state)

    def post_failed(self, index: int, reason: str) -> list[Action]:
        self._errored += 1  # (a post that failed part way may have sent some of its bytes)
        return self._fail(f"posting {self.op} to {self.peer} failed: {reason}")

    def checked(self, index: int, state: str) -> list[Action]:
        bit = 1 << index
        if not self._running & bit or state == "PROC":
            return []
        self._running &= ~bit
        if state != "DONE":
            self._errored += 1
            if self.state is TransferState.POSTING:
                return self._fail(f"{self.op} with {self.peer} failed (NIXL state {state})")  # releases it too
        return [Release(index)]

    def released(self, index: int, ok: bool = True) -> list[Action]:
        bit = 1 << index
        if not ok or not self._unreleased & bit:
            return []
        self._unreleased &= ~bit
        if self.state is TransferState.POSTING:
            self._done += 1
            return [Complete()] if self._done == self.num_slices else []
        return self._settled_if_quiet()

    def to_release(self) -> list[int]:
        ended = self._unreleased & ~self._running
        return _bits(ended) if ended else []

    def _settled_if_quiet(self) -> list[Action]:
        # Ended while its last slice, carrying the notification, was already out: if every slice ended
        # DONE the target has its bytes and was told so. The transfer then completed, whatever ended it
        # meanwhile (a cancel, a deadline): reporting that error would leave the two sides disagreeing.
        # The engine checks it as any completion (`Complete`): past a lease it is refused, as when a
        # lease that ran out ended it. A caller already told it is fenced keeps that outcome.
        # (Handed out is not enough: a post that raised before NIXL took the slice sent nothing.)
        landed = self.notifies and self._last_posted and not self._errored
        if not landed or self._held() or self.state is not TransferState.RELEASING:
            return super()._settled_if_quiet()
        if isinstance(self._error, LeaseExpired):  # (what ended it: its data came too late)
            return super()._settled_if_quiet()
        self._landed = True
        return [Complete()]

    def succeed(self) -> list[Action]:
        if not self._landed:
            return super().succeed()
        self._landed = False
        self.state = TransferState.DONE
        self._release_by = float("inf")
        return [Finish(None)]

    def end(self, error: TransferError, now: float | None) -> list[Action]:
        if not self._landed:
            return super().end(error, now)
        self._landed = False  # the engine refuses what landed (past a lease): the caller hears `error`
        self._error = error
        self.state = _ERROR_STATES.get(type(error), TransferState.FAILED)
        self._release_by = float("inf")
        return [Finish(error)]


def _bits(mask: int) -> list[int]:
    """The indices of the set bits of `mask`, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
