"""Descriptor math, checked against a plain per-block reference (no NIXL)."""

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nixl_async.exceptions import LayoutError
from nixl_async.layout import (
    BlockLayout,
    LayoutKind,
    MemType,
    ViewSpec,
    as_block_id_rows,
    as_block_ids,
    pair_descriptor_id_rows,
    pair_descriptor_ids,
    pair_short_ids,
)


@st.composite
def layouts(draw: st.DrawFn) -> BlockLayout:
    kind = draw(st.sampled_from(list(LayoutKind)))
    parts = 2 if kind is LayoutKind.BLOCKS_FIRST_KV else 1
    unit = draw(st.sampled_from([8, 16, 64]))
    block_len = unit * parts * draw(st.integers(1, 8))
    num_blocks = draw(st.integers(1, 40))
    regions = draw(st.integers(1, 4))
    bases = [0x10000 * (i + 1) * 4096 for i in range(regions)]
    return BlockLayout.from_regions("kv", bases, num_blocks=num_blocks, block_len=block_len, kind=kind)


@st.composite
def views(draw: st.DrawFn):
    layout = draw(layouts())
    part = layout.part_len
    split = draw(st.sampled_from([d for d in (1, 2, 4, 8) if part % d == 0]))
    chunk_len = draw(st.sampled_from(range(split, part + 1, split)))
    offset = draw(st.integers(0, part - chunk_len))
    return layout.view(offset, chunk_len, split)


def reference_descriptors(view) -> list[tuple[int, int, int]]:
    """One Python loop per descriptor: the obvious, slow definition."""
    lay = view.layout
    out = []
    for base in lay.region_addrs:
        for part in range(lay.num_parts):
            for piece in range(view.split):
                for block in range(lay.num_blocks):
                    addr = (
                        base + block * lay.block_len + part * lay.part_len + view.chunk_offset + piece * view.piece_len
                    )
                    out.append((addr, view.piece_len, lay.device_id))
    return out


@settings(max_examples=200, deadline=None)
@given(views())
def test_descriptors_match_reference(view):
    got = [tuple(int(x) for x in row) for row in view.descriptors()]
    assert got == reference_descriptors(view)


@settings(max_examples=200, deadline=None)
@given(views())
def test_strided_rows_expand_to_descriptors(view):
    rows = view.strided_rows()
    expanded = [
        (int(a) + k * int(stride), int(length), int(dev))
        for a, length, dev, stride, count in rows
        for k in range(int(count))
    ]
    assert expanded == [tuple(int(x) for x in row) for row in view.descriptors()]


@settings(max_examples=200, deadline=None)
@given(views(), st.data())
def test_descriptor_ids_select_the_blocks(view, data):
    nb = view.layout.num_blocks
    ids = np.array(data.draw(st.lists(st.integers(0, nb - 1), max_size=20)), dtype=np.int64)
    descs = view.descriptors()
    chosen = descs[view.descriptor_ids(ids)]
    lay = view.layout
    # every chosen descriptor lies inside one of the requested blocks, in (region, part, block, piece) groups
    per_rp = len(ids) * view.split
    assert len(chosen) == lay.num_regions * lay.num_parts * per_rp
    for i, (addr, length, _dev) in enumerate(chosen):
        rp, unit = divmod(i, per_rp) if per_rp else (0, 0)
        block = ids[unit // view.split]
        region = rp // lay.num_parts
        start = lay.region_addrs[region] + block * lay.block_len
        assert start <= int(addr) and int(addr) + int(length) <= start + lay.block_len


@settings(max_examples=200, deadline=None)
@given(views(), st.data())
def test_a_region_range_selects_exactly_those_regions_blocks(view, data):
    """A view of some regions (a layer pushed alone) takes the same descriptors as the whole view, in them only."""
    lay = view.layout
    start = data.draw(st.integers(0, lay.num_regions - 1))
    stop = data.draw(st.integers(start + 1, lay.num_regions))
    ids = np.array(data.draw(st.lists(st.integers(0, lay.num_blocks - 1), max_size=12)), dtype=np.int64)
    some = lay.view(view.chunk_offset, view.chunk_len, view.split, (start, stop))
    assert some.key == view.key and np.array_equal(some.descriptors(), view.descriptors())  # one prepared list
    per_group = len(ids) * view.split
    whole = view.descriptor_ids(ids)
    want = whole[start * lay.num_parts * per_group : stop * lay.num_parts * per_group]
    assert np.array_equal(some.descriptor_ids(ids), want)
    assert some.num_groups == (stop - start) * lay.num_parts


def test_region_ranges_pair_only_with_as_many_regions():
    lay = BlockLayout.from_regions("kv", [0, 1 << 20, 2 << 20], num_blocks=8, block_len=64)
    one = ViewSpec(regions=(1, 2)).resolve(lay)
    lidx, ridx = pair_descriptor_ids(one, np.array([3]), ViewSpec(regions=(2, 3)).resolve(lay), np.array([5]))
    assert lidx.tolist() == [8 + 3] and ridx.tolist() == [16 + 5]
    with pytest.raises(LayoutError, match="regions x parts"):
        pair_descriptor_ids(one, np.array([3]), lay.view(), np.array([5]))
    for bad in [(0, 0), (2, 1), (0, 4), (-1, 1)]:
        with pytest.raises(LayoutError, match="not a range"):
            lay.view(regions=bad)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.sampled_from([1, 2, 4]), st.data())
