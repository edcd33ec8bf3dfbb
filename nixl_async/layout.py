"""Block layouts and descriptor math: pure numpy, no NIXL, no I/O.

A KV cache is a set of *regions* (one per layer, or one per layer and K/V), each holding
`num_blocks` blocks of `block_len` bytes laid out back to back. Two kinds exist:

- ``REGIONS``: a block is one opaque run of bytes (K and V live in separate regions);
- ``BLOCKS_FIRST_KV``: each block holds its K half then its V half, so a head slice of a block
  is two runs of bytes, one per half.

Each half (or the whole block) is a *part*. A `BlockView` selects, within every part, a byte
window ``[chunk_offset, chunk_offset + chunk_len)`` and cuts it into `split` equal pieces. Views
express the cases vLLM needs without per-block Python loops:

- heterogeneous TP, reader has more ranks: the remote view takes this rank's head window;
- heterogeneous TP, reader has fewer ranks: the local view takes the window a remote rank fills;
- smaller remote blocks: the local view is split into `ratio` pieces, one per remote block;
- some layers only (a layer pushed as soon as it is computed): `regions` picks a range of
  regions; the view's descriptor list still covers every region (prepared once for all ranges).

Descriptor *i* of a view is ordered (region, part, piece, block), which lets NIXL prepare the
whole view from one strided row per (region, part, piece) instead of one row per block.
"""

from __future__ import annotations

import enum
import itertools
import numbers
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt

from .exceptions import LayoutError

__all__ = [
    "BlockLayout",
    "BlockView",
    "LayoutKind",
    "MemType",
    "ViewSpec",
    "as_block_id_rows",
    "as_block_ids",
    "pair_descriptor_id_rows",
    "pair_descriptor_ids",
    "pair_short_ids",
]

IdArray = npt.NDArray[np.int64]
# Descriptor ids as NIXL takes them: an array, or (for a short transfer) a tuple of ints.
DescIds = IdArray | tuple[int, ...]
_SMALL = 256
# Up to this many blocks, `pair_short_ids` computes a transfer's descriptor ids in plain Python.
_SHORT = 32
DescArray = npt.NDArray[np.uint64]


class MemType(enum.StrEnum):
    DRAM = "DRAM"
    VRAM = "VRAM"


class LayoutKind(enum.StrEnum):
    REGIONS = "regions"
    BLOCKS_FIRST_KV = "blocks_first_kv"


NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(gt=0)]


def _whole(value: Any) -> Any:
    """A numpy integer as a Python int; anything else as given (msgspec then names what is wrong with it)."""
    return int(value) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value


class BlockLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Where a set of equally sized blocks lives in memory.

    It is also the wire form of a layout in the handshake, so validation runs on decode too.
    """

    name: str
    region_addrs: tuple[NonNegative, ...]
    num_blocks: Positive
    block_len: Positive
    kind: LayoutKind = LayoutKind.REGIONS
    mem_type: MemType = MemType.DRAM
    device_id: NonNegative = 0
    block_size: NonNegative = 0  # tokens per block; informational, used by adapters

    def __post_init__(self) -> None:
        if not self.region_addrs:
            raise LayoutError(f"layout {self.name!r} has no regions")
        # (Checked here too: msgspec checks the field types and constraints only when decoding. Built
        # directly, num_blocks=2.5 registered 5 bytes and took block id 2.)
        whole = (self.num_blocks, self.block_len, self.device_id, self.block_size, *self.region_addrs)
        if not isinstance(self.region_addrs, tuple) or any(type(v) is bool or not isinstance(v, int) for v in whole):
            raise LayoutError(f"layout {self.name!r}: region_addrs (a tuple), num_blocks, block_len, device_id and "
                              "block_size must be Python ints")  # fmt: skip
        if self.num_blocks <= 0 or self.block_len <= 0:
            raise LayoutError(f"layout {self.name!r}: num_blocks and block_len must be > 0")
        if min(self.region_addrs) < 0 or max(self.region_addrs) + self.region_len > 1 << 64:
            raise LayoutError(f"layout {self.name!r}: a region lies outside the 64-bit address space")
        if self.block_len % self.num_parts:
            raise LayoutError(f"layout {self.name!r}: block_len {self.block_len} has no K/V halves")
        starts = sorted(self.region_addrs)
        if any(b - a < self.region_len for a, b in itertools.pairwise(starts)):
            # NIXL/UCX accept overlapping registrations and crash later: refuse them here.
            raise LayoutError(f"layout {self.name!r}: regions overlap")

    def overlaps(self, other: BlockLayout) -> bool:
        """Whether any region of this layout shares bytes with one of `other`'s."""
        if (self.mem_type, self.device_id) != (other.mem_type, other.device_id):
            return False
        return any(
            a < b + other.region_len and b < a + self.region_len for a in self.region_addrs for b in other.region_addrs
        )

    @property
    def num_regions(self) -> int:
        return len(self.region_addrs)

    @property
    def num_parts(self) -> int:
        return 2 if self.kind is LayoutKind.BLOCKS_FIRST_KV else 1

    @property
    def part_len(self) -> int:
        return self.block_len // self.num_parts

    @property
    def region_len(self) -> int:
        return self.num_blocks * self.block_len

    @property
    def total_bytes(self) -> int:
        return self.region_len * self.num_regions

    def region_descriptors(self) -> DescArray:
        """(addr, len, device) rows, one per region: what gets registered with NIXL."""
        out = np.empty((self.num_regions, 3), dtype=np.uint64)
        out[:, 0] = self.region_addrs
        out[:, 1] = self.region_len
        out[:, 2] = self.device_id
        return out

    def view(
        self,
        chunk_offset: int = 0,
        chunk_len: int | None = None,
        split: int = 1,
        regions: tuple[int, int] | None = None,
    ) -> BlockView:
        """A view of this layout (see the module docstring); the default is whole blocks of every region."""
        length = self.part_len - chunk_offset if chunk_len is None else chunk_len
        return BlockView(self, chunk_offset, length, split, regions)

    @classmethod
    def from_regions(
        cls,
        name: str,
        region_addrs: Sequence[int],
        *,
        num_blocks: int,
        block_len: int,
        kind: LayoutKind = LayoutKind.REGIONS,
        mem_type: MemType = MemType.DRAM,
        device_id: int = 0,
        block_size: int = 0,
    ) -> BlockLayout:
        """Build and validate a layout from plain Python values (raising `LayoutError`); numpy's ints are taken."""
        try:
            return msgspec.convert(
                {
                    "name": name,
                    "region_addrs": [int(a) for a in region_addrs],
                    "num_blocks": _whole(num_blocks),
                    "block_len": _whole(block_len),
                    "kind": kind,
                    "mem_type": mem_type,
                    "device_id": _whole(device_id),
                    "block_size": _whole(block_size),
                },
                cls,
            )
        except msgspec.ValidationError as exc:
            raise LayoutError(f"invalid layout {name!r}: {exc}") from None


