"""How often the engine's poller wakes: a pure pacing policy, no I/O.

Why this shape (measured on 2-core CPU machines, see docs in README "Design"):

- NIXL exposes no file descriptor or callback for completions: state must be polled, and with
  NIXL's progress thread off, our polls are also what progresses the UCX worker.
- While a transfer may be about to end, or has slices to post, we check on every loop
  iteration, yielding in between (``sleep(0)``). Completion is then seen tens of microseconds
  after it happens. Sub-ms sleeps cannot do this: asyncio's timers round up to ~1.1 ms.
- While transfers are in flight but none is expected to end yet (from the rate recent
  transfers moved at), we check every ~1 ms instead of spinning. A "1 ms" sleep between checks
  of a TCP read lasts 2-3 ms in fact (asyncio rounds timers up, and each check receives what
  arrived meanwhile), so the poller goes hot once a transfer may end within the interval it
  measured between such checks, not within the nominal one: else most reads ended during the
  last sleep and were seen ~1 ms late. Over UCX/TCP a spin was paid
  twice: a core's worth of CPU (and GIL) for every in-flight second, and, on 2 cores, half the
  throughput, since the spinning thread took the CPU the kernel and the peer needed to move
  the bytes (192 MiB read: 0.7 GB/s spinning, 1.2-1.5 GB/s checking every ms, 5x less CPU).
- A submit that posts a transfer which is then in flight does not wake the poller at once (that
  check only finds it in flight): its first check comes when a busy check would look again.
- Right after activity we keep spinning for a short linger, because work comes in bursts
  (a vLLM step submits several requests; a finished read is often followed by another).
- Then we back off, doubling from 1 ms to an idle interval (50 ms by default). An idle engine
  costs well under 1 % of a core, and a new submit wakes the poller at once anyway.
- While someone awaits a notification, or right after we served a handshake (the peer's
  first transfer needs our worker progressed for UCX wire-up), the interval is capped low.
"""

from __future__ import annotations

import logging
import time

from .config import PollConfig

__all__ = ["AdaptivePacer", "ErrorThrottle"]


class AdaptivePacer:
    """Decides the poller's next sleep from what is going on.

    `delay()` returns 0.0 for "yield and poll again", else seconds to sleep (a wake-up from
    the engine can cut the sleep short).
    """

    __slots__ = ("_backoff", "_brisk_until", "_config", "_last_activity", "_slept_at", "busy_gap_s")

    GAP_WEIGHT = 0.5  # of each new measurement in `busy_gap_s`

    def __init__(self, config: PollConfig) -> None:
        self._config = config
        self._last_activity = float("-inf")
        self._brisk_until = float("-inf")
        self._backoff = config.backoff_start_s
        self._slept_at: float | None = None  # when the last busy check chose to sleep
        self.busy_gap_s = config.busy_interval_s  # what such a sleep lasts until the next check, as measured

    def activity(self, now: float) -> None:
        """Our own transfers moved (a post, a completion): poll hot again."""
        self._last_activity = now
        self._backoff = self._config.backoff_start_s

    def stay_brisk(self, until: float) -> None:
        """Poll at least every `waiting_interval_s` until `until` (e.g. after a handshake)."""
        self._brisk_until = max(self._brisk_until, until)

    def after_post(self, hot_in: float) -> float:
        """Transfers were just posted and are in flight: 0.0 to check them at once, else seconds until
        their first check. Checking a read that just left finds it in flight (a loop turn, a
        notification drain and a state check wasted); this is the sleep a busy check would choose."""
        return self._busy_delay(hot_in, self._config.busy_interval_s)

    def _busy_delay(self, hot_in: float, last_gap: float) -> float:
        """0.0 (check hot) if a transfer may end within the interval sleeps really last, else the busy interval."""
        cfg = self._config
        hot = cfg.spin and hot_in < max(cfg.busy_interval_s, self.busy_gap_s, last_gap)
        return 0.0 if hot or cfg.busy_interval_s <= 0 else cfg.busy_interval_s

    def delay(self, now: float, *, busy: bool, waiting: bool, hot_in: float = 0.0) -> float:
        """`hot_in`: seconds until a transfer in flight may end or wants a post (<= 0: now)."""
        cfg = self._config
        if busy:
            last = cfg.busy_interval_s
            if self._slept_at is not None:
                last = min(now - self._slept_at, 10 * cfg.busy_interval_s)
                self.busy_gap_s += self.GAP_WEIGHT * (last - self.busy_gap_s)
            delay = self._busy_delay(hot_in, last)
            self._slept_at = now if delay else None
            return delay
        self._slept_at = None
        if cfg.spin and now - self._last_activity < cfg.linger_s:
            return 0.0
        delay = self._backoff
        self._backoff = min(self._backoff * 2, cfg.idle_interval_s)
        if waiting or now < self._brisk_until:
            delay = min(delay, cfg.waiting_interval_s)
        return delay


class ErrorThrottle:
    """Log a repeating poller error once per interval with a count, and back off while it repeats."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 10.0) -> None:
        self._log, self._what, self._interval = logger, what, interval_s
        self._last_logged = float("-inf")
        self._suppressed = 0
        self.backoff_s = 0.01

    def record(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._last_logged >= self._interval:
            more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
            self._log.error("%s%s", self._what, more, exc_info=exc)
            self._last_logged, self._suppressed = now, 0
        else:
            self._suppressed += 1
        self.backoff_s = min(self.backoff_s * 2, 1.0)

    def ok(self) -> None:
        self.backoff_s = 0.01
