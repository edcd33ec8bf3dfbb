"""How big a slice to post, and when a transfer in flight may end: rates learned from posts (no I/O).

Over UCX's CMA transport (and cuda_ipc between GPUs) a post is a synchronous copy inside
`transfer()`, so the slice size bounds how long one post stalls the event loop; the engine aims
at `post_target_s` of copying per post, at the rate of its route (local and remote memory kind: a
GPU copy is ~20x a host copy). Only posts that complete inline tell us a copy rate:
the estimate drops at once on a slow copy (an overestimate means a long stall) and recovers
gradually. Time a post spends waiting (for the GIL, mostly) is not copying: it stretches the
slices instead of shrinking them (`CopyRate`).

Over transports that do not copy inside the post (TCP, RDMA) a post costs little
whatever its size, and small slices only leave the wire short of work: there a slice carries
`slice_flight_s` of wire time at the rate recent transfers to that peer moved at (`LinkRates`).
"""

from __future__ import annotations

import sys

from .config import EngineConfig

__all__ = ["CopyRate", "CopyRates", "LinkRates", "Route", "WireRate", "slice_bytes"]

_INITIAL_COPY_RATE = 4e9  # a conservative first guess (CMA here does 4-12 GB/s)

Route = tuple[str, str]  # (local memory kind, remote memory kind), e.g. ("VRAM", "VRAM")


class CopyRate:
    """How fast posts that complete inline copy, and what waiting around each post costs.

    The copy runs on the loop's thread with the GIL released, so it is timed by the thread's
    CPU time. The rest of a post's wall time is waiting: for the GIL (another Python thread of
    the process runs meanwhile, e.g. vLLM's model thread) or for a core. It comes with every
    post whatever its size, so slices are made long enough to outweigh it (`COPY_OVER_WAIT`).
    A copy that a DMA engine does while the thread sleeps would read as fast and waited for,
    so its slices come out longer than the target; a cuda_ipc READ's post kept a core busy for
    its whole time on an H100 (docs/gpu.md).
    """

    __slots__ = ("_config", "bytes_per_s", "wait_s")

    COPY_OVER_WAIT = 2.0  # a slice copies for at least this many times the mean wait

    def __init__(self, config: EngineConfig, initial: float = _INITIAL_COPY_RATE) -> None:
        self._config = config
        self.bytes_per_s = initial
        self.wait_s = 0.0  # a running mean

    def observe(self, nbytes: int, copy_s: float, wall_s: float) -> None:
        """A post of `nbytes` completed inside the call: `copy_s` of this thread's CPU, `wall_s` in all.

        A wait counts up to Python's switch interval, about the longest the GIL takes to come
        back. Time off a core mid-copy grows with the slice, and counted whole it would double
        the slices on every post of an oversubscribed host.
        """
        # Big enough to measure: over half the floor, which every slice at the floor is (whole blocks: where a
        # block does not divide it, the floor's slice falls short of it, and measured only above it, one slow
        # post kept the rate, and the slices, at the floor for good)
        if 2 * nbytes > self._config.min_post_bytes and copy_s > 0:
            self.bytes_per_s = min(nbytes / copy_s, self.bytes_per_s * 1.25)
        wait = min(max(0.0, wall_s - copy_s), sys.getswitchinterval())
        self.wait_s += (wait - self.wait_s) / 4

    def slice_bytes(self) -> int:
        """Bytes per post so that an inline copy takes about `post_target_s`, or twice the wait if longer.

        So beside a busy thread a slice copies for up to twice the switch interval (10 ms).
        """
        cfg = self._config
        seconds = max(cfg.post_target_s, self.wait_s * self.COPY_OVER_WAIT)
        return int(min(cfg.max_post_bytes, max(cfg.min_post_bytes, self.bytes_per_s * seconds)))


class CopyRates:
    """One `CopyRate` per route: inline copies differ far more by memory kind than by peer.

    On an H100 a cuda_ipc copy between GPU buffers moved ~120 GB/s where CMA between host buffers
    moves 4-12 GB/s: a host copy sized by the GPU's rate would stall the loop ~25x its target
    (and the GPU's slices, sized by the host's, would need a dozen posts to grow back).
    """

    __slots__ = ("_config", "_rates")

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._rates: dict[Route, CopyRate] = {}

    def of(self, route: Route) -> CopyRate:
        rate = self._rates.get(route)
        if rate is None:
            rate = self._rates[route] = CopyRate(self._config)
        return rate


