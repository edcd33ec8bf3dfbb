"""Producer-side bookkeeping: when a finished request's blocks may be freed. Pure state, no I/O.

vLLM keeps a finished prefill request's blocks until the connector reports it in
``finished_sending``. That happens when every reader rank has notified
``"{request_id}:{readers}"``, or when the lease runs out (the reader vanished). Notifications
may arrive before vLLM hands over the lease (the request is then only "in batch"); they are
counted and kept until it does. Notifications for requests we never heard of are refused, so a
stray or late message cannot free someone else's blocks.

Readers whose request waits in their queue renew its lease (`renew`, answering their
heartbeat): the deadline only moves later, and the reply says until when, so a reader never
reads past a deadline we did not acknowledge. Renewing a request we no longer hold answers
nothing for it: the reader learns its blocks are gone.

In push mode a reader may know a request only by the id the proxy gave it, without the suffix
vLLM adds (`base_id`): its renewals then match the request by that base id.

`renew` is called from the engine's loop thread, the rest from vLLM's worker thread: every
method takes the book's lock.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable

__all__ = ["SendBook", "parse_notification"]


def parse_notification(message: bytes) -> tuple[str, int] | None:
    """``b"req-1:2"`` -> ``("req-1", 2)``; None when malformed."""
    request_id, sep, readers = message.decode(errors="replace").rpartition(":")
    # (ASCII digits only: str.isdigit() takes "²" and "①", which int() refuses; and a handful of them)
    if not sep or not request_id or not (readers.isascii() and readers.isdigit()) or not 0 < len(readers) <= 6:
        return None
    return (request_id, int(readers)) if int(readers) > 0 else None


class SendBook:
    def __init__(self, base_id: Callable[[str], str] | None = None) -> None:
        self._base_id = base_id
        self._by_base: dict[str, str] = {}  # base id -> request (with `base_id` only)
        self._in_batch: set[str] = set()  # being computed; a notification may come early
        self._deadlines: dict[str, float] = {}  # finished, blocks held until then
        self._seen: Counter[str] = Counter()
        self._needed: dict[str, int] = {}
        self._renewed: dict[str, float] = {}  # renewed while still in batch: applied when held
        self._lock = threading.Lock()

    def in_batch(self, request_ids: set[str]) -> None:
        with self._lock:
            self._in_batch |= request_ids
            self._name(request_ids)

    def hold(self, request_id: str, deadline: float) -> None:
        """Blocks of `request_id` are held for readers until `deadline` (our monotonic clock)."""
        with self._lock:
            self._deadlines[request_id] = max(deadline, self._renewed.pop(request_id, deadline))
            self._name((request_id,))

    def _name(self, request_ids: Iterable[str]) -> None:
        if self._base_id is not None:
            for request_id in request_ids:
                self._by_base[self._base_id(request_id)] = request_id

    def renew(self, request_ids: list[str], until: float) -> dict[str, float]:
        """Hold each known request at least until `until`; -> its deadline now (unknown ones left out)."""
        held = {}
        with self._lock:
            for asked in request_ids:  # (the reply names each request as the reader did)
                request_id = asked
                if self._base_id is not None and asked not in self._deadlines and asked not in self._in_batch:
                    request_id = self._by_base.get(self._base_id(asked), asked)
                if request_id in self._deadlines:
                    held[asked] = self._deadlines[request_id] = max(self._deadlines[request_id], until)
                elif request_id in self._in_batch:
                    held[asked] = self._renewed[request_id] = max(self._renewed.get(request_id, until), until)
        return held

    def drop(self, request_id: str) -> None:
        """Forget a request (aborted, or reported)."""
        with self._lock:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        if self._base_id is not None and self._by_base.get(base := self._base_id(request_id)) == request_id:
            del self._by_base[base]
        self._renewed.pop(request_id, None)
        self._in_batch.discard(request_id)
        self._deadlines.pop(request_id, None)
        self._seen.pop(request_id, None)
        self._needed.pop(request_id, None)

    def notified(self, message: bytes) -> bool:
        """Count one reader's notification; False (ignored) if malformed or for an unknown request."""
        parsed = parse_notification(message)
        if parsed is None:
            return False
        request_id, readers = parsed
        with self._lock:
            if request_id not in self._in_batch and request_id not in self._deadlines:
                return False
            self._seen[request_id] += 1
            self._needed[request_id] = readers
        return True

    def collect(self, now: float, release: Callable[[str, bool], bool] | None = None) -> tuple[set[str], set[str]]:
        """(read by all readers, lease expired): both may be freed now; they are forgotten.

        `release(request_id, expired)` may hold a request back (False: asked again at the next collect),
        e.g. while a push still reads its blocks.
        """
        read, expired = set(), set()
        with self._lock:
            for request_id, deadline in self._deadlines.items():
                needed = self._needed.get(request_id)
                if needed is not None and self._seen[request_id] >= needed:
                    read.add(request_id)
                elif now >= deadline:
                    expired.add(request_id)
            if release is not None:
                read = {r for r in read if release(r, now >= self._deadlines[r])}  # (served, and past its lease)
                expired = {r for r in expired if release(r, True)}
            for request_id in read | expired:
                self._forget(request_id)
        return read, expired

    def __len__(self) -> int:
        return len(self._deadlines)

    @property
    def expecting_readers(self) -> bool:
        """Whether any request is being computed for, or held for, a reader."""
        return bool(self._in_batch or self._deadlines)
