"""Push mode's wire message and the producer's matching of registrations to finished requests.

Pure state, no I/O. In push mode decode allocates blocks first and registers them with each
prefill rank it needs; prefill WRITEs a request's KV into them once the request is done there.
Either may come first: a registration for a request prefill is still computing waits, and a
finished request waits for its registration (until its lease runs out).

Decode and prefill name a request differently: vLLM appends a random ``-<8 hex>`` to the id a
proxy gives both legs, so a registration matches a finished request by exact id, else by the
id without that suffix (vLLM's `get_base_request_id`, as its push connector matches them).

So a registration naming a request prefill already freed (or aborted) cannot be told from a
retry under the same id whose prefill has not begun: it waits `grace_s` for such a request,
then its decode is told the push failed (`doubted`), well before decode's own deadline.

Decode plans the transfer from prefill's layout, as it does in pull mode (`tp_mapping`), and
sends the plan's views; prefill only adds its own block ids, so one planner serves both modes.

Decode may give up on a request first (its client went away while it waited for the push): it
withdraws its registration (`withdraw`). One still waiting then writes nothing and only lets
prefill free the request; a copy of it that arrives later (a call overtaken) writes nothing either.
If it never arrived, a registration that writes nothing stands in for it (`stand_in`), so that
prefill still counts that decode rank as served.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from nixl_async import ViewSpec, messages
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id as base_request_id

__all__ = [
    "PUSH_PREFIX",
    "PUSH_TOPIC",
    "PUSH_WITHDRAW_TOPIC",
    "PushBook",
    "PushGroup",
    "PushRegistration",
    "base_request_id",
    "push_failure_notification",
    "push_notification",
]

PUSH_TOPIC = "kv_push"
PUSH_WITHDRAW_TOPIC = "kv_push_withdraw"  # decode -> prefill: its registration (write=False), given up
# Prefill's answers to a withdrawal:
WITHDRAWN = b"withdrawn"  # it never wrote and never will (it waited, was superseded, or its push had not begun)
STOPPING = b"stopping"  # a push of it ran: stopped; decode hears of it (pushed or failed) once NIXL let go
NOT_HELD = b"not-held"  # neither: nothing will be written now, a push that already ended may have been
PUSH_PREFIX = b"push:"
PUSH_FAILED_PREFIX = b"push-failed:"
_LANDED = b":landed"
GONE_REMEMBERED = 4096  # freed requests remembered, so that late registrations for them are doubted


def push_notification(decode_request_id: str, prefill_rank: int) -> bytes:
    """What prefill rank `prefill_rank`'s WRITE carries to decode: decode counts one per writing rank."""
    return PUSH_PREFIX + f"{decode_request_id}:{prefill_rank}".encode()


def push_failure_notification(decode_request_id: str, prefill_rank: int, write_by: float, *,
                              landed: bool = False) -> bytes:  # fmt: skip
    """What prefill rank `prefill_rank` sends decode when its push failed with none of its WRITEs left in NIXL.

    It names the registration's `write_by` too: one left over from an earlier registration of the
    same request id must not end a later one's wait. `landed`: every WRITE it posted ended DONE
    (NIXL's UCX backend reports a WRITE done once decode's side acknowledged its bytes), so no
    byte of it can land later and decode need not wait a margin; sent only to a decode that
    asked (`landed_notice`).
    """
    notice = PUSH_FAILED_PREFIX + f"{decode_request_id}:{prefill_rank}:{write_by!r}".encode()
    return notice + _LANDED if landed else notice


class PushGroup(msgspec.Struct, frozen=True, array_like=True):
    """One KV cache group of a registration: decode's logical blocks (see `block_pairs.GroupBlocks`)."""

    kind: str
    blocks: list[int]
    hit: int | None = None