def test_pairing_with_block_size_ratio(regions, n_local, ratio, data):
    """A local block split in `ratio` pieces pairs with `ratio` consecutive remote blocks."""
    block_len = 64 * ratio
    local = BlockLayout.from_regions(
        "kv", [(1 << 32) + (i << 24) for i in range(regions)], num_blocks=8, block_len=block_len
    )
    remote = BlockLayout.from_regions(
        "kv", [(1 << 40) + (i << 24) for i in range(regions)], num_blocks=8 * ratio, block_len=block_len // ratio
    )
    lids = np.array(
        data.draw(st.lists(st.integers(0, 7), min_size=n_local, max_size=n_local, unique=True)), dtype=np.int64
    )
    rids = np.array(
        data.draw(st.lists(st.integers(0, 8 * ratio - 1), min_size=n_local * ratio, max_size=n_local * ratio)),
        dtype=np.int64,
    )
    lv, rv = local.view(split=ratio), remote.view()
    li, ri = pair_descriptor_ids(lv, lids, rv, rids)
    ld, rd = lv.descriptors()[li], rv.descriptors()[ri]
    assert (ld[:, 1] == rd[:, 1]).all()
    for (la, _, _), (ra, _, _) in zip(ld, rd, strict=True):
        lblock, loff = divmod((int(la) - (1 << 32)) % (1 << 24), block_len)
        rblock = ((int(ra) - (1 << 40)) % (1 << 24)) // (block_len // ratio)
        # the piece index inside the local block says which of the ratio remote blocks it holds
        unit = list(lids).index(lblock) * ratio + loff // (block_len // ratio)
        assert rblock == rids[unit]


def test_head_window_pairs_with_whole_local_block():
    """Decode TP 2 reading rank 1's half of each prefill block (heterogeneous TP)."""
    remote = BlockLayout.from_regions("kv", [0x1000_0000], num_blocks=4, block_len=1024)
    local = BlockLayout.from_regions("kv", [0x2000_0000], num_blocks=4, block_len=512)
    rv = remote.view(chunk_offset=512, chunk_len=512)
    li, ri = pair_descriptor_ids(local.view(), np.array([0, 3]), rv, np.array([2, 1]))
    assert [int(a) for a in rv.descriptors()[ri][:, 0]] == [0x1000_0000 + 2 * 1024 + 512, 0x1000_0000 + 1024 + 512]
    assert [int(a) for a in local.view().descriptors()[li][:, 0]] == [0x2000_0000, 0x2000_0000 + 3 * 512]