class BlockView:
    """A byte window of every part of every block of a layout, cut into `split` pieces.

    `regions` (start, stop) limits the blocks' ids to those regions; `descriptors()` and the
    prepared list (`key`) still cover all of them, so every region range shares one list.
    """

    __slots__ = ("_only_offset", "_row_offsets", "chunk_len", "chunk_offset", "layout", "regions", "split")

    def __init__(
        self,
        layout: BlockLayout,
        chunk_offset: int,
        chunk_len: int,
        split: int,
        regions: tuple[int, int] | None = None,
    ) -> None:
        first, stop = (0, layout.num_regions) if regions is None else regions
        if not 0 <= first < stop <= layout.num_regions:
            raise LayoutError(
                f"regions [{first}, {stop}) are not a range of layout {layout.name!r}'s {layout.num_regions} regions"
            )
        if split <= 0:
            raise LayoutError(f"split must be > 0, got {split}")
        if chunk_offset < 0 or chunk_len <= 0 or chunk_offset + chunk_len > layout.part_len:
            raise LayoutError(
                f"window [{chunk_offset}, {chunk_offset + chunk_len}) does not fit in a "
                f"{layout.part_len}-byte part of layout {layout.name!r}"
            )
        if chunk_len % split:
            raise LayoutError(f"a {chunk_len}-byte window cannot be split into {split} equal pieces")
        self.layout = layout
        self.chunk_offset = chunk_offset
        self.chunk_len = chunk_len
        self.split = split
        self.regions = (first, stop)
        # Index of each selected (region, part) group's first descriptor, for piece 0.
        parts = layout.num_parts
        groups = np.arange(first * parts, stop * parts, dtype=np.int64)
        self._row_offsets = (groups * (split * layout.num_blocks))[:, None]
        # One group (one region, one part): ids are the block ids plus this, no broadcast needed.
        self._only_offset = int(self._row_offsets[0, 0]) if len(groups) == 1 else None

    @property
    def num_groups(self) -> int:
        """(region, part) groups the view's ids cover: each unit of a transfer is one descriptor per group."""
        return len(self._row_offsets)

    @property
    def key(self) -> tuple[str, int, int, int]:
        """Identifies the view; prepared descriptor lists are cached under it."""
        return (self.layout.name, self.chunk_offset, self.chunk_len, self.split)

    @property
    def piece_len(self) -> int:
        return self.chunk_len // self.split

    @property
    def rows(self) -> int:
        """Number of (region, part, piece) rows; each row covers every block."""
        return self.layout.num_regions * self.layout.num_parts * self.split

    @property
    def num_descriptors(self) -> int:
        return self.rows * self.layout.num_blocks

    def _row_addrs(self) -> DescArray:
        lay = self.layout
        base = np.asarray(lay.region_addrs, dtype=np.uint64)[:, None, None]
        part = (np.arange(lay.num_parts, dtype=np.uint64) * np.uint64(lay.part_len))[None, :, None]
        piece = (np.arange(self.split, dtype=np.uint64) * np.uint64(self.piece_len))[None, None, :]
        return (base + part + piece + np.uint64(self.chunk_offset)).reshape(-1)

    def strided_rows(self) -> DescArray:
        """(addr, len, device, stride, count) rows: NIXL's compact form of `descriptors()`."""
        out = np.empty((self.rows, 5), dtype=np.uint64)
        out[:, 0] = self._row_addrs()
        out[:, 1] = self.piece_len
        out[:, 2] = self.layout.device_id
        out[:, 3] = self.layout.block_len
        out[:, 4] = self.layout.num_blocks
        return out

    def descriptors(self) -> DescArray:
        """Every descriptor as an (addr, len, device) row, in (region, part, piece, block) order."""
        lay = self.layout
        blocks = np.arange(lay.num_blocks, dtype=np.uint64) * np.uint64(lay.block_len)
        out = np.empty((self.rows, lay.num_blocks, 3), dtype=np.uint64)
        np.add(self._row_addrs()[:, None], blocks[None, :], out=out[:, :, 0])  # one pass, no temporary
        out[:, :, 1] = self.piece_len
        out[:, :, 2] = lay.device_id
        return out.reshape(-1, 3)

    def descriptor_ids(self, block_ids: IdArray, pieces: IdArray | None = None) -> IdArray:
        """Descriptor indices for `block_ids`, grouped by (region, part), in the view's regions only.

        Without `pieces`, every piece of each block is taken (unit order: block, then piece);
        with `pieces` (same length as `block_ids`) unit *u* takes piece ``pieces[u]``.
        """
        nb = self.layout.num_blocks
        block_ids = block_ids.astype(np.int64, copy=False)  # (uint64 ids plus int64 offsets would be float64)
        if pieces is None:
            if self.split == 1:
                if self._only_offset is not None:
                    return block_ids.astype(np.int64, copy=False) + self._only_offset
                return (self._row_offsets + block_ids[None, :]).reshape(-1)
            pieces = np.tile(np.arange(self.split, dtype=np.int64), len(block_ids))
            block_ids = np.repeat(block_ids, self.split)
        pieces = pieces.astype(np.int64, copy=False)
        return (self._row_offsets + (pieces * nb + block_ids)[None, :]).reshape(-1)

    def descriptor_id_rows(self, block_ids: IdArray) -> IdArray:
        """`descriptor_ids` of each row of the (n, k) `block_ids` at once (whole blocks: split 1 only)."""
        if self.split != 1:
            raise ValueError("descriptor_id_rows takes whole blocks (split 1)")
        return (self._row_offsets[None] + block_ids[:, None, :]).reshape(len(block_ids), -1)


class ViewSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A view described by value (layout name and window), resolved against a layout later.

    Lets code that cannot hold layouts (another thread, another process) name a view.
    """

    layout: str | None = None
    chunk_offset: int = 0
    chunk_len: int | None = None
    split: int = 1
    regions: tuple[int, int] | None = None  # (start, stop): only these regions; None: all

    def resolve(self, layout: BlockLayout) -> BlockView:
        return layout.view(self.chunk_offset, self.chunk_len, self.split, self.regions)


def as_block_ids(
    block_ids: Sequence[int] | npt.ArrayLike, num_blocks: int, *, what: str, unique: bool = False
) -> IdArray:
    """Validate block ids against a layout's block count and return them as int64.

    Raises `LayoutError` for non-integer, multi-dimensional or out-of-range ids, and with
    `unique` for repeated ids (a destination block written twice by one transfer is a race).
    """
    # Short lists are the common case (one request's blocks): plain Python beats numpy's per-call
    # overhead several times over. Bad ones go on to numpy, which names the problem.
    if (isinstance(block_ids, list | tuple | range) and len(block_ids) <= _SMALL
            and _plain_ids_valid(block_ids, num_blocks, unique)):  # fmt: skip
        return np.array(block_ids, dtype=np.int64)
    arr = np.asarray(block_ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise LayoutError(f"{what} block ids must be a flat sequence, got shape {arr.shape}")
    arr = _ids_in_range(arr, num_blocks, what)
    if unique and _has_repeats(arr, num_blocks):
        raise LayoutError(f"{what} block ids name a destination block more than once")
    return arr


def as_block_id_rows(rows: Sequence[Sequence[int]] | npt.ArrayLike, num_blocks: int, *, what: str,
                     unique: bool = False) -> IdArray | list[IdArray]:  # fmt: skip
    """`as_block_ids` for many transfers at once: one row of ids per transfer.

    Rows of one length come back as an (n, k) int64 array, checked in one numpy pass; rows of
    different lengths as one array per row, checked row by row. Raises `LayoutError` as
    `as_block_ids` does (`unique` checks each row on its own: two transfers may name one block).
    """
    try:
        arr = np.asarray(rows)
    except ValueError:  # numpy refuses ragged nesting: rows of different lengths
        arr = None
    if arr is None or (arr.ndim == 1 and arr.dtype == object):  # rows of different lengths
        return [as_block_ids(row, num_blocks, what=what, unique=unique) for row in rows]  # type: ignore[union-attr]
    if arr.ndim == 1 and arr.size == 0:
        return np.zeros((0, 0), dtype=np.int64)  # no transfers
    if arr.ndim != 2:
        raise LayoutError(f"{what} block ids must be one row per transfer, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(arr.shape, dtype=np.int64)
    arr = _ids_in_range(arr, num_blocks, what)
    if unique and arr.shape[1] > 1:
        ordered = np.sort(arr, axis=1)
        if bool((ordered[:, 1:] == ordered[:, :-1]).any()):
            raise LayoutError(f"{what} block ids name a destination block more than once")
    return arr


def _plain_ids_valid(block_ids: Sequence[object], num_blocks: int, unique: bool) -> bool:
    """Whether a short sequence holds only Python ints within the layout's blocks (and, with `unique`, no repeats)."""
    for b in block_ids:
        if type(b) is not int or not 0 <= b < num_blocks:
            return False
    return not unique or len(block_ids) < 2 or len(set(block_ids)) == len(block_ids)


