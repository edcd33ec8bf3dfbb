"""The notification mailbox: delivery, counted waits and subscriptions, without I/O.

NIXL hands us notifications in batches as ``{agent: [message, ...]}``. A caller may await a
message before or after it arrives, and may need the same message from several senders
(fan-in: a decode rank waits until every prefill rank it read from has said "done"). So:

- a delivered message first feeds the oldest waiter for that message;
- otherwise it is kept, unclaimed, until a waiter takes it (bounded: the oldest is dropped);
- every delivery is also copied to each live subscription (the async iterator), which holds at
  most as much unread as the unclaimed mailbox: one further behind is ended (`NotificationsLost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import numbers
import operator
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Generator
from typing import Any

import msgspec

from .exceptions import NotificationsLost, NotificationTimeout

__all__ = ["Lease", "Notification", "NotificationBox"]

log = logging.getLogger("nixl_async.engine")
_DROPS_LOG_INTERVAL_S = 10.0
_SHOWN_BYTES = 64  # of a message, in an error's text (a KB-long one would flood logs)


class Notification(msgspec.Struct, frozen=True):
    """One notification: who sent it (engine id when known, else NIXL agent name) and what."""

    sender: str
    message: bytes


_LOST = Notification("", b"")  # (by identity) a subscription's last item when it fell too far behind


class _Feed(asyncio.Queue[Notification | None]):
    """One subscription's unread notifications, counted in bytes too."""

    def __init__(self, claim: bool) -> None:
        super().__init__()
        self.claim = claim
        self.nbytes = 0


class _Waiter:
    __slots__ = ("count", "future", "senders")

    def __init__(self, count: int, future: asyncio.Future[list[str]]) -> None:
        self.count = count
        self.senders: list[str] = []
        self.future = future