def test_blocks_first_kv_window_takes_both_halves():
    lay = BlockLayout.from_regions("kv", [0], num_blocks=2, block_len=256, kind=LayoutKind.BLOCKS_FIRST_KV)
    view = lay.view(chunk_offset=64, chunk_len=64)
    rows = [tuple(int(x) for x in r) for r in view.descriptors()]
    assert rows == [(64, 64, 0), (256 + 64, 64, 0), (128 + 64, 64, 0), (256 + 128 + 64, 64, 0)]


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([0, 8], "block id 8 is out of range"),
        ([-1], "block id -1 is out of range"),
        ([[1, 2]], "flat sequence"),
        ([0.5], "integers"),
    ],
)
def test_bad_block_ids_are_refused(ids, message):
    with pytest.raises(LayoutError, match=message):
        as_block_ids(ids, 8, what="local")


def test_duplicate_destination_ids_are_refused():
    with pytest.raises(LayoutError, match="more than once"):
        as_block_ids([1, 2, 1], 8, what="local", unique=True)
    assert list(as_block_ids([1, 2, 1], 8, what="remote")) == [1, 2, 1]


@settings(max_examples=200, deadline=None)
@given(views(), st.sampled_from([1, 2, 4]), st.integers(0, 3), st.integers(0, 5), st.data())
def test_rows_pair_as_each_transfer_alone(view, ratio, first, k, data):
    """A batch (one row of block ids per transfer) gets exactly the descriptor ids each transfer would get alone:
    whole blocks on both sides, and a local block split in `ratio` pieces against smaller remote blocks."""
    lay = view.layout
    bases = [(1 << 40) + (i << 24) for i in range(lay.num_regions)]
    other = BlockLayout.from_regions("kv", bases, num_blocks=lay.num_blocks + first, block_len=lay.block_len,
                                     kind=lay.kind)  # fmt: skip
    cases = [(view, other.view(view.chunk_offset, view.chunk_len, view.split), k, k)]
    local = BlockLayout.from_regions("kv", [1 << 32], num_blocks=8, block_len=64 * ratio)
    small = BlockLayout.from_regions("kv", [1 << 40], num_blocks=8 * ratio, block_len=64)
    cases.append((local.view(split=ratio), small.view(), k, k * ratio))
    n = data.draw(st.integers(1, 6))
    for lv, rv, k_local, k_remote in cases:
        lb, rb = lv.layout.num_blocks, rv.layout.num_blocks
        lrows = [data.draw(st.lists(st.integers(0, lb - 1), min_size=k_local, max_size=k_local)) for _ in range(n)]
        rrows = [data.draw(st.lists(st.integers(0, rb - 1), min_size=k_remote, max_size=k_remote)) for _ in range(n)]
        got_l, got_r = pair_descriptor_id_rows(
            lv, as_block_id_rows(lrows, lb, what="local"), rv, as_block_id_rows(rrows, rb, what="remote")
        )
        assert len(got_l) == len(got_r) == n
        for i in range(n):
            want_l, want_r = pair_descriptor_ids(lv, np.array(lrows[i], dtype=np.int64), rv,
                                                 np.array(rrows[i], dtype=np.int64))  # fmt: skip
            assert got_l[i].tolist() == want_l.tolist() and got_r[i].tolist() == want_r.tolist()


@settings(max_examples=300, deadline=None)
@given(views(), st.integers(1, 40), st.booleans(), st.sampled_from(["READ", "WRITE"]), st.data())
def test_a_short_transfer_pairs_as_the_general_path_or_declines(view, k, unique, op, data):
    """The single submit's fast path gives exactly the general path's descriptor ids, and declines
    (None) whatever it does not cover: views of several groups or pieces, long, bad or repeated ids.
    A window of one region (as the adapter's per-layer pushes take) makes a one-group view at an offset."""
    lay = view.layout
    other = BlockLayout.from_regions("kv", [(1 << 40) + (i << 24) for i in range(lay.num_regions)],
                                     num_blocks=lay.num_blocks + 3, block_len=lay.block_len, kind=lay.kind)  # fmt: skip
    region = data.draw(st.none() | st.integers(0, lay.num_regions - 1))
    window = None if region is None else (region, region + 1)
    view = lay.view(view.chunk_offset, view.chunk_len, view.split, window)
    remote = other.view(view.chunk_offset, view.chunk_len, view.split, window)
    n = min(k, lay.num_blocks) if unique else k  # ids mostly valid, so the fast path runs often
    lids = data.draw(st.lists(st.integers(0, lay.num_blocks - 1), min_size=n, max_size=n, unique=unique))
    rids = data.draw(st.lists(st.integers(0, other.num_blocks - 1), min_size=n, max_size=n, unique=unique))
    bad = data.draw(st.sampled_from([None, -1, "local", "remote"]))
    if bad == -1:
        lids[-1] = -1
    elif bad is not None:
        (lids if bad == "local" else rids)[0] = lay.num_blocks if bad == "local" else other.num_blocks
    got = pair_short_ids(view, lids, remote, rids, op=op)
    try:
        la = as_block_ids(lids, lay.num_blocks, what="local", unique=op == "READ")
        ra = as_block_ids(rids, other.num_blocks, what="remote", unique=op == "WRITE")
        want = pair_descriptor_ids(view, la, remote, ra)
    except LayoutError:
        assert got is None  # the general path raises the error
        return
    if view.num_groups != 1 or view.split != 1 or n > 32:
        assert got is None
    else:
        assert got is not None and list(got[0]) == want[0].tolist() and list(got[1]) == want[1].tolist()
        assert all(type(i) is int for i in got[0] + got[1])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 40), st.integers(1, 32), st.sampled_from(["READ", "WRITE"]), st.data())