def _ids_in_range(arr: npt.NDArray[np.generic], num_blocks: int, what: str) -> IdArray:
    """`arr` (not empty) as int64, refusing non-integers and ids outside the layout's blocks."""
    if not np.issubdtype(arr.dtype, np.integer):
        raise LayoutError(f"{what} block ids must be integers, got dtype {arr.dtype}")
    ids = arr.astype(np.int64, copy=False)
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise LayoutError(f"{what} block id {bad} is out of range: the layout has {num_blocks} blocks")
    return ids


def _has_repeats(ids: IdArray, num_blocks: int) -> bool:
    """Whether any id occurs twice: a bitmap over the layout's blocks, O(n) instead of a sort
    (a sort when the bitmap would be far larger than the ids)."""
    if num_blocks > 64 * len(ids):
        return len(np.unique(ids)) != len(ids)
    seen = np.zeros(num_blocks, dtype=np.bool_)
    seen[ids] = True
    return int(np.count_nonzero(seen)) != len(ids)


def pair_descriptor_ids(
    local: BlockView, local_ids: IdArray, remote: BlockView, remote_ids: IdArray
) -> tuple[IdArray, IdArray]:
    """Match local and remote descriptors one to one for a transfer.

    Both sides are cut into equal units: ``len(local_ids) * local.split`` must equal
    ``len(remote_ids) * remote.split``; unit *u* of one side pairs with unit *u* of the other.
    Over whole blocks the pairs come back ordered by local id, so that NIXL can merge runs.
    Raises `LayoutError` when the views cannot be paired.
    """
    if local.piece_len != remote.piece_len:
        raise LayoutError(
            f"descriptor sizes differ: local pieces are {local.piece_len} bytes, remote {remote.piece_len}"
        )
    lrp, rrp = local.num_groups, remote.num_groups
    if lrp != rrp:
        raise LayoutError(f"views differ in regions x parts: local {lrp}, remote {rrp}")
    units = len(local_ids) * local.split
    if units != len(remote_ids) * remote.split:
        raise LayoutError(
            f"block counts do not pair: {len(local_ids)} local blocks x {local.split} pieces "
            f"!= {len(remote_ids)} remote blocks x {remote.split} pieces"
        )
    if local.split == 1 and remote.split == 1:
        local_ids, remote_ids = _local_ascending(local_ids, remote_ids)
        return local.descriptor_ids(local_ids), remote.descriptor_ids(remote_ids)
    u = np.arange(units, dtype=np.int64)
    local_idx = local.descriptor_ids(local_ids[u // local.split], u % local.split)
    remote_idx = remote.descriptor_ids(remote_ids[u // remote.split], u % remote.split)
    return local_idx, remote_idx


def pair_short_ids(
    local: BlockView, local_blocks: object, remote: BlockView, remote_blocks: object, *, op: str
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """`as_block_ids` and `pair_descriptor_ids` for a short transfer, as tuples of ints; None if not one.

    The fast path of a single submit (one request's few blocks): lists of at most `_SHORT`
    valid ids over whole blocks of one-group views. There numpy's per-call cost (and two
    allocations per array, alive while the transfer is in flight) exceeds the work. NIXL takes
    tuples, which the garbage collector stops tracking (lists it would walk on every pass).
    None sends the caller down the general path, which also raises the errors.
    """
    lo, ro = local._only_offset, remote._only_offset
    if lo is None or ro is None or local.split != 1 or remote.split != 1 or local.piece_len != remote.piece_len:
        return None
    if type(local_blocks) is not list or type(remote_blocks) is not list:
        return None
    n = len(local_blocks)
    if not 0 < n <= _SHORT or len(remote_blocks) != n:
        return None
    if not (_plain_ids_valid(local_blocks, local.layout.num_blocks, op == "READ")
            and _plain_ids_valid(remote_blocks, remote.layout.num_blocks, op == "WRITE")):  # fmt: skip
        return None  # the general path says what is wrong
    if sorted(local_blocks) != local_blocks:  # (cheap when they already ascend)
        order = sorted(range(n), key=local_blocks.__getitem__)
        return tuple([local_blocks[i] + lo for i in order]), tuple([remote_blocks[i] + ro for i in order])
    return tuple([b + lo for b in local_blocks]), tuple([b + ro for b in remote_blocks])


def _local_ascending(local_ids: IdArray, remote_ids: IdArray) -> tuple[IdArray, IdArray]:
    """A transfer's (local, remote) block pairs reordered so that the local ids ascend (a stable sort).

    NIXL merges neighbouring descriptors of a transfer into one where they are neighbours in the
    prepared lists too and both sides' bytes run on: only in ascending order. vLLM hands a finished
    request's blocks back last first, so a later request often gets a run of blocks in descending
    order, on each side: pairs that merge once sorted (fewer, longer copies). The pairs themselves,
    and so the bytes moved, are unchanged.
    Works on one transfer's ids (1-D) or on rows of transfers (2-D, each row sorted alone).
    """
    if local_ids.shape[-1] < 2:
        return local_ids, remote_ids
    if local_ids.ndim == 1:
        if len(local_ids) <= _SMALL:  # one request's ids: a list compare beats numpy's per-call cost
            ids = local_ids.tolist()
            if ids == sorted(ids):
                return local_ids, remote_ids
        elif not (local_ids[1:] < local_ids[:-1]).any():
            return local_ids, remote_ids
        order = local_ids.argsort(kind="stable")
        return local_ids[order], remote_ids[order]
    if not (local_ids[:, 1:] < local_ids[:, :-1]).any():
        return local_ids, remote_ids
    order = np.argsort(local_ids, axis=-1, kind="stable")
    return np.take_along_axis(local_ids, order, -1), np.take_along_axis(remote_ids, order, -1)


def pair_descriptor_id_rows(
    local: BlockView, local_rows: IdArray | list[IdArray], remote: BlockView, remote_rows: IdArray | list[IdArray]
) -> tuple[IdArray | list[IdArray], IdArray | list[IdArray]]:
    """`pair_descriptor_ids` for each row (transfer) of `as_block_id_rows` results: descriptor ids per row.

    Rows of one length over whole blocks on both sides are done in one numpy pass ((n, d) arrays);
    otherwise row by row (lists of arrays).
    """
    if len(local_rows) != len(remote_rows):
        raise LayoutError(f"{len(local_rows)} local rows against {len(remote_rows)} remote rows: one each per transfer")
    if len(local_rows) == 0:
        return np.zeros((0, 0), dtype=np.int64), np.zeros((0, 0), dtype=np.int64)
    whole = local.split == 1 and remote.split == 1
    if whole and isinstance(local_rows, np.ndarray) and isinstance(remote_rows, np.ndarray):
        pair_descriptor_ids(local, local_rows[0], remote, remote_rows[0])  # the checks see shapes only: one row
        local_rows, remote_rows = _local_ascending(local_rows, remote_rows)
        return local.descriptor_id_rows(local_rows), remote.descriptor_id_rows(remote_rows)
    pairs = [pair_descriptor_ids(local, lr, remote, rr) for lr, rr in zip(local_rows, remote_rows, strict=True)]
    return [p[0] for p in pairs], [p[1] for p in pairs]