class WireRate:
    """Bytes per second a whole transfer moves between its first post and its completion.

    Learned from completions long enough to measure (on transports that copy inline as well as
    those that do not); it tells the poller when a transfer in flight may end, so it can sleep
    until then instead of spinning. An overestimate only makes the poller spin early.
    """

    __slots__ = ("bytes_per_s", "measured")

    MIN_SECONDS = 0.001  # shorter transfers say more about latency than about a rate

    def __init__(self, initial: float = 10e9) -> None:
        self.bytes_per_s = initial
        self.measured = False  # still the initial guess

    def observe(self, nbytes: int, seconds: float) -> None:
        """A transfer of `nbytes` took `seconds` from its first post until we saw it end.

        A slower transfer lowers the estimate at once (an overestimate keeps the poller spinning
        for nothing); a faster one raises it halfway (an underestimate costs up to one check
        interval of latency, and a transfer seen late measures slower, which corrects it).
        """
        if seconds >= self.MIN_SECONDS and nbytes > 0:
            rate = nbytes / seconds
            if not self.measured:
                self.bytes_per_s, self.measured = rate, True
            else:
                self.bytes_per_s = rate if rate < self.bytes_per_s else (self.bytes_per_s + rate) / 2

    STUCK_AFTER_S = 0.005  # past twice its expected time and this much, a transfer is not spun on any more

    def spin_window(self, first_post_at: float, nbytes: int, margin_s: float) -> tuple[float, float]:
        """When to start and when to stop checking hot on a transfer posted at `first_post_at` (same clock).

        Hot checks start `margin_s` plus a fifth of the expected time before the expected end,
        so that a transfer somewhat faster than expected is still seen at once (transfers
        sharing the wire take longer than expected: the poller then only spins early). They stop
        once it is overdue by its expected time plus `STUCK_AFTER_S`: a transfer that stalls (a
        paused peer, a cut link) is checked at the busy interval instead of burning a core until
        its deadline; one merely slower than expected is seen up to an interval late, and its
        completion corrects the rate.
        """
        expected = nbytes / self.bytes_per_s
        return first_post_at + 0.8 * expected - margin_s, first_post_at + 2 * expected + self.STUCK_AFTER_S


class LinkRates:
    """What transfers to one peer have shown: whether its posts copy inline, and its wire rate.

    Transfers that do not copy inline move only while the peer progresses its UCX worker (over
    TCP a READ is served by the peer's worker), and an idle peer progresses it every 50 ms; so
    while such transfers are in flight the peer gets a busy hint every `BUSY_HINT_RENEW_S`.
    """

    __slots__ = ("busy_hint_until", "inline", "wire")

    BUSY_HINT_S = 1.0  # how long one hint asks the peer to stay brisk
    BUSY_HINT_RENEW_S = 0.5  # sent again once this little of it is left

    def __init__(self) -> None:
        self.inline: bool | None = None  # unknown until a post to it returns
        self.wire = WireRate()
        self.busy_hint_until = float("-inf")  # loop time

    def posted(self, state: str) -> None:
        """A post (without a notification riding on it) returned `state`."""
        if state in ("DONE", "PROC"):
            self.inline = state == "DONE"

    def busy_hint_due(self, now: float) -> bool:
        """Whether to hint the peer now (`now` on the loop's clock), with a transfer in flight or about to be.

        Never for a peer whose posts copy inline (nothing is left in flight for its worker to serve).
        """
        if self.inline or now < self.busy_hint_until - self.BUSY_HINT_RENEW_S:
            return False
        self.busy_hint_until = now + self.BUSY_HINT_S
        return True


def slice_bytes(config: EngineConfig, copy: CopyRate, link: LinkRates) -> int:
    """Bytes per slice for the next transfer to a peer.

    Inline copies (or a link whose rate is not measured yet) are sized to stall the loop about
    `post_target_s`; others to keep `slice_flight_s` of wire time per slice, so a cancelled
    transfer still ends soon (its slices in flight must land first) while the wire stays busy.
    """
    if link.inline is not False or not link.wire.measured or config.slice_flight_s is None:
        return copy.slice_bytes()
    wanted = link.wire.bytes_per_s * config.slice_flight_s
    return int(min(config.max_post_bytes, max(config.min_post_bytes, wanted)))