class PushRegistration(msgspec.Struct, frozen=True, kw_only=True):
    """Decode rank -> prefill rank: "write request `request_id` into these blocks of mine".

    `write` is False for a prefill rank decode does not read from (an MLA sibling, a full
    prefix hit): it only lets prefill free the request. `write_by` is decode's wall clock:
    prefill never starts a WRITE after it and cancels one still running then, and decode
    gives up on the request only once it has passed (no byte lands in blocks decode reused).

    The views are byte windows of one block on each side (a TP rank's heads). When prefill's
    blocks hold `decode_block_size` times k tokens (k > 1, vLLM's one block-size ratio in push),
    prefill cuts each of its blocks into k pieces by token runs, one per decode block
    (`push_worker.write_parts`); the views still say which bytes of a block each side holds.
    """

    request_id: str  # prefill's, as the proxy named it (maybe without vLLM's suffix)
    decode_request_id: str
    decode_engine_id: str  # the decode rank's transfer engine
    decode_host: str
    decode_port: int
    decode_tp: int
    decode_pages: int  # kernel pages per decode block
    groups: list[PushGroup]
    write: bool
    decode_view: ViewSpec = ViewSpec()  # which bytes of decode's blocks this prefill rank fills
    prefill_view: ViewSpec = ViewSpec()  # ... from which bytes of its own
    write_by: float = 0.0
    decode_block_size: int = 0  # tokens per decode kernel page; 0: as many as prefill's (no ratio)
    # The NIXL agent of the decode rank that registered: a decode restarted under the same engine id
    # (and address) has other blocks behind the same ids; "": not checked (an older decode).
    decode_agent: str = ""
    # Decode tells a failed push whose WRITEs all landed from one that may still land bytes
    # (`push_failure_notification(landed=True)`); False: an older decode, which waits for the plain notice.
    landed_notice: bool = False

    def __post_init__(self) -> None:
        # (msgspec makes this a `ValidationError`, a `ValueError`: the registration is refused) A NaN or
        # infinite `write_by` would be held for ever: never written by, never expired.
        if not math.isfinite(self.write_by):
            raise ValueError(f"write_by must be a finite wall-clock time, got {self.write_by!r}")


encode_registration = msgspec.msgpack.Encoder().encode
decode_registration = messages.decoder(PushRegistration)  # (every bad input a DecodeError)


def _decode_key(registration: PushRegistration) -> tuple[str, str]:
    return registration.decode_engine_id, registration.decode_request_id


class _Remembered:
    """Registrations, by (decode rank, its request), each remembered until its ``write_by`` (a bounded number)."""

    def __init__(self) -> None:
        self._until: dict[tuple[str, str], float] = {}

    def add(self, registration: PushRegistration) -> None:
        self._until[_decode_key(registration)] = registration.write_by
        if len(self._until) > GONE_REMEMBERED:
            del self._until[next(iter(self._until))]

    def __contains__(self, registration: PushRegistration) -> bool:
        return _decode_key(registration) in self._until

    def expire(self, wall_now: float) -> None:
        for key in [k for k, write_by in self._until.items() if write_by <= wall_now]:
            del self._until[key]


@dataclass
class _Entry:
    blocks: tuple[list[int], ...] | None  # None while prefill still computes the request (progressive push)
    running: int = 0  # pushes started and not yet ended
    closing: bool = False  # to be freed: matches no more registrations
    stop: bool = False  # ... and its pushes are to be stopped (its lease ran out, or it was aborted)


class Expired(NamedTuple):
    """Registrations `PushBook.expire` dropped."""

    unclaimed: list[PushRegistration]  # past their write_by: decode has given up on them
    doubted: list[PushRegistration]  # their request was freed, and no retry of it came: tell decode


