"""Progressive push, the pure part: which blocks of a layer may go now, and whether a push is whole.

In push mode decode registers its blocks before prefill is done, often before prefill starts.
Prefill then need not wait for the end of the request: after its forward pass computed layer
*l* for a step, every block whose tokens are all computed holds its final KV for layer *l*
and can be written while the next layers compute. The request is committed (decode's
notification) only once every layer of every block has landed, so decode never starts on a
partial request.

The scheduler follows prefill's requests for decode and hands each step's `PrefillStep` to the
workers. A worker hands each progressive push, per step, the blocks completed since its last
step (``[lo, hi)`` by position in the request), and per computed layer a `LayerReady`. The push
writes what it is handed and records it in a `LayerCoverage`; at the end (`RequestDone`) it
commits if the coverage is whole, else it writes the whole request again (a registration
claimed late, a layer vLLM did not report, a request preempted and resumed in other blocks).
A block is written once per layer: a block still being filled is left for the step that fills
it, so two WRITEs never race for the same bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LayerCoverage", "LayerReady", "PrefillFollower", "PrefillStep", "ProgressiveFeed", "RequestDone"]


@dataclass(frozen=True)
class PrefillStep:
    """One step of a request prefill computes for decode (scheduler -> workers, in vLLM's metadata)."""

    blocks: tuple[list[int], ...]  # the request's blocks so far, per KV cache group (vLLM's logical ids)
    start: int  # tokens computed before this step
    stop: int  # ... once it ends
    prompt_len: int
    resumed: bool = False  # preempted earlier and given its blocks anew

    def prompt_blocks(self, block_size: int) -> int:
        return -(-self.prompt_len // block_size)

    def done_blocks(self, block_size: int) -> int:
        """Blocks whose every token is computed once this step ends (the prompt's last one at its end)."""
        if self.stop >= self.prompt_len:
            return self.prompt_blocks(block_size)
        return self.stop // block_size


class PrefillFollower:
    """Follows requests through prefill, step by step, from vLLM's scheduler output (scheduler side).

    The output lists a request's blocks whole when it is first scheduled (or resumed after a
    preemption) and only its new blocks after that; a step computes tokens ``[num_computed,
    num_computed + scheduled)``. Progressive push hands each step on to the workers; host staging
    copies the blocks each step wrote.
    """

    def __init__(self) -> None:
        self._followed: dict[str, tuple[int, list[list[int]]]] = {}  # request -> (prompt tokens, blocks so far)

    def __bool__(self) -> bool:
        return bool(self._followed)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._followed

    def follow(self, request_id: str, prompt_len: int) -> None:
        self._followed.setdefault(request_id, (prompt_len, []))

    def forget(self, request_id: str) -> None:
        self._followed.pop(request_id, None)

    def steps(self, out: Any) -> Iterator[tuple[str, PrefillStep, bool]]:
        """(request, its `PrefillStep`, fresh) per followed request whose prompt `out` computes some of.

        Fresh: its blocks came whole in this step (its first, or it was resumed).
        """
        scheduled = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            if new.req_id in self._followed:
                yield from self._step(new.req_id, new.num_computed_tokens, new.block_ids, True, scheduled)
        cached = out.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            if request_id in self._followed:
                yield from self._step(request_id, cached.num_computed_tokens[i], cached.new_block_ids[i],
                                      request_id in cached.resumed_req_ids, scheduled)  # fmt: skip

    def _step(self, request_id: str, start: int, blocks: Any, whole: bool, scheduled: dict[str, int]
              ) -> Iterator[tuple[str, PrefillStep, bool]]:  # fmt: skip
        prompt, held = self._followed[request_id]
        resumed = whole and bool(held)  # blocks given anew after a preemption: they may have changed
        if whole:
            held[:] = [list(group) for group in blocks]
        elif blocks is not None:
            for mine, new in zip(held, blocks, strict=True):
                mine.extend(new)
        stop = min(prompt, start + scheduled.get(request_id, 0))
        if start < prompt:
            yield request_id, PrefillStep(tuple(list(g) for g in held), start, stop, prompt, resumed), whole


@dataclass(frozen=True)
class LayerReady:
    """Layer `region` is computed for blocks ``[lo, hi)`` of the request (positions in `blocks`)."""

    region: int
    lo: int
    hi: int
    blocks: list[int]
    resumed: bool = False


@dataclass(frozen=True)
class RequestDone:
    """Prefill finished the request: its final blocks, per KV cache group."""

    blocks: tuple[list[int], ...]


@dataclass
class LayerCoverage:
    """What a progressive push wrote: per region, blocks ``[0, next)``, and from which block ids."""

    regions: int
    next: list[int] = field(default_factory=list)
    written_from: dict[int, int] = field(default_factory=dict)  # position -> block id it was written from
    broken: bool = False  # something was not written, or may have been read from reused blocks

    def __post_init__(self) -> None:
        self.next = [0] * self.regions

    def accepts(self, item: LayerReady) -> bool:
        """Whether `item` continues its region where the last one ended (else the final write covers all).

        A resumed request breaks the coverage: writes in flight may have read blocks the preemption freed.
        """
        ok = not (self.broken or item.resumed) and 0 <= item.region < self.regions and self.next[item.region] == item.lo
        self.broken = not ok
        return ok

    def wrote(self, item: LayerReady) -> None:
        self.next[item.region] = item.hi
        for position in range(item.lo, item.hi):
            if self.written_from.setdefault(position, item.blocks[position]) != item.blocks[position]:
                self.broken = True

    def whole(self, final_blocks: list[int]) -> bool:
        """Whether every layer of every final block was written from the block prefill ends with."""
        n = len(final_blocks)
        return (
            not self.broken
            and all(x == n for x in self.next)
            and all(self.written_from.get(p) == b for p, b in enumerate(final_blocks))
        )


@dataclass(eq=False)
class ProgressiveFeed:
    """One progressive push: the model thread's cursor, and the queue the push reads on the loop."""

    push_id: str
    prompt_blocks: int
    next_block: int = 0  # model thread: the first block not handed over yet
    queue: asyncio.Queue[LayerReady | RequestDone] = field(default_factory=asyncio.Queue)
    over: bool = False  # set on the loop once the push ended: nothing more is queued

    def give(self, item: LayerReady | RequestDone) -> None:
        """Loop thread: queue `item` for the push, unless it is over."""
        if not self.over:
            self.queue.put_nowait(item)

    def hand_over(self, step: PrefillStep, block_size: int) -> LayerReady | None:
        """Model thread: what this step hands the push (its region set per layer), or None.

        The blocks completed since the last step; and a resumed step always hands something,
        if only an empty range, since its flag must break the coverage: a step that recomputes
        only blocks already handed over would otherwise let a preemption go unseen.
        """
        done = step.done_blocks(block_size)
        if done <= self.next_block and not step.resumed:
            return None
        item = LayerReady(-1, self.next_block, max(done, self.next_block), step.blocks[0], step.resumed)
        self.next_block = item.hi
        return item