def test_a_short_transfer_over_one_region_of_many_pairs_as_the_general_path(regions, num_blocks, k, op, data):
    """Where the fast path runs (the adapter's per-layer pushes): one region of several, whole blocks, valid ids."""
    lay = BlockLayout.from_regions("kv", [(1 << 32) + (i << 24) for i in range(regions)], num_blocks=num_blocks,
                                   block_len=64)  # fmt: skip
    other = BlockLayout.from_regions("kv", [(1 << 40) + (i << 24) for i in range(regions)], num_blocks=num_blocks + 5,
                                     block_len=64)  # fmt: skip
    region = data.draw(st.integers(0, regions - 1))
    local, remote = lay.view(regions=(region, region + 1)), other.view(regions=(region, region + 1))
    n = min(k, num_blocks)
    lids = data.draw(st.lists(st.integers(0, num_blocks - 1), min_size=n, max_size=n, unique=op == "READ"))
    rids = data.draw(st.lists(st.integers(0, num_blocks + 4), min_size=n, max_size=n, unique=op == "WRITE"))
    want = pair_descriptor_ids(local, np.array(lids, np.int64), remote, np.array(rids, np.int64))
    got = pair_short_ids(local, lids, remote, rids, op=op)
    assert got is not None and list(got[0]) == want[0].tolist() and list(got[1]) == want[1].tolist()


def test_a_short_transfer_takes_lists_of_ints_only():
    view = BlockLayout.from_regions("kv", [1 << 20], num_blocks=8, block_len=64).view()
    assert pair_short_ids(view, [1, 2], view, [3, 4], op="READ") == ((1, 2), (3, 4))
    for lids, rids in [(np.array([1]), [1]), ((1,), [1]), ([True], [1]), ([np.int64(1)], [1]), ([1, 2], [3]), ([], [])]:
        assert pair_short_ids(view, lids, view, rids, op="READ") is None
    assert pair_short_ids(view, [1, 2], view, [3, 3], op="READ") == ((1, 2), (3, 3))  # repeats only at the source
    assert pair_short_ids(view, [1, 2], view, [3, 3], op="WRITE") is None
    third = BlockLayout.from_regions("kv", [1 << 20, 1 << 21, 1 << 22], num_blocks=8, block_len=64).view(regions=(2, 3))
    assert pair_short_ids(third, [1], third, [5], op="READ") == ((17,), (21,))  # region 2's descriptors start at 16


