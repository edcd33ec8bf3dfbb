"""Which remote ranks a worker reads, and which byte windows: pure translation, no I/O.

vLLM shards KV heads across tensor-parallel ranks, and on the CPU backend a block of one layer
is laid out head-major (``[heads, block_size, 2 * head_dim]``), so a rank's share of a block is
one contiguous byte window. Reading between engines of different TP sizes is then a matter of
windows (see `nixl_async.layout.BlockView`):

- reader TP > writer TP (ratio r): reader rank d reads writer rank ``d // r``, taking the
  ``d % r``-th of r equal windows of each remote block into its whole local block;
- reader TP < writer TP (ratio r): reader rank d reads writer ranks ``d*r .. d*r + r - 1``, each
  whole remote block landing in the k-th of r windows of its local block;
- MLA (one latent cache replicated on every rank): whole blocks from one rank; the other ranks
  of the group are only notified, so they can free their copies.

Every writer rank frees a request's blocks after ``expected_consumers`` notifications.
"""

from __future__ import annotations

from dataclasses import dataclass

from nixl_async.exceptions import LayoutError
from nixl_async.layout import ViewSpec

__all__ = ["RankRead", "expected_consumers", "plan_reads"]


@dataclass(frozen=True)
class RankRead:
    """One remote rank to contact for a request: read with these views, or only notify."""

    remote_rank: int
    local: ViewSpec
    remote: ViewSpec
    read: bool = True


def _ratio(big: int, small: int, what: str) -> int:
    if big % small:
        raise LayoutError(f"{what}: TP sizes {big} and {small} are not multiples of each other")
    return big // small


def plan_reads(
    *, local_tp: int, local_rank: int, remote_tp: int, local_part_len: int, remote_part_len: int, mla: bool = False
) -> list[RankRead]:
    """The remote ranks a local rank must read (or notify), with matching views.

    `*_part_len` are the bytes of one block part (a whole block, or one K/V half) on each side;
    they must agree with the TP ratio, else `LayoutError` (e.g. different head counts per rank).
    """
    if not 0 <= local_rank < local_tp or remote_tp <= 0:
        raise LayoutError(f"rank {local_rank} of TP {local_tp} reading TP {remote_tp} is not a valid placement")
    whole = ViewSpec()
    if mla:
        if local_part_len != remote_part_len:
            raise LayoutError(f"MLA caches must match: local part {local_part_len}, remote {remote_part_len}")
        if local_tp >= remote_tp:
            return [RankRead(local_rank // _ratio(local_tp, remote_tp, "MLA"), whole, whole)]
        r = _ratio(remote_tp, local_tp, "MLA")
        first = local_rank * r
        return [RankRead(first + k, whole, whole, read=k == 0) for k in range(r)]
    if local_tp >= remote_tp:
        r = _ratio(local_tp, remote_tp, "heterogeneous TP")
        if remote_part_len != r * local_part_len:
            raise LayoutError(
                f"a remote part of {remote_part_len} bytes does not hold {r} local parts of {local_part_len} bytes"
            )
        k = local_rank % r
        window = ViewSpec(chunk_offset=k * local_part_len, chunk_len=local_part_len)
        return [RankRead(local_rank // r, whole, window)]
    r = _ratio(remote_tp, local_tp, "heterogeneous TP")
    if local_part_len != r * remote_part_len:
        raise LayoutError(
            f"a local part of {local_part_len} bytes does not hold {r} remote parts of {remote_part_len} bytes"
        )
    return [
        RankRead(local_rank * r + k, ViewSpec(chunk_offset=k * remote_part_len, chunk_len=remote_part_len), whole)
        for k in range(r)
    ]


def expected_consumers(*, remote_tp: int, local_tp: int) -> int:
    """How many reader ranks notify each writer rank for one request (fan-in count)."""
    return max(1, local_tp // remote_tp)
