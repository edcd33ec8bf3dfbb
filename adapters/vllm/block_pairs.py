"""Which local block receives which remote block, per KV cache group: pure translation, no I/O.

With vLLM's hybrid allocator a request owns blocks in several groups, one per kind of layer,
all drawn from one block pool and laid out alike (every cache region is shared by one layer of
each group, so reading block b of every region reads group g's layers when b belongs to g).
vLLM's scheduler clips each group's lists before they reach us, on both sides alike:

- ``full`` attention: every block of the prompt; the reader holds only those its prefix cache
  missed, so they pair with the producer's tail (or after ``local_hit`` blocks);
- ``window`` (sliding window): only the blocks still inside the window, so both lists end at
  the prompt's last block and pair from the end;
- ``state`` (Mamba, linear attention): the slot holding the running state, paired by position
  (a longer producer list carries positions the reader already has).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nixl_async.exceptions import LayoutError

__all__ = [
    "KINDS",
    "GroupBlocks",
    "full_pages_of_prompt",
    "in_kernel_pages",
    "kernel_pages",
    "pair_blocks",
    "select_remote_blocks",
    "window_pages_of_prompt",
]

KINDS = ("full", "window", "state")


@dataclass(frozen=True)
class GroupBlocks:
    """One KV cache group's blocks for one request, on each side."""

    kind: str  # one of KINDS
    local: list[int]
    remote: list[int]
    local_hit: int | None = None  # blocks the reader already had (prefix cache), if vLLM said

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LayoutError(f"unknown KV cache group kind {self.kind!r}; expected one of {KINDS}")