def test_rows_of_different_lengths_pair_row_by_row():
    lay = BlockLayout.from_regions("kv", [0, 1 << 20], num_blocks=8, block_len=64)
    rows = as_block_id_rows([[1, 2], [3], []], 8, what="local", unique=True)
    assert [r.tolist() for r in rows] == [[1, 2], [3], []]
    lidx, ridx = pair_descriptor_id_rows(lay.view(), rows, lay.view(), as_block_id_rows([[5, 6], [7], []], 8, what="r"))
    for got_l, got_r, (lb, rb) in zip(lidx, ridx, [([1, 2], [5, 6]), ([3], [7]), ([], [])], strict=True):
        want_l, want_r = pair_descriptor_ids(lay.view(), np.array(lb, np.int64), lay.view(), np.array(rb, np.int64))
        assert got_l.tolist() == want_l.tolist() and got_r.tolist() == want_r.tolist()
    ragged = np.empty(2, dtype=object)
    ragged[:] = [np.array([1, 2]), np.array([3])]
    assert [r.tolist() for r in as_block_id_rows(ragged, 8, what="local")] == [[1, 2], [3]]
    with pytest.raises(LayoutError, match="more than once"):
        as_block_id_rows([[1, 1], [2]], 8, what="local", unique=True)
    with pytest.raises(LayoutError, match="out of range"):
        as_block_id_rows([[1, 2], [9]], 8, what="local")
    with pytest.raises(LayoutError, match="do not pair"):
        pair_descriptor_id_rows(lay.view(), [np.array([1, 2])], lay.view(), [np.array([3])])


def test_descriptor_ids_are_int64_whatever_the_ids_dtype():
    """A large offset (a late region of a big layout) must not overflow the caller's narrower ids."""
    lay = BlockLayout.from_regions("kv", [0, 1 << 40, 2 << 40], num_blocks=1 << 30, block_len=64)
    ids = lay.view(regions=(2, 3)).descriptor_ids(np.array([5], dtype=np.int32))
    assert ids.dtype == np.int64 and ids.tolist() == [2 * (1 << 30) + 5]


def test_bad_block_id_rows_are_refused():
    with pytest.raises(LayoutError, match="one row per transfer"):
        as_block_id_rows([1, 2], 8, what="local")
    with pytest.raises(LayoutError, match="block id 8 is out of range"):
        as_block_id_rows([[1], [8]], 8, what="local")
    with pytest.raises(LayoutError, match="integers"):
        as_block_id_rows([[0.5]], 8, what="local")
    with pytest.raises(LayoutError, match="more than once"):
        as_block_id_rows([[1, 2], [3, 3]], 8, what="local", unique=True)
    # each row is one transfer: two transfers may name the same block
    assert as_block_id_rows([[1, 2], [2, 1]], 8, what="local", unique=True).tolist() == [[1, 2], [2, 1]]
    lay = BlockLayout.from_regions("kv", [0], num_blocks=8, block_len=64)
    with pytest.raises(LayoutError, match="one each per transfer"):
        pair_descriptor_id_rows(lay.view(), np.zeros((2, 1), np.int64), lay.view(), np.zeros((3, 1), np.int64))


def test_pairing_refuses_mismatched_counts_and_sizes():
    a = BlockLayout.from_regions("kv", [0], num_blocks=8, block_len=64)
    b = BlockLayout.from_regions("kv", [0], num_blocks=8, block_len=128)
    with pytest.raises(LayoutError, match="do not pair"):
        pair_descriptor_ids(a.view(), np.array([1, 2]), a.view(), np.array([1]))
    with pytest.raises(LayoutError, match="sizes differ"):
        pair_descriptor_ids(a.view(), np.array([1]), b.view(), np.array([1]))
    two = BlockLayout.from_regions("kv", [0, 1 << 20], num_blocks=8, block_len=64)
    with pytest.raises(LayoutError, match="regions x parts"):
        pair_descriptor_ids(a.view(), np.array([1]), two.view(), np.array([1]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"region_addrs": []}, "no regions"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"block_len": 65, "kind": LayoutKind.BLOCKS_FIRST_KV}, "K/V halves"),
        ({"region_addrs": [0, 0]}, "overlap"),
        ({"region_addrs": [0, 255]}, "overlap"),
    ],
)
def test_invalid_layouts(kwargs, message):
    args = {"region_addrs": [0], "num_blocks": 4, "block_len": 64, **kwargs}
    with pytest.raises(LayoutError, match=message):
        BlockLayout.from_regions("kv", args.pop("region_addrs"), **args)


