"""Push mode's planning: what decode registers and what prefill WRITEs. Pure translation, no I/O.

Decode plans from prefill's layout as pull mode plans (`worker.plan_request`, `tp_mapping`) and
registers with each prefill rank its block ids and byte windows (`registrations_for`); prefill
turns a registration and its own blocks into WRITEs (`write_parts`). Views are byte windows of
each side's own blocks. Prefill blocks k times larger than decode's are cut by token runs
(`tp_mapping.split_for_block_ratio`, prefill in the larger role), as vLLM's push connector
supports; prefill blocks smaller than decode's are refused (pull mode reads them).
`layer_parts` narrows a plan to one layer and the blocks a progressive push may send now.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from nixl_async import LayoutError, Peer, ViewSpec

from .block_pairs import GroupBlocks, in_kernel_pages, pair_blocks, window_pages_of_prompt
from .kv_layout import no_head_window
from .progressive import LayerReady
from .push_book import PushGroup, PushRegistration
from .tp_mapping import RankRead, plan_reads, split_for_block_ratio
from .worker import LAYOUT, KVGeometry, RecvJob, check_bytes_meaning, plan_request

__all__ = ["WHOLE", "WritePart", "layer_parts", "make_registration", "plan_push", "registrations_for", "write_parts"]

WHOLE = ViewSpec()  # every byte of a block


# -- decode: what to register ----------------------------------------------------------------
def _block_ratio(prefill_block_size: int, decode_block_size: int) -> int:
    """Decode blocks per prefill block: push cuts prefill's larger blocks and takes no smaller ones."""
    if decode_block_size <= 0 or prefill_block_size < decode_block_size:
        raise LayoutError(f"push mode: prefill blocks of {prefill_block_size} tokens, smaller than decode's "
                          f"({decode_block_size}), are not supported (pull mode reads them)")  # fmt: skip
    ratio, rest = divmod(prefill_block_size, decode_block_size)
    if rest:
        raise LayoutError(f"push mode: prefill blocks of {prefill_block_size} tokens are not a multiple of "
                          f"decode's ({decode_block_size})")  # fmt: skip
    return ratio


def _refuse_cut(geometry: KVGeometry, kinds: list[str], prefill_block_size: int, decode_block_size: int) -> None:
    """Raise `LayoutError` where prefill's blocks cannot be cut into decode's smaller ones."""
    cut = f"prefill blocks of {prefill_block_size} tokens cannot be cut into decode's of {decode_block_size}"
    if geometry.ratio_refusal:
        raise LayoutError(f"{cut}: {geometry.ratio_refusal}")
    for kind in kinds:
        if kind == "state":
            raise LayoutError(f"{cut}: a state (Mamba / linear attention) group holds one slot, not tokens")
        if kind == "window":
            raise LayoutError(f"{cut}: sliding-window groups need equal block sizes")
    if len(kinds) > 1:
        raise LayoutError(f"{cut} with several KV cache groups (hybrid models need equal block sizes)")