@dataclass
class PushBook:
    """Prefill side: requests and decode registrations, matched as they meet.

    `finished` and `register` return the pushes to start; each counts as running until
    `ended`. A request may take several registrations (several decode ranks read one prefill
    rank). With progressive push, `claim` takes the registrations of a request prefill is still
    computing (its layers are pushed as they are computed); later ones wait for the next claim
    or for `finished`. `release` says whether a request's blocks may be freed: not while a push
    of it runs (the push reads them); it then matches nothing more. A registration for a request
    freed (or being freed, or aborted) waits `grace_s` for a retry under the same id, then is
    `doubted`. Registrations nobody claims are dropped once their `write_by` has passed (`expire`).
    Times are wall-clock seconds (registrations carry decode's `write_by` in them).
    """

    grace_s: float = 30.0
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _by_base: dict[str, str] = field(default_factory=dict)  # base id -> request
    _waiting: dict[str, list[PushRegistration]] = field(default_factory=dict)  # by base id
    _gone: dict[str, None] = field(default_factory=dict)  # base ids of released requests, oldest first
    _doubted: dict[str, float] = field(default_factory=dict)  # gone base id -> when its registrations are told
    _superseded: list[PushRegistration] = field(default_factory=list)  # to tell at once (see `register`)
    # By (decode rank, its request):
    _handed_out: _Remembered = field(default_factory=_Remembered)  # matched (to push, or to count as served)
    _replaced: _Remembered = field(default_factory=_Remembered)  # superseded: never written
    _withdrawn: _Remembered = field(default_factory=_Remembered)  # decode gave up on it
    _stood_in: _Remembered = field(default_factory=_Remembered)  # withdrawn unseen: a reader stands in for it
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _take_waiting(self, request_id: str, blocks: tuple[list[int], ...] | None) -> list[PushRegistration]:
        base = base_request_id(request_id)
        entry = self._entries.setdefault(request_id, _Entry(blocks))
        if blocks is not None:
            entry.blocks = blocks
        self._by_base[base] = request_id
        if entry.closing:
            return []
        self._gone.pop(base, None)  # a retry under a freed request's id: its registrations are for it
        self._doubted.pop(base, None)
        matched = self._waiting.pop(base, [])
        entry.running += len(matched)
        for registration in matched:
            self._handed_out.add(registration)
        return matched

    def claim(self, request_id: str) -> list[PushRegistration]:
        """Prefill computes `request_id` now: the registrations waiting for it (now running)."""
        with self._lock:
            return self._take_waiting(request_id, None)

    def finished(self, request_id: str, blocks: tuple[list[int], ...]) -> list[PushRegistration]:
        """Prefill finished `request_id`: the registrations that were waiting for it (now running)."""
        with self._lock:
            return self._take_waiting(request_id, blocks)

    def computing(self, request_ids: Iterable[str]) -> None:
        """Prefill computes these requests now: a freed one's id in use again is a retry's, not gone."""
        with self._lock:
            for request_id in request_ids:
                base = base_request_id(request_id)
                self._gone.pop(base, None)
                self._doubted.pop(base, None)

    def register(
        self, registration: PushRegistration, now: float
    ) -> tuple[str, tuple[list[int], ...], PushRegistration] | None:
        """A decode rank registered: (prefill request, its blocks, the registration) to push now, or None
        if it waits (or is dropped). It comes back with ``write=False`` if decode withdrew it already.

        A registration waiting from the same decode rank for another of its requests under this id
        (an earlier attempt) is superseded: its decode is told, the newer one waits in its place. One
        overtaken by its withdrawal writes nothing, and is dropped if a reader already stands in for it.
        """
        with self._lock:
            if registration in self._stood_in:
                return None
            if registration.write and registration in self._withdrawn:
                registration = msgspec.structs.replace(registration, write=False)
            return self._register(registration, now)

    def _register(
        self, registration: PushRegistration, now: float
    ) -> tuple[str, tuple[list[int], ...], PushRegistration] | None:
        """`register` past the withdrawal checks (under the lock)."""
        base = base_request_id(registration.request_id)
        waiting = self._waiting.get(base, [])
        older = [r for r in waiting if r.decode_engine_id == registration.decode_engine_id
                 and r.decode_request_id != registration.decode_request_id]  # fmt: skip
        if older:
            self._superseded += older
            for replaced in older:
                self._replaced.add(replaced)
            waiting[:] = [r for r in waiting if r not in older]
        request_id = registration.request_id
        if request_id not in self._entries:
            request_id = self._by_base.get(base, "")
        entry = self._entries.get(request_id)
        if entry is not None and entry.blocks is not None and not entry.closing:
            entry.running += 1
            self._handed_out.add(registration)
            return request_id, entry.blocks, registration
        # Not computed yet (the next claim or `finished` takes it), or freed: then it waits for a retry.
        self._waiting.setdefault(base, []).append(registration)
        if (entry is not None and entry.closing) or (entry is None and base in self._gone):
            self._doubt(base, now)
        return None

    def withdraw(self, registration: PushRegistration) -> bool:
        """Decode gave up on `registration`'s request: True if it never wrote and never will (it was
        waiting, and now writes nothing and only lets the request be freed when matched; or it was
        superseded), False if not (a push of it may run: the caller stops it, or stands a reader in
        for it). A copy of it registered later writes nothing either (`withdrawn`)."""
        key = _decode_key(registration)
        base = base_request_id(registration.request_id)
        with self._lock:
            self._withdrawn.add(registration)
            waiting = self._waiting.get(base, [])
            found = [i for i, waiting_one in enumerate(waiting) if _decode_key(waiting_one) == key]
            for i in found:
                waiting[i] = msgspec.structs.replace(waiting[i], write=False)
            # Superseded (vLLM's decode registers a stub, "nothing to read", under the client's own id when
            # the client goes away): it was never written; one not told yet needs no telling now.
            untold = [r for r in self._superseded if _decode_key(r) == key]
            self._superseded = [r for r in self._superseded if _decode_key(r) != key]
            return bool(found or untold) or registration in self._replaced

    def withdrawn(self, registration: PushRegistration) -> bool:
        """Whether decode gave up on `registration` (a push of it not started yet must write nothing)."""
        with self._lock:
            return registration in self._withdrawn

    def stand_in(
        self, registration: PushRegistration, now: float
    ) -> tuple[str, tuple[list[int], ...], PushRegistration] | None:
        """After `withdraw` found nothing, and no push of it runs: unless it was handed out already,
        register a copy that writes nothing in its place (matched at once, or waiting, as `register`),
        so that its decode rank still counts as served; the registration itself, if it comes, is dropped."""
        with self._lock:
            if registration in self._handed_out or registration in self._stood_in:
                return None
            self._stood_in.add(registration)
            return self._register(msgspec.structs.replace(registration, write=False), now)

    def _doubt(self, base: str, now: float) -> None:
        if base in self._waiting:
            self._doubted[base] = max(self._doubted.get(base, 0.0), now + self.grace_s)

    def ended(self, request_id: str) -> None:
        """One push of `request_id` ended (its transfers are quiet)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is not None:
                entry.running -= 1
                if entry.closing and entry.running <= 0:
                    self._forget(request_id)

    def release(self, request_id: str, now: float, *, stop: bool = True) -> bool:
        """May `request_id`'s blocks be freed? Not while a push reads them (it then matches nothing more,
        and with `stop`, its lease run out or the request aborted, its pushes are to be stopped; without,
        every reader it expected served, a retry's push under way runs to its end).

        Freed (finished or aborted), its id is gone: registrations waiting for it are doubted.
        """
        base = base_request_id(request_id)
        with self._lock:
            entry = self._entries.get(request_id)
            self._doubt(base, now)  # (those that came after a progressive push claimed it, too)
            if entry is not None and entry.running > 0:
                entry.closing = True
                entry.stop |= stop
                return False
            if entry is not None:
                self._forget(request_id)
            else:
                self._mark_gone(base)
            return True

    def _forget(self, request_id: str) -> None:
        del self._entries[request_id]
        base = base_request_id(request_id)
        if self._by_base.get(base) == request_id:
            del self._by_base[base]
        self._mark_gone(base)

    def _mark_gone(self, base: str) -> None:
        self._gone[base] = None
        if len(self._gone) > GONE_REMEMBERED:
            del self._gone[next(iter(self._gone))]

    def closing(self) -> list[str]:
        """Requests to be freed once their running pushes end."""
        with self._lock:
            return [r for r, entry in self._entries.items() if entry.closing]

    def stopping(self) -> list[str]:
        """The closing requests whose running pushes are to be stopped (`release(stop=True)`)."""
        with self._lock:
            return [r for r, entry in self._entries.items() if entry.closing and entry.stop]

    def expire(self, wall_now: float) -> Expired:
        """Drop (and return) waiting registrations past their `write_by`, or doubted past their grace."""
        expired = Expired([], [])
        with self._lock:
            for remembered in (self._handed_out, self._replaced, self._withdrawn, self._stood_in):
                remembered.expire(wall_now)
            expired.doubted.extend(self._superseded)
            self._superseded.clear()
            for base in list(self._waiting):
                doubted = self._doubted.get(base, float("inf")) <= wall_now
                keep = []
                for registration in self._waiting[base]:
                    if registration.write_by <= wall_now:
                        expired.unclaimed.append(registration)
                    elif doubted:
                        expired.doubted.append(registration)
                    else:
                        keep.append(registration)
                if keep:
                    self._waiting[base] = keep
                else:
                    del self._waiting[base]
                if doubted or not keep:
                    self._doubted.pop(base, None)
        return expired

    def next_doubt(self) -> float | None:
        """When the earliest doubted registrations are due to be told (None: none are doubted)."""
        with self._lock:
            if self._superseded:
                return -math.inf
            return min(self._doubted.values(), default=None)

    def waiting(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._waiting.values())