@pytest.mark.parametrize(
    "fields",
    [{"num_blocks": 2.5}, {"block_len": True}, {"device_id": 0.0}, {"region_addrs": [0]}, {"region_addrs": (0.5,)}],
)
def test_a_layout_built_directly_is_checked_as_one_decoded(fields):
    """An audit of session 39: msgspec checks a Struct's field types only when decoding, so a layout built
    directly with num_blocks=2.5 registered 5 bytes, prepared 2 descriptors and still took block id 2."""
    args = {"name": "kv", "region_addrs": (0,), "num_blocks": 4, "block_len": 64, **fields}
    with pytest.raises(LayoutError, match="must be Python ints"):
        BlockLayout(**args)


def test_from_regions_takes_numpys_ints():
    """A block length from numpy arithmetic was refused, naming ``$.num_blocks`` (derived from it)."""
    layout = BlockLayout.from_regions("kv", [np.int64(0)], num_blocks=np.int64(4), block_len=np.int32(64),
                                      device_id=np.int8(0), block_size=np.uint16(16))  # fmt: skip
    assert (layout.num_blocks, layout.block_len, layout.block_size) == (4, 64, 16)
    assert type(layout.num_blocks) is int and msgspec.json.decode(msgspec.json.encode(layout), type=BlockLayout)
    with pytest.raises(LayoutError, match="num_blocks"):
        BlockLayout.from_regions("kv", [0], num_blocks=np.float64(4.0), block_len=64)


def test_invalid_views():
    lay = BlockLayout.from_regions("kv", [0], num_blocks=4, block_len=64)
    with pytest.raises(LayoutError, match="does not fit"):
        lay.view(32, 64)
    with pytest.raises(LayoutError, match="equal pieces"):
        lay.view(0, 64, 3)
    assert ViewSpec(chunk_offset=32, chunk_len=32).resolve(lay).key == ("kv", 32, 32, 1)


def test_million_blocks_vectorised():
    lay = BlockLayout.from_regions("kv", [1 << 30, 1 << 40], num_blocks=1 << 20, block_len=4096)
    descs = lay.view().descriptors()
    assert descs.shape == (2 << 20, 3)
    assert int(descs[-1, 0]) == (1 << 40) + ((1 << 20) - 1) * 4096


def test_overlap_between_layouts():
    a = BlockLayout.from_regions("a", [0, 1024], num_blocks=4, block_len=64)
    assert a.overlaps(BlockLayout.from_regions("b", [1000], num_blocks=1, block_len=64))
    assert not a.overlaps(BlockLayout.from_regions("b", [256, 2048], num_blocks=1, block_len=64))
    vram = BlockLayout.from_regions("v", [0], num_blocks=4, block_len=64, mem_type=MemType.VRAM)
    assert not a.overlaps(vram)


def test_a_layout_built_directly_is_checked_too():
    """msgspec checks field constraints only when decoding: a layout built by hand is checked by its own code."""
    with pytest.raises(LayoutError, match="must be > 0"):
        BlockLayout(name="kv", region_addrs=(0x1000, 0x1000), num_blocks=0, block_len=64)
    with pytest.raises(LayoutError, match="must be > 0"):
        BlockLayout(name="kv", region_addrs=(0x1000,), num_blocks=4, block_len=-64)
    with pytest.raises(LayoutError, match="64-bit address space"):
        BlockLayout(name="kv", region_addrs=(-4096,), num_blocks=4, block_len=64)
    with pytest.raises(LayoutError, match="64-bit address space"):
        BlockLayout.from_regions("kv", [2**64 - 128], num_blocks=4, block_len=64)  # would wrap to address 0


def test_unsigned_ids_give_exact_integer_descriptor_ids():
    layout = BlockLayout.from_regions("kv", [0x10000, 0x20000 + 2**60], num_blocks=2**57, block_len=8)
    view = layout.view()
    ids = view.descriptor_ids(np.array([5, 2**56 + 1], dtype=np.uint64))
    assert ids.dtype == np.int64
    assert ids.tolist() == [5, 2**56 + 1, 2**57 + 5, 2**57 + 2**56 + 1]