def _rescaled(view: ViewSpec, multiply: int = 1, divide: int = 1) -> ViewSpec:
    """`view`'s window in a block `multiply / divide` times as large (the same heads' bytes)."""
    length = view.chunk_len
    if view.chunk_offset % divide or (length is not None and length % divide):
        raise LayoutError(f"a window of {length} bytes at {view.chunk_offset} does not scale by 1/{divide}")
    return msgspec.structs.replace(view, chunk_offset=view.chunk_offset * multiply // divide,
                                   chunk_len=None if length is None else length * multiply // divide)  # fmt: skip


def plan_push(geometry: KVGeometry, job: RecvJob, first: Peer) -> list[RankRead]:
    """Decode: the prefill ranks `job` registers with, each with the views it writes through.

    Planned from prefill rank `first`'s layout (every rank has the same geometry) as pull mode
    plans (`worker.plan_request`); views are byte windows of each side's own blocks. Prefill
    blocks k times larger than decode's are planned as if decode's were as large (the heads of
    a rank hold the same share of either block). Raises `LayoutError`, before anything is sent,
    for what push cannot place: prefill blocks smaller than decode's, a cut the cache packing
    does not allow (`KVGeometry.ratio_refusal`), state or sliding-window groups with a ratio,
    and whatever pull refuses.
    """
    prefill_block_size = int(first.extra.get("block_size", geometry.block_size))
    ratio = _block_ratio(prefill_block_size, geometry.block_size)
    if ratio == 1:
        return plan_request(geometry, job, first).steps
    check_bytes_meaning(geometry, first)
    _refuse_cut(geometry, [g.kind for g in job.groups], prefill_block_size, geometry.block_size)
    steps = plan_reads(
        local_tp=geometry.tp_size, local_rank=geometry.tp_rank, remote_tp=job.remote_tp, mla=geometry.mla,
        kv_heads=geometry.kv_heads, local_part_len=geometry.part_len * ratio,
        remote_part_len=first.layout(LAYOUT).part_len,
    )  # fmt: skip
    if not geometry.head_window and any(s.local != WHOLE or s.remote != WHOLE for s in steps if s.read):
        raise no_head_window(job.remote_tp, geometry.tp_size)
    return [RankRead(s.remote_rank, _rescaled(s.local, divide=ratio), s.remote, s.read) for s in steps]


def make_registration(
    geometry: KVGeometry,
    job: RecvJob,
    *,
    decode_engine_id: str,
    decode_address: tuple[str, int],
    write_by: float,
    write: bool,
    decode_view: ViewSpec = WHOLE,
    prefill_view: ViewSpec = WHOLE,
    decode_agent: str = "",
) -> PushRegistration:
    return PushRegistration(
        request_id=job.remote_request_id, decode_request_id=job.request_id, decode_engine_id=decode_engine_id,
        decode_host=decode_address[0], decode_port=decode_address[1], decode_tp=geometry.tp_size,
        decode_pages=geometry.pages_per_block, write=write, write_by=write_by, decode_view=decode_view,
        prefill_view=prefill_view, decode_block_size=geometry.block_size, decode_agent=decode_agent,
        landed_notice=True, groups=[PushGroup(g.kind, list(g.local), g.local_hit) for g in job.groups],
    )  # fmt: skip


def registrations_for(
    geometry: KVGeometry,
    job: RecvJob,
    first: Peer,
    *,
    decode_engine_id: str,
    decode_address: tuple[str, int],
    write_by: float,
    decode_agent: str = "",
) -> list[tuple[int, PushRegistration]]:
    """Decode: (prefill rank, its registration) for each prefill rank `job` needs, in the order to send them.

    `first` is prefill's first rank for the job, connected (see `plan_push`). Registrations of
    ranks that write nothing (``write=False``) only let prefill free the request.
    """
    return [
        (step.remote_rank, make_registration(geometry, job, decode_engine_id=decode_engine_id,
                                         decode_address=decode_address, write_by=write_by, write=step.read,
                                         decode_view=step.local, prefill_view=step.remote,
                                         decode_agent=decode_agent))
        for step in plan_push(geometry, job, first)
    ]  # fmt: skip


# -- prefill: what to write ----------------------------------------------------------------
@dataclass(frozen=True)
class WritePart:
    """One WRITE of a push: prefill's blocks through `prefill_view` into decode's through `decode_view`."""

    prefill_blocks: list[int]
    decode_blocks: list[int]
    prefill_view: ViewSpec
    decode_view: ViewSpec


def _cut_blocks(group: GroupBlocks, ratio: int, *, prefill_pages: int, paged: bool) -> tuple[list[int], list[int], int]:
    """(decode blocks, prefill blocks, first piece) of a full-attention group, `ratio` decode blocks per prefill block.

    `group` is as decode sees it (``local``: decode's blocks). Decode block i takes piece
    ``(hit + i) % ratio`` of prefill block ``(hit + i) // ratio``. vLLM's push scheduler does
    not tell decode's prefix hit: decode's blocks are then taken to start at the prompt's start
    (as vLLM's push connector pairs them), which is refused where they cannot, i.e. do not reach
    into prefill's last block (`prefill_pages` pages). `paged`: ids are kernel pages, and decode
    pages past prefill's are left out (past the prompt).
    """
    decode, prefill = group.local, group.remote
    if not decode:
        return [], [], 0
    pieces = len(prefill) * ratio
    if group.local_hit is not None:
        start = group.local_hit
    elif len(decode) > pieces - prefill_pages * ratio:
        start = 0
    else:
        raise LayoutError(f"decode registered {len(decode)} blocks without its prefix hit, short of prefill's "
                          f"{len(prefill)} blocks of {ratio} each: where they start is unknown")  # fmt: skip
    count = min(len(decode), pieces - start) if paged else len(decode)
    if start + count > pieces:
        raise LayoutError(f"decode registered {len(decode)} blocks after a prefix hit of {start}: prefill's "
                          f"{len(prefill)} blocks fill only {pieces} at ratio {ratio}")  # fmt: skip
    if count <= 0:
        return [], [], 0
    return decode[:count], prefill[start // ratio : (start + count - 1) // ratio + 1], start % ratio


def write_parts(geometry: KVGeometry, blocks: tuple[list[int], ...], reg: PushRegistration) -> list[WritePart]:
    """Prefill: the WRITEs (block ids and views on each side) that carry registration `reg`.

    `blocks` are the request's blocks on prefill, per KV cache group. Equal block sizes: one
    WRITE for every group, through the registration's views. Prefill blocks k times decode's:
    each is cut into k pieces of its token runs (`tp_mapping.split_for_block_ratio`, prefill's
    blocks in the larger role), one WRITE per run and per block group (a partly covered first or
    last prefill block, the full ones between). An empty list: nothing to write. Raises
    `LayoutError` for what cannot be placed.
    """
    if len(blocks) != len(reg.groups):
        raise LayoutError(f"decode registered {len(reg.groups)} KV cache groups, prefill holds {len(blocks)}")
    decode_block_size = reg.decode_block_size or geometry.block_size
    ratio = _block_ratio(geometry.block_size, decode_block_size)
    paged = geometry.pages_per_block > 1 or reg.decode_pages > 1
    pairs = []
    for group, mine in zip(reg.groups, blocks, strict=True):
        pair = GroupBlocks(group.kind, list(group.blocks), list(mine), group.hit)  # as decode sees it
        if paged:
            pair = in_kernel_pages(pair, reg.decode_pages, geometry.pages_per_block, same_page_tokens=ratio == 1)
            if pair.kind == "window":  # (decode's plan refuses it the same way: no prompt length either side)
                pair = window_pages_of_prompt(pair, None, 0, reg.decode_pages, geometry.pages_per_block)
        pairs.append(pair)
    if ratio == 1:
        decode_ids: list[int] = []
        prefill_ids: list[int] = []
        for pair in pairs:
            theirs, ours = pair_blocks(pair, 1, paged=paged)
            decode_ids += theirs
            prefill_ids += ours
        if not decode_ids and not prefill_ids:
            return []
        return [WritePart(prefill_ids, decode_ids, reg.prefill_view, reg.decode_view)]
    _refuse_cut(geometry, [p.kind for p in pairs], geometry.block_size, decode_block_size)
    decode_ids, prefill_ids, first_piece = _cut_blocks(pairs[0], ratio, prefill_pages=geometry.pages_per_block,
                                                       paged=paged)  # fmt: skip
    if not decode_ids:
        return []
    # The cut's smaller side is planned as if its blocks were as large as the other's.
    step = RankRead(geometry.tp_rank, local=reg.prefill_view, remote=_rescaled(reg.decode_view, multiply=ratio))
    parts = split_for_block_ratio(step, prefill_ids, decode_ids, ratio=ratio, local_part_len=geometry.part_len,
                                  run_len=geometry.run_len, first_piece=first_piece)  # fmt: skip
    return [WritePart(p.local_blocks, p.remote_blocks, p.local, p.remote) for p in parts]


def layer_parts(parts: list[WritePart], item: LayerReady, pages: int) -> list[WritePart]:
    """`parts` (planned on block positions, not ids) cut to `item`'s blocks and region, with prefill's ids."""
    regions = (item.region, item.region + 1)
    out = []
    blocks = np.asarray(item.blocks, dtype=np.int64)
    for part in parts:
        ours, theirs = np.asarray(part.prefill_blocks, np.int64), np.asarray(part.decode_blocks, np.int64)
        position = ours // pages
        keep = (position >= item.lo) & (position < item.hi)
        if keep.any():
            ids = blocks[position[keep]] * pages + ours[keep] % pages
            out.append(WritePart(ids.tolist(), theirs[keep].tolist(),
                                 msgspec.structs.replace(part.prefill_view, regions=regions),
                                 msgspec.structs.replace(part.decode_view, regions=regions)))  # fmt: skip
    return out
