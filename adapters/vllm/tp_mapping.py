"""Which remote ranks a worker reads, and which byte windows: pure translation, no I/O.

vLLM shards KV heads across tensor-parallel ranks (rank r of TP t holds heads from
``r * kv_heads // t``; once t exceeds the KV heads, each holds one head and ``t / kv_heads``
ranks hold the same one). In a head-major block a rank's heads are one contiguous byte window
(see `nixl_async.layout.BlockView`), so reading between engines of different TP sizes is a
matter of windows, counted in heads:

- reader TP >= writer TP: reader rank d reads writer rank ``d * writer_tp // reader_tp``,
  taking the window of its own heads out of each remote block (all of it when both sides hold
  the same heads, as with replicated heads);
- reader TP < writer TP: reader rank d hears from writer ranks ``d*r .. d*r + r - 1``; it reads
  the first of them holding each head group into that group's window of its local block and
  only notifies the replicas (vLLM's NixlConnector refuses this case for attention models);
- MLA (one latent cache replicated on every rank): whole blocks from one rank; the other ranks
  of the group are only notified, so they can free their copies.

Every writer rank frees a request's blocks after ``expected_consumers`` notifications.

When the writer's blocks hold fewer tokens than ours (block-size ratio r), r remote blocks fill
one local block. In a head-major block each head's K (and V) is a contiguous *run* of tokens,
and remote block k's tokens sit at offset ``k * remote_block_size`` inside every local run, so
`split_for_block_ratio` pairs them run by run: one transfer per run, its local window cut into
r pieces, piece k taking remote block k's run. Descriptors land every byte in place; nothing is
permuted after the read. Push mode uses the same cut with the roles swapped: prefill's blocks are
the larger ones, so its window is cut and each piece is written into one of decode's blocks
(where decode's prefix hit ends inside a prefill block, the first pieces of it are skipped).
"""

from __future__ import annotations

from dataclasses import dataclass

from nixl_async.exceptions import LayoutError
from nixl_async.layout import ViewSpec

__all__ = ["RankRead", "ReadPart", "expected_consumers", "plan_reads", "remote_ranks", "split_for_block_ratio"]


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


def _heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads one rank of `tp` holds: an equal share, or one replicated head once TP exceeds them."""
    if kv_heads <= 0 or (kv_heads % tp if tp <= kv_heads else tp % kv_heads):
        raise LayoutError(f"{kv_heads} KV heads cannot be sharded over TP {tp} (nor replicated across it)")
    return max(1, kv_heads // tp)


def plan_reads(
    *,
    local_tp: int,
    local_rank: int,
    remote_tp: int,
    local_part_len: int,
    remote_part_len: int,
    kv_heads: int,
    mla: bool = False,
) -> list[RankRead]:
    """The remote ranks a local rank must read (or notify), with matching views.

    Rank r of TP t holds KV heads from ``r * kv_heads // t``: ``kv_heads / t`` of them, or one
    (shared by ``t / kv_heads`` ranks) once TP exceeds the model's KV heads, as vLLM shards
    them. Where several remote ranks hold the same heads, one is read and the others are only
    notified, so they free their copies. `*_part_len` are the bytes of one block part (a whole
    block, or one K/V half) on each side; they must hold the same bytes per head, else
    `LayoutError`. `kv_heads` is ignored for MLA (one latent replicated on every rank).
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
    local_heads, remote_heads = _heads_per_rank(kv_heads, local_tp), _heads_per_rank(kv_heads, remote_tp)
    head_len, rest = divmod(local_part_len, local_heads)
    if rest or remote_part_len != head_len * remote_heads:
        raise LayoutError(
            f"a local part of {local_part_len} bytes for {local_heads} heads and a remote part of "
            f"{remote_part_len} bytes for {remote_heads} heads differ in bytes per head"
        )
    local_first = local_rank * kv_heads // local_tp

    def window(offset_heads: int, heads: int, part_heads: int) -> ViewSpec:
        if offset_heads == 0 and heads == part_heads:
            return whole
        return ViewSpec(chunk_offset=offset_heads * head_len, chunk_len=heads * head_len)

    if local_tp >= remote_tp:  # our heads are a window of one remote rank's
        remote_rank = local_rank // _ratio(local_tp, remote_tp, "heterogeneous TP")
        offset = local_first - remote_rank * kv_heads // remote_tp
        return [RankRead(remote_rank, whole, window(offset, local_heads, remote_heads))]
    # several remote ranks hold our heads: read the first holder of each head group, notify the rest
    r = _ratio(remote_tp, local_tp, "heterogeneous TP")
    steps, seen = [], set()
    for remote_rank in range(local_rank * r, local_rank * r + r):
        remote_first = remote_rank * kv_heads // remote_tp
        fresh = remote_first not in seen
        seen.add(remote_first)
        local_view = window(remote_first - local_first, remote_heads, local_heads) if fresh else whole
        steps.append(RankRead(remote_rank, local_view, whole, read=fresh))
    return steps


