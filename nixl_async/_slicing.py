"""How big a slice to post: sized from the copy rate measured on recent posts (no I/O).

Over UCX's CMA transport a post is a synchronous copy inside `transfer()`, so the slice size
bounds how long one post stalls the event loop; the engine aims at `post_target_s` per post.
Only posts that complete inline tell us a copy rate: the estimate drops at once on a slow
post (an overestimate means a long stall) and recovers gradually.
"""

from __future__ import annotations

from .config import EngineConfig

__all__ = ["CopyRate"]

_INITIAL_COPY_RATE = 4e9  # a conservative first guess (CMA here does 4-12 GB/s)


class CopyRate:
    __slots__ = ("_config", "bytes_per_s")

    def __init__(self, config: EngineConfig, initial: float = _INITIAL_COPY_RATE) -> None:
        self._config = config
        self.bytes_per_s = initial

    def observe(self, nbytes: int, seconds: float) -> None:
        """A post of `nbytes` completed inside the call in `seconds`."""
        if nbytes >= self._config.min_post_bytes and seconds > 0:  # big enough to measure
            self.bytes_per_s = min(nbytes / seconds, self.bytes_per_s * 1.25)

    def slice_bytes(self) -> int:
        """Bytes per post so that an inline copy takes about `post_target_s`."""
        cfg = self._config
        return int(min(cfg.max_post_bytes, max(cfg.min_post_bytes, self.bytes_per_s * cfg.post_target_s)))