def test_repeats_in_a_few_ids_of_a_huge_layout_are_found_without_a_bitmap_of_it():
    ids = np.arange(300, dtype=np.int64) * 1000
    assert as_block_ids(ids, 2**40, what="local", unique=True).tolist() == ids.tolist()
    ids[7] = ids[3]
    with pytest.raises(LayoutError, match="more than once"):
        as_block_ids(ids, 2**40, what="local", unique=True)


def _pairs(local_view, lidx, remote_view, ridx):
    """The (local, remote) descriptor pairs of a transfer, as address pairs: what NIXL copies, whatever the order."""
    ld, rd = local_view.descriptors()[np.asarray(lidx)], remote_view.descriptors()[np.asarray(ridx)]
    return sorted(zip(ld[:, 0].tolist(), rd[:, 0].tolist(), strict=True))


@settings(max_examples=200, deadline=None)
@given(views(), st.integers(1, 60), st.sampled_from(["READ", "WRITE"]), st.data())
def test_whole_block_pairs_come_ordered_by_local_block_so_nixl_can_merge_runs(view, k, op, data):
    """NIXL merges neighbouring descriptors only where both sides ascend; vLLM often hands out a run of blocks
    last first. Every path (one short transfer, the general one, rows of transfers) orders each transfer's pairs
    by local block, and pairs exactly the blocks it was given."""
    lay = view.layout
    view = lay.view(view.chunk_offset, view.chunk_len)  # whole pieces on both sides (split 1)
    other = BlockLayout.from_regions("kv", [(1 << 40) + (i << 24) for i in range(lay.num_regions)],
                                     num_blocks=lay.num_blocks + 7, block_len=lay.block_len, kind=lay.kind)  # fmt: skip
    remote = other.view(view.chunk_offset, view.chunk_len)
    n = min(k, lay.num_blocks) if op == "READ" else k
    lids = data.draw(st.lists(st.integers(0, lay.num_blocks - 1), min_size=n, max_size=n, unique=op == "READ"))
    n = min(n, other.num_blocks)
    lids = lids[:n]
    rids = data.draw(st.lists(st.integers(0, other.num_blocks - 1), min_size=n, max_size=n, unique=op == "WRITE"))
    la, ra = np.array(lids, np.int64), np.array(rids, np.int64)
    given_pairs = _pairs(view, view.descriptor_ids(la), remote, remote.descriptor_ids(ra))  # in the order given
    results = [pair_descriptor_ids(view, la, remote, ra)]
    rows_l, rows_r = pair_descriptor_id_rows(view, np.stack([la, la]), remote, np.stack([ra, ra]))
    results += [(rows_l[0], rows_r[0]), (rows_l[1], rows_r[1])]
    short = pair_short_ids(view, lids, remote, rids, op=op)
    if short is not None:
        results.append(short)
    for lidx, ridx in results:
        assert _pairs(view, lidx, remote, ridx) == given_pairs
        for g in range(view.num_groups):  # within each (region, part) group the local ids ascend
            group = np.asarray(lidx)[g * n : (g + 1) * n]
            assert (np.diff(group) >= 0).all()
    if short is not None:
        assert list(short[0]) == results[0][0].tolist() and list(short[1]) == results[0][1].tolist()


def test_a_descending_run_on_both_sides_comes_back_ascending():
    """The case that matters: a request's blocks handed out last first on both sides pair into one ascending run."""
    lay = BlockLayout.from_regions("kv", [1 << 20, 1 << 22], num_blocks=64, block_len=64)
    for local_blocks, remote_blocks in [([13, 12, 11, 10], [7, 6, 5, 4]), (list(range(50, 10, -1)), list(range(40)))]:
        want_l = sorted(local_blocks)
        want_r = [remote_blocks[local_blocks.index(b)] for b in want_l]
        lidx, ridx = pair_descriptor_ids(lay.view(), np.array(local_blocks), lay.view(), np.array(remote_blocks))
        assert lidx.tolist() == want_l + [b + 64 for b in want_l] and ridx.tolist() == want_r + [b + 64 for b in want_r]
        one = lay.view(regions=(1, 2))
        short = pair_short_ids(one, local_blocks, one, remote_blocks, op="READ")
        if len(local_blocks) <= 32:
            assert short == (tuple(b + 64 for b in want_l), tuple(b + 64 for b in want_r))