def select_remote_blocks(group: GroupBlocks, ratio: int) -> list[int]:
    """The producer blocks that fill a full-attention group's local blocks (a prefix hit skips the head)."""
    remote = group.remote
    if group.local_hit is not None:
        skip = group.local_hit * ratio
    else:  # the local blocks cover the end of the prompt; the last remote group may be short
        skip = max(0, (-(-len(remote) // ratio) - len(group.local)) * ratio)
    return remote[skip:]


def kernel_pages(blocks: list[int], k: int) -> list[int]:
    """The kernel page ids of logical `blocks` when vLLM splits each block in `k` pages (b -> b*k .. b*k+k-1)."""
    return [b * k + j for b in blocks for j in range(k)]


def in_kernel_pages(group: GroupBlocks, local_pages: int, remote_pages: int, *, same_page_tokens: bool = True
                    ) -> GroupBlocks:  # fmt: skip
    """`group` with logical block ids turned into kernel page ids on each side.

    A full-attention group with other pages per block on each side, or pages of other token counts
    (`same_page_tokens` False: other ``--block-size``), needs the prefix hit: paired from the end
    instead, the empty trailing pages of each side's last block differ in number, and every page
    would take its neighbour's tokens."""
    if group.kind == "full" and group.local_hit is None and (local_pages != remote_pages or not same_page_tokens):
        raise LayoutError(f"a full-attention group in blocks of {local_pages} kernel pages cannot be read from "
                          f"blocks of {remote_pages}{'' if same_page_tokens else ' of another page size'} without "
                          "the prefix hit (local_num_computed_blocks)")  # fmt: skip
    hit = None if group.local_hit is None else group.local_hit * local_pages
    return dataclasses.replace(group, local=kernel_pages(group.local, local_pages),
                               remote=kernel_pages(group.remote, remote_pages), local_hit=hit)  # fmt: skip


def full_pages_of_prompt(group: GroupBlocks, num_tokens: int, local_page_tokens: int, remote_page_tokens: int,
                         local_pages: int, remote_pages: int) -> GroupBlocks:  # fmt: skip
    """A full-attention group in kernel pages, without the prefix hit, each side cut to the pages that hold prompt
    tokens. With pages of other token counts on each side, the empty trailing pages of each side's last block
    differ in number: paired from the end as they stand, every page would take its neighbour's tokens."""

    def of_prompt(ids: list[int], page_tokens: int, per_block: int) -> list[int]:
        pages = -(-num_tokens // page_tokens)
        past = -(-pages // per_block) * per_block - pages  # empty pages in the last block
        return ids[: len(ids) - past] if past else ids

    return dataclasses.replace(group, local=of_prompt(group.local, local_page_tokens, local_pages),
                               remote=of_prompt(group.remote, remote_page_tokens, remote_pages))  # fmt: skip


def window_pages_of_prompt(group: GroupBlocks, num_tokens: int | None, page_tokens: int, local_pages: int,
                           remote_pages: int) -> GroupBlocks:  # fmt: skip
    """A sliding-window group in kernel pages, each side cut to the pages that hold prompt tokens.

    Both lists end at the prompt's last block, but that block's trailing pages hold nothing, and
    with other pages per block on each side (equal pages, other ``--block-size``) their counts
    differ: paired from the end as they stand, every page would take its neighbour's tokens.
    Without the prompt's length (`num_tokens`) that case is refused.
    """
    if num_tokens is None:
        if local_pages != remote_pages:
            raise LayoutError(f"a sliding-window group in blocks of {local_pages} pages cannot be read from blocks "
                              f"of {remote_pages} without the prompt's length (remote_num_tokens)")  # fmt: skip
        return group
    pages = -(-num_tokens // page_tokens)

    def of_prompt(ids: list[int], per_block: int) -> list[int]:
        past = -(-pages // per_block) * per_block - pages  # empty pages in the last block
        return ids[: len(ids) - past] if past else ids

    return dataclasses.replace(group, local=of_prompt(group.local, local_pages),
                               remote=of_prompt(group.remote, remote_pages))  # fmt: skip


def pair_blocks(group: GroupBlocks, ratio: int, *, paged: bool = False) -> tuple[list[int], list[int]]:
    """(local, remote) ids to read for one group; `ratio` remote blocks fill one local block.

    Only full-attention groups take a ratio other than 1 (vLLM's hybrid groups share one page
    size, and a window or a state slot of other-sized blocks does not line up). `paged`: the
    ids are kernel pages, of which the last local block may hold more than the prompt fills.
    """
    if group.kind != "full" and ratio != 1:
        raise LayoutError(f"a {group.kind} group cannot be read from blocks {ratio}x smaller than ours")
    if group.kind == "full":
        local, remote = group.local, select_remote_blocks(group, ratio)
        if paged:  # a partly filled last block: only the pages both sides have for the prompt
            pairs = min(len(local), -(-len(remote) // ratio))
            local, remote = local[:pairs], remote[: pairs * ratio]
        elif group.local_hit is not None:  # paired from the front: producer blocks past ours hold nothing we
            remote = remote[: len(local) * ratio]  # load (lookahead slots of speculative decoding)
        return list(local), list(remote)
    if group.kind == "window":
        # In kernel pages each side kept its window's blocks plus one, in its own --block-size: a decode
        # with larger blocks keeps older pages than prefill, which its window never reaches (prefill kept
        # at least the window and a token); they are left as they are. In blocks, a longer list is refused.
        if len(group.local) > len(group.remote) and not paged:
            raise LayoutError(
                f"a sliding-window group wants {len(group.local)} blocks; the producer kept {len(group.remote)}"
            )
        n = min(len(group.local), len(group.remote))
        return list(group.local[len(group.local) - n :]), group.remote[len(group.remote) - n :]
    # state: a longer producer list carries positions we have; a longer local one, a position we compute
    n = min(len(group.local), len(group.remote))
    if len(group.local) - len(group.remote) > 1:
        raise LayoutError(f"state slots cannot be paired: {len(group.local)} local, {len(group.remote)} remote")
    return list(group.local[:n]), group.remote[len(group.remote) - n :]