class NotificationBox:
    def __init__(self, max_unclaimed: int, max_unclaimed_bytes: int = 64 << 20) -> None:
        """Unclaimed notifications are kept up to `max_unclaimed` of them, and up to `max_unclaimed_bytes`
        of distinct messages and their senders' ids (a peer may send NIXL notifications of a MiB each, or
        name itself with a long id); the oldest go first, counted and logged."""
        self._max_unclaimed = max_unclaimed
        self._max_unclaimed_bytes = max_unclaimed_bytes
        self._unclaimed: OrderedDict[bytes, deque[str]] = OrderedDict()
        self._unclaimed_total = 0
        self._unclaimed_bytes = 0  # of the distinct messages kept, and of each kept sender's id
        self._drops_logged_at = -math.inf
        self._waiters: dict[bytes, deque[_Waiter]] = {}
        self._subscribers: set[_Feed] = set()
        self._claiming = 0  # subscriptions that take every notification nobody waits for
        self._closed: BaseException | None = None  # what a wait hears once the box is closed
        self.dropped = 0  # unclaimed notifications pushed out by newer ones
        self.lost_subscriptions = 0  # subscriptions ended for falling too far behind

    @property
    def has_waiters(self) -> bool:
        return bool(self._waiters)

    @property
    def unclaimed(self) -> int:
        return self._unclaimed_total

    def deliver(self, sender: str, message: bytes) -> None:
        for feed in tuple(self._subscribers):  # (a subscription dropped unread leaves from its finalizer)
            behind = feed.qsize()  # (one message over the byte budget alone is still delivered)
            if behind >= self._max_unclaimed or (behind and feed.nbytes + len(message) > self._max_unclaimed_bytes):
                self._unsubscribe(feed)  # (what it holds is still read; then it ends)
                feed.put_nowait(_LOST)
                self.lost_subscriptions += 1
                continue
            feed.nbytes += len(message)
            feed.put_nowait(Notification(sender, message))
        self._route(sender, message, keep=not self._claiming)

    def _route(self, sender: str, message: bytes, *, keep: bool) -> None:
        """Give `message` to its oldest live waiter; with none, keep it unclaimed if `keep`."""
        waiters = self._waiters.get(message)
        while waiters:
            waiter = waiters[0]
            if waiter.future.done():  # timed out or cancelled meanwhile
                waiters.popleft()
                continue
            waiter.senders.append(sender)
            if len(waiter.senders) == waiter.count:
                waiters.popleft()
                waiter.future.set_result(waiter.senders)
            if not waiters:
                del self._waiters[message]
            return
        self._waiters.pop(message, None)
        if keep:
            self._keep(message, [sender])

    def _keep(self, message: bytes, senders: list[str]) -> None:
        box = self._unclaimed.get(message)
        if box is None:
            box = self._unclaimed[message] = deque()
            self._unclaimed_bytes += len(message)
        box.extend(senders)
        self._unclaimed.move_to_end(message)
        self._unclaimed_total += len(senders)
        self._unclaimed_bytes += sum(len(sender) for sender in senders)
        dropped = 0
        while self._unclaimed_total > self._max_unclaimed or self._unclaimed_bytes > self._max_unclaimed_bytes:
            oldest, box = next(iter(self._unclaimed.items()))
            self._unclaimed_bytes -= len(box.popleft())
            self._unclaimed_total -= 1
            dropped += 1
            if not box:
                del self._unclaimed[oldest]
                self._unclaimed_bytes -= len(oldest)
        if dropped:
            self.dropped += dropped
            now = time.monotonic()
            if now - self._drops_logged_at >= _DROPS_LOG_INTERVAL_S:  # (a flood is logged once per interval)
                self._drops_logged_at = now
                log.warning("%d unclaimed notifications dropped so far, oldest first (kept: at most %d of them, "
                            "%d bytes): nobody waits for them", self.dropped, self._max_unclaimed,
                            self._max_unclaimed_bytes)  # fmt: skip

    async def wait(self, message: bytes, count: int = 1, timeout: float | None = None) -> list[str]:
        """Wait until `count` notifications carrying `message` have arrived; return senders.

        Messages that arrived earlier count. On timeout or cancellation the ones collected so far
        are put back, so nothing is lost; timeout raises `NotificationTimeout`.
        """
        if not isinstance(message, bytes):
            raise TypeError(f"a notification is bytes, not {type(message).__name__} (encode it)")
        # (a count of 1.5 or NaN is never met: the wait would take every matching message, for ever)
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count <= 0:
            raise ValueError(f"count must be a whole number > 0, got {count!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                    or timeout != timeout):  # fmt: skip
            raise ValueError(f"timeout must be a number of seconds or None, got {timeout!r}")
        if self._closed is not None:  # (a lease's task may start only after the close)
            raise type(self._closed)(*self._closed.args)
        taken: list[str] = []
        box = self._unclaimed.get(message)
        while box and len(taken) < count:
            taken.append(box.popleft())
            self._unclaimed_total -= 1
            self._unclaimed_bytes -= len(taken[-1])
        if box is not None and not box:
            del self._unclaimed[message]
            self._unclaimed_bytes -= len(message)
        if len(taken) == count:
            return taken
        waiter = _Waiter(count, asyncio.get_running_loop().create_future())
        waiter.senders = taken
        self._waiters.setdefault(message, deque()).append(waiter)
        returned = False
        try:
            async with asyncio.timeout(timeout):
                senders = await waiter.future
            returned = True
            return senders
        except TimeoutError:
            shown = (
                repr(message) if len(message) <= _SHOWN_BYTES else f"{message[:_SHOWN_BYTES]!r}... ({len(message)} B)"
            )
            raise NotificationTimeout(f"{len(waiter.senders)} of {count} notifications {shown} arrived in {timeout}s",
                                      message=message) from None  # fmt: skip
        finally:
            if not returned:  # timed out or cancelled, even after its count was met: give them back
                waiter.future.cancel()
                self._forget(message, waiter)
                for sender in waiter.senders:  # to the waiters behind, else unclaimed
                    self._route(sender, message, keep=True)

    def _forget(self, message: bytes, waiter: _Waiter) -> None:
        waiters = self._waiters.get(message)
        if waiters is not None and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[message]

    def subscribe(self, *, claim: bool = False) -> AsyncIterator[Notification]:
        """Every notification delivered from now on (from this call, not from the first `__anext__`),
        in order, until the iterator is closed.

        With `claim`, the subscriber takes ownership of what no waiter wanted: such
        notifications are no longer kept as unclaimed (a consumer that counts every message
        itself, like a producer counting its readers, would otherwise fill the mailbox).
        """
        return _Subscription(self, claim)

    def _unsubscribe(self, feed: _Feed) -> None:
        if feed in self._subscribers:
            self._subscribers.remove(feed)
            self._claiming -= feed.claim

    def close(self, exc: BaseException) -> None:
        """Fail every waiter, and every wait from now on, and end every subscription (the engine is closing)."""
        self._closed = exc
        for queue in tuple(self._subscribers):
            queue.put_nowait(None)
        for waiters in self._waiters.values():
            for waiter in waiters:
                if not waiter.future.done():
                    waiter.future.set_exception(exc)
        self._waiters.clear()


class _Subscription:
    """An async iterator over one subscription's notifications; registered when made, so nothing
    delivered between `subscribe()` and the first `__anext__` is missed. Ends at `aclose()`, when the
    box closes, when an iteration is cancelled, or when dropped."""

    def __init__(self, box: NotificationBox, claim: bool) -> None:
        self._box: NotificationBox | None = None
        self._loop = asyncio.get_running_loop()
        self._queue = _Feed(claim)
        if box._closed is not None:  # (the engine closed: nothing will come)
            self._queue.put_nowait(None)
            return
        self._box = box
        box._subscribers.add(self._queue)
        box._claiming += claim

    def __aiter__(self) -> _Subscription:
        return self

    async def __anext__(self) -> Notification:
        if self._box is None:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: like an async generator's, the subscription ends
            self._end()
            raise
        if item is None:
            self._end()
            raise StopAsyncIteration
        if item is _LOST:
            self._end()
            raise NotificationsLost("this subscription fell too far behind (the unclaimed limits) and was ended")
        self._queue.nbytes -= len(item.message)
        return item

    async def aclose(self) -> None:
        self._end()

    def _end(self) -> None:
        box, self._box = self._box, None
        if box is not None:
            box._unsubscribe(self._queue)
            self._queue.put_nowait(None)  # a task reading it meanwhile ends too

    def __del__(self) -> None:
        box, self._box = self._box, None
        if box is None:
            return
        if asyncio._get_running_loop() is self._loop:
            box._unsubscribe(self._queue)
            return
        with contextlib.suppress(RuntimeError):  # (a closed loop: so is the box)
            # On the loop: the garbage collector may run this on any thread.
            self._loop.call_soon_threadsafe(box._unsubscribe, self._queue)


def _cancelling() -> int:
    """How many cancellations of the running task are pending (0 outside a task)."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


class Lease:
    """Blocks lent to remote readers until they all notify `message`, or `expires_at` passes.

    `expires_at` is this host's ``time.time()``; readers compare it with their own clock
    corrected by the offset measured at the handshake. Await the lease (or `wait()`): True
    when every reader notified, False when it expired first.
    """

    def __init__(self, box: NotificationBox, message: bytes, readers: int, ttl_s: float) -> None:
        if not isinstance(message, bytes):
            raise TypeError(f"a notification is bytes, not {type(message).__name__} (encode it)")
        if isinstance(ttl_s, bool) or not (isinstance(ttl_s, int | float) and 0 < ttl_s < math.inf):
            raise ValueError(f"ttl_s must be a finite number > 0, got {ttl_s!r}")
        try:
            count = -1 if isinstance(readers, bool) else operator.index(readers)  # (numpy's ints too)
        except TypeError:
            count = -1
        if count < 1:
            raise ValueError(f"readers must be an int >= 1, got {readers!r}")
        self.message = message
        self.readers = count
        self.expires_at = time.time() + ttl_s
        self._task = asyncio.get_running_loop().create_task(self._hold(box, ttl_s))
        # A lease nobody awaits (the engine closed under it) must not log "never retrieved".
        self._task.add_done_callback(lambda task: task.cancelled() or task.exception())

    async def _hold(self, box: NotificationBox, ttl_s: float) -> bool:
        try:
            await box.wait(self.message, self.readers, timeout=ttl_s)
        except NotificationTimeout:
            return False
        return True

    def done(self) -> bool:
        return self._task.done()

    def cancel(self) -> None:
        """Stop holding (e.g. shutdown); notifications that arrived are kept for others."""
        self._task.cancel()

    async def wait(self) -> bool:
        """True once every reader notified; False when the lease expired first, or was cancelled."""
        before = _cancelling()
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if self._task.cancelled() and _cancelling() <= before:
                return False  # (`cancel()` stopped the lease; the awaiting task itself was not cancelled)
            raise

    def __await__(self) -> Generator[Any, None, bool]:
        return self.wait().__await__()