def remote_ranks(*, local_tp: int, local_rank: int, remote_tp: int) -> list[int]:
    """Every remote rank a local rank hears from or must notify (whatever the layouts)."""
    if local_tp >= remote_tp:
        return [local_rank * remote_tp // local_tp]
    r = _ratio(remote_tp, local_tp, "heterogeneous TP")
    return list(range(local_rank * r, local_rank * r + r))


def expected_consumers(*, remote_tp: int, local_tp: int) -> int:
    """How many reader ranks notify each writer rank for one request (fan-in count)."""
    return max(1, local_tp // remote_tp)


@dataclass(frozen=True)
class ReadPart:
    """One transfer: `local_blocks` through the `local` view from `remote_blocks` through `remote`."""

    local_blocks: list[int]
    remote_blocks: list[int]
    local: ViewSpec
    remote: ViewSpec


def split_for_block_ratio(
    step: RankRead,
    local_blocks: list[int],
    remote_blocks: list[int],
    *,
    ratio: int,
    local_part_len: int,
    run_len: int | None,
    first_piece: int = 0,
) -> list[ReadPart]:
    """The transfers that carry `step` when each local block holds `ratio` remote blocks.

    `step` comes from `plan_reads` called with the remote part length scaled by `ratio` (as if
    the remote blocks were as large as ours). `run_len` is the bytes of one token run in a local
    block (one head's K or V for all its tokens), or None when a block is token-major (MLA):
    then the remote blocks are simply consecutive pieces of the window. The last local block may
    be partly filled (fewer than `ratio` remote blocks left). The first remote block takes piece
    `first_piece` of the first local block (the pieces before it are not transferred), so that
    block too may be partly covered.
    """
    if ratio == 1 and first_piece == 0:
        return [ReadPart(list(local_blocks), list(remote_blocks), step.local, step.remote)]
    if ratio < 1:
        raise LayoutError(f"remote blocks larger than local ones (ratio {ratio}) cannot be split")
    if not 0 <= first_piece < ratio:
        raise LayoutError(f"piece {first_piece} does not exist in a block holding {ratio} remote blocks")
    head = min(len(remote_blocks), ratio - first_piece) if first_piece else 0
    full, tail = divmod(len(remote_blocks) - head, ratio)
    needed = (head > 0) + full + (tail > 0)
    if len(local_blocks) != needed:
        raise LayoutError(
            f"{len(remote_blocks)} remote blocks at ratio {ratio} from piece {first_piece} need {needed} local "
            f"blocks, got {len(local_blocks)}"
        )
    local_off = step.local.chunk_offset
    local_len = step.local.chunk_len if step.local.chunk_len is not None else local_part_len - local_off
    remote_off = step.remote.chunk_offset
    if remote_off % ratio:
        raise LayoutError(f"remote window offset {remote_off} is not a multiple of the ratio {ratio}")
    remote_off //= ratio
    unit = local_len if run_len is None else run_len
    if local_len % unit or unit % ratio:
        raise LayoutError(f"a {local_len}-byte window does not cut into runs of {unit} bytes at ratio {ratio}")
    piece = unit // ratio
    # (local blocks, remote blocks, first piece, pieces): a partly covered first block, full ones, a partial last one
    segments: list[tuple[list[int], list[int], int, int]] = []
    if head:
        segments.append(([local_blocks[0]], list(remote_blocks[:head]), first_piece, head))
    local_rest, remote_rest = local_blocks[int(head > 0) :], remote_blocks[head:]
    if full:
        segments.append((list(local_rest[:full]), list(remote_rest[: full * ratio]), 0, ratio))
    if tail:
        segments.append(([local_rest[full]], list(remote_rest[full * ratio :]), 0, tail))
    parts: list[ReadPart] = []
    for j in range(local_len // unit):
        remote_view = ViewSpec(chunk_offset=remote_off + j * piece, chunk_len=piece)
        for local_ids, remote_ids, first, count in segments:
            local_view = ViewSpec(chunk_offset=local_off + j * unit + first * piece, chunk_len=count * piece,
                                  split=count)  # fmt: skip
            parts.append(ReadPart(list(local_ids), list(remote_ids), local_view, remote_view))
    return parts
