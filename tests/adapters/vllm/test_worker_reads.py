"""The adapter's read path (`worker.receive`) at worker level, over real NIXL, without vLLM.

Prefill ranks are peer processes holding caches of vLLM 0.32's shape (``[blocks, heads, tokens,
2 * head_dim]`` bf16 per layer, head-major (LBHNC); MLA: ``[blocks, tokens, latent]``), serving at
``base port + rank`` under ``{engine_id}/tp{rank}`` as the adapter does. What a head's bytes mean
depends on the backend: FlashAttention (and Triton, FlashInfer...) keeps ``[tokens, K|V]`` (vLLM
splits ``kv_cache.transpose(1, 2).split(head_dim, -1)``), the CPU backend ``[K of every token, V
of every token]``. The oracle indexes (head, token, K|V) in each backend's own order, from the
prefill ranks' fill pattern, independently of the planner; the geometry comes from
`kv_layout.describe_cache`, as in the worker. Decode ranks run `receive` on their own engine.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time

import numpy as np
import pytest
import torch

from nixl_async import (
    EngineConfig,
    HandshakeError,
    LayoutError,
    LeaseExpired,
    NotificationFailed,
    TransferEngine,
    TransferFailed,
)
from nixl_async._agent import NIXL_ERRORS
from nixl_async._notify_transport import NotificationTransport
from nixl_async.testing import PeerCommandError, WaitNotifications, free_port_base, pattern_block
from nixl_async_vllm.block_pairs import GroupBlocks
from nixl_async_vllm.kv_layout import describe_cache
from nixl_async_vllm.leases import RequestLease
from nixl_async_vllm.settings import rank_engine_id
from nixl_async_vllm.tp_mapping import expected_consumers, remote_ranks
from nixl_async_vllm.worker import KVGeometry, RecvJob, _kv_regions, receive

LAYERS, HEADS, HEAD_DIM, LOCAL_BLOCK_SIZE, NUM_BLOCKS = 2, 4, 8, 16, 40
VEC = HEAD_DIM * 2  # one head's K (or V) for one token, bf16
ROW = 2 * VEC  # what one token adds to a head's bytes
MLA_ROW = 64  # one latent per token, bf16
REMOTE_BLOCKS = [9, 3, 17, 5, 11, 2, 7, 30, 14]  # prefill's blocks for the request, in order
LOCAL_CANDIDATES = [20, 21, 4, 33, 8, 12, 1, 25, 36]
LOCAL_HIT = 1  # decode already holds the first local block (prefix cache)


def _page(heads: int, block_size: int, mla: bool) -> int:
    return block_size * (MLA_ROW if mla else heads * ROW)


def _heads(kv_heads: int, tp: int) -> int:
    return max(1, kv_heads // tp)  # beyond the model's KV heads, vLLM replicates one head per rank


def _seed(p: int, tp_p: int, kv_heads: int) -> int:
    """Prefill rank p's fill pattern, named by its first KV head: replicas of a head hold the same bytes."""
    return 100 + p * kv_heads // tp_p


def _expected(rank, tp_p, tp_d, mla, ratio, layer, local_index, backend="CPU_ATTN", kv_heads=HEADS) -> np.ndarray:
    """Bytes of decode rank `rank`'s local block `local_index` (of the request), token by token."""
    bs_p = LOCAL_BLOCK_SIZE // ratio
    heads_p, heads_d = _heads(kv_heads, tp_p), _heads(kv_heads, tp_d)
    cpu = backend == "CPU_ATTN"
    if mla:
        out = np.zeros((LOCAL_BLOCK_SIZE, MLA_ROW), np.uint8)
    elif cpu:
        out = np.zeros((heads_d, 2, LOCAL_BLOCK_SIZE, VEC), np.uint8)  # (head, K|V, token, bytes)
    else:
        out = np.zeros((heads_d, LOCAL_BLOCK_SIZE, 2, VEC), np.uint8)  # (head, token, K|V, bytes)
    for t in range(LOCAL_BLOCK_SIZE):
        pos = (LOCAL_HIT + local_index) * LOCAL_BLOCK_SIZE + t
        block_index, token = divmod(pos, bs_p)
        if block_index >= len(REMOTE_BLOCKS):
            continue  # past the prompt: untouched
        remote_block = REMOTE_BLOCKS[block_index]
        if mla:
            src = pattern_block(100, layer, remote_block, _page(0, bs_p, True)).reshape(bs_p, MLA_ROW)
            out[t] = src[token]
            continue
        for h in range(heads_d):
            head = rank * kv_heads // tp_d + h  # the model's head index
            src = pattern_block(100 + head // heads_p * heads_p, layer, remote_block, _page(heads_p, bs_p, False))
            hp = head % heads_p
            if cpu:
                out[h, :, t] = src.reshape(heads_p, 2, bs_p, VEC)[hp, :, token]
            else:
                out[h, t] = src.reshape(heads_p, bs_p, 2, VEC)[hp, token]
    return out.reshape(-1)


async def _decode_rank(
    rank, tp_p, tp_d, mla, ratio, port, local_blocks, expires_at=None, backend="CPU_ATTN", kv_heads=HEADS,
    notice_failed=None, lease=None, bytes_meaning=(), compat_enforced=True, **engine_options,
):  # fmt: skip
    heads_d = _heads(kv_heads, tp_d)
    shape = (
        (NUM_BLOCKS, 1, LOCAL_BLOCK_SIZE, MLA_ROW // 2) if mla else (NUM_BLOCKS, heads_d, LOCAL_BLOCK_SIZE, ROW // 2)
    )
    caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    cache = describe_cache(backend, "LBHNC", shape, caches[0].stride(), 2, num_kv_heads=heads_d, mla=mla)
    geometry = KVGeometry(
        tp_size=tp_d, tp_rank=rank, block_size=LOCAL_BLOCK_SIZE, part_len=cache.block_len, run_len=cache.run_len,
        mla=mla, kv_heads=kv_heads, head_window=cache.head_window, ratio_refusal=cache.ratio_refusal,
        bytes_meaning=bytes_meaning, compat_enforced=compat_enforced,
    )  # fmt: skip
    job = RecvJob(
        request_id="req-d", remote_request_id="req-p", remote_engine_id="prefill", host="127.0.0.1", port=port,
        remote_tp=tp_p, groups=(GroupBlocks("full", local_blocks, REMOTE_BLOCKS, LOCAL_HIT),), expires_at=expires_at,
    )  # fmt: skip
    async with TransferEngine(EngineConfig(engine_id=f"decode/tp{rank}", **engine_options)) as engine:
        engine.register("kv", caches, num_blocks=NUM_BLOCKS)
        results = await receive(engine, geometry, job, notice_failed=notice_failed, lease=lease)
    return [c.view(torch.uint8).numpy().reshape(NUM_BLOCKS, -1) for c in caches], results


def _spawn_prefill(factory, tp_p, mla, ratio, kv_heads=HEADS, tcp=False, extra=None):
    """(base port, prefill rank processes); `tcp`: UCX over TCP only, so reads are really in flight."""
    port = free_port_base(4)
    bs_p = LOCAL_BLOCK_SIZE // ratio
    return port, [
        factory(
            engine_id=rank_engine_id("prefill", p), port=port + p, num_regions=LAYERS, num_blocks=NUM_BLOCKS,
            block_len=_page(_heads(kv_heads, tp_p), bs_p, mla), seed=100 if mla else _seed(p, tp_p, kv_heads),
            extra={"block_size": str(bs_p), **(extra or {})}, tcp=tcp,
        )
        for p in range(tp_p)
    ]  # fmt: skip


async def _assert_notified(prefill, readers: int) -> None:
    """Each prefill rank heard "req-p:<readers>" from exactly `readers` distinct decode ranks."""
    for proc in prefill:
        senders = await proc.request(WaitNotifications(message=f"req-p:{readers}".encode(), count=readers, timeout=10))
        assert len(set(senders)) == readers


CASES = [
    # tp_p, tp_d, mla, ratio (local block size / remote block size), attention backend, the model's KV heads
    (1, 1, False, 1, "CPU_ATTN", HEADS),
    (1, 2, False, 1, "CPU_ATTN", HEADS),
    (2, 1, False, 1, "CPU_ATTN", HEADS),
    (1, 2, True, 1, "TRITON_MLA", 1),
    (2, 1, True, 1, "TRITON_MLA", 1),
    (1, 1, True, 2, "TRITON_MLA", 1),
    (1, 2, False, 1, "FLASH_ATTN", HEADS),
    (1, 1, False, 2, "FLASH_ATTN", HEADS),
    (1, 2, False, 2, "FLASH_ATTN", HEADS),
    (2, 1, False, 2, "FLASH_ATTN", HEADS),
    (1, 1, False, 4, "FLASH_ATTN", HEADS),
    # TP beyond the KV heads: each rank holds one head, replicated on TP / heads ranks
    (1, 4, False, 1, "FLASH_ATTN", 2),
    (2, 4, False, 2, "FLASH_ATTN", 2),
    (4, 1, False, 1, "CPU_ATTN", 2),
    (4, 2, False, 2, "FLASH_ATTN", 2),
]


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "mla", "ratio", "backend", "kv_heads"),
    CASES,
    ids=[f"{n}-p{a}-d{b}-ratio{r}-heads{k}" for a, b, _, r, n, k in CASES],
)
async def test_every_byte_lands_where_vllm_expects_it(nixl_peer_factory, tp_p, tp_d, mla, ratio, backend, kv_heads):
    port, prefill = _spawn_prefill(nixl_peer_factory, tp_p, mla, ratio, kv_heads)
    remote_left = len(REMOTE_BLOCKS) - LOCAL_HIT * ratio
    local_blocks = LOCAL_CANDIDATES[: -(-remote_left // ratio)]  # the tail block may be partly filled
    outcomes = await asyncio.gather(
        *(
            _decode_rank(d, tp_p, tp_d, mla, ratio, port, local_blocks, backend=backend, kv_heads=kv_heads)
            for d in range(tp_d)
        )
    )
    _assert_landed(outcomes, local_blocks, tp_p, tp_d, mla, ratio, backend, kv_heads)
    await _assert_notified(prefill, expected_consumers(remote_tp=tp_p, local_tp=tp_d))


def _assert_landed(outcomes, local_blocks, tp_p, tp_d, mla, ratio, backend, kv_heads):
    for rank, (caches, results) in enumerate(outcomes):
        assert results, "something must have been read"
        for layer, cache in enumerate(caches):
            for i, block in enumerate(local_blocks):
                want = _expected(rank, tp_p, tp_d, mla, ratio, layer, i, backend, kv_heads)
                assert np.array_equal(cache[block], want), (rank, layer, i)
            untouched = [b for b in range(NUM_BLOCKS) if b not in local_blocks]
            assert not cache[untouched].any(), "blocks outside the request must stay untouched"


@pytest.mark.parametrize(("tp_p", "mla", "backend", "kv_heads"),
                         [(2, True, "TRITON_MLA", 1), (2, False, "CPU_ATTN", 2)],
                         ids=["mla-sibling-told", "both-read"])  # fmt: skip
async def test_the_request_lease_knows_every_rank_the_reader_is_done_with(nixl_peer_factory, tp_p, mla, backend,
                                                                          kv_heads):  # fmt: skip
    """Renewals then ignore those ranks' "gone" (they may free the request once told: tests/adapters/vllm/
    test_leases.py); the one still read is not among them until its read with the notice ended."""
    port, _prefill = _spawn_prefill(nixl_peer_factory, tp_p, mla, 1, kv_heads)
    lease = RequestLease(None, 0.0)
    local_blocks = LOCAL_CANDIDATES[: len(REMOTE_BLOCKS) - LOCAL_HIT]
    await _decode_rank(0, tp_p, 1, mla, 1, port, local_blocks, backend=backend, kv_heads=kv_heads, lease=lease)
    ranks = [rank_engine_id("prefill", p) for p in range(tp_p)]
    assert all(lease.done_with(rank) for rank in ranks)
    assert (lease.told == set(ranks[1:])) if mla else (set(lease.notice_reads) == set(ranks) and not lease.told)


UNTOLD = [CASES[0], CASES[4], CASES[7]]  # the notice rides on the read; an MLA sibling's; after a split read


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "mla", "ratio", "backend", "kv_heads"), UNTOLD, ids=["one-read", "mla-sibling", "split-read"]
)
async def test_a_notice_that_cannot_be_sent_keeps_the_data(nixl_peer_factory, monkeypatch, tp_p, tp_d, mla, ratio,
                                                           backend, kv_heads):  # fmt: skip
    """vLLM's connector logs a failed notice and keeps the KV it read (the producer frees its blocks when
    the lease ends): the load succeeds, and the failure is counted."""
    port, _prefill = _spawn_prefill(nixl_peer_factory, tp_p, mla, ratio, kv_heads)
    local_blocks = LOCAL_CANDIDATES[: -(-(len(REMOTE_BLOCKS) - LOCAL_HIT * ratio) // ratio)]

    def refuse(self, peer, message):
        raise NIXL_ERRORS[0]("NIXL_ERR_NOT_FOUND")

    monkeypatch.setattr(NotificationTransport, "send", refuse)
    untold = []
    ranks = [
        _decode_rank(d, tp_p, tp_d, mla, ratio, port, local_blocks, backend=backend, kv_heads=kv_heads,
                     notice_failed=untold.append)
        for d in range(tp_d)
    ]  # fmt: skip
    outcomes = await asyncio.gather(*ranks)
    _assert_landed(outcomes, local_blocks, tp_p, tp_d, mla, ratio, backend, kv_heads)
    assert len(untold) == tp_d * len(remote_ranks(local_tp=tp_d, local_rank=0, remote_tp=tp_p))
    assert all(isinstance(error, NotificationFailed) for error in untold)


async def test_when_a_part_of_a_one_rank_read_cannot_start_the_parts_in_flight_are_quiet_before_the_error(
    nixl_peer_factory, monkeypatch
):
    """One producer rank is read without a task of its own; the error still reaches the caller only once NIXL
    holds none of the request's reads (vLLM may reuse its blocks as soon as it hears). Over UCX/TCP, so the
    part started first is really in flight when the next one fails to start."""
    tp_p, tp_d, mla, ratio, backend, kv_heads = CASES[7]  # one rank; the block ratio splits its read
    port, _prefill = _spawn_prefill(nixl_peer_factory, tp_p, mla, ratio, kv_heads, tcp=True)
    started, quiet_when_raised = [], []
    real_start_read, real_receive = TransferEngine.start_read, receive

    async def start_read(self, *args, **kwargs):
        if started:
            raise TransferFailed("the second part could not start")
        started.append(transfer := await real_start_read(self, *args, **kwargs))
        return transfer

    async def receive_noting_quiet(*args, **kwargs):
        try:
            return await real_receive(*args, **kwargs)
        except TransferFailed:
            quiet_when_raised.extend(t.quiet for t in started)  # before _decode_rank closes the engine
            raise

    monkeypatch.setattr(TransferEngine, "start_read", start_read)
    monkeypatch.setitem(globals(), "receive", receive_noting_quiet)
    local_blocks = LOCAL_CANDIDATES[: -(-(len(REMOTE_BLOCKS) - LOCAL_HIT * ratio) // ratio)]
    with pytest.raises(TransferFailed, match="second part"):
        await _decode_rank(0, tp_p, tp_d, mla, ratio, port, local_blocks, backend=backend, kv_heads=kv_heads)
    assert quiet_when_raised == [True]


FAILED_READS = [
    # CASES index, which start_read fails, whether the read before it lands first (and tells its rank)
    (7, 1, False),  # one rank read in two parts: the second cannot start, the first is in flight
    (2, 1, False),  # two ranks: the second rank's read cannot start, the first's is in flight
    (2, 1, True),  # ... the first's landed and carried its notice: that rank must not hear it again
    (1, 0, False),  # TP 1 -> 2: this rank is one of the producer's 2 readers; a second notice frees its share
    (4, 0, False),  # MLA 2 -> 1: the read fails, the sibling rank (notified only) hears once
]


@pytest.mark.parametrize(("case", "failing", "first_lands"), FAILED_READS,
                         ids=["one-rank-in-two-parts", "two-ranks", "two-ranks-first-landed", "one-of-two-readers",
                              "mla-sibling"])  # fmt: skip
async def test_after_a_failed_read_each_producer_rank_hears_once_that_its_blocks_are_free(
    nixl_peer_factory, monkeypatch, case, failing, first_lands
):
    """A read cannot start (UCX over TCP). Once nothing reads them, every producer rank of the request
    hears the usual notice from this rank exactly once, so it frees the blocks at once; before, those not
    told held them until their lease ended. Twice would be worse: a producer read by two decode ranks
    counts notices, and one rank's second would free blocks the other still reads."""
    tp_p, tp_d, mla, ratio, backend, kv_heads = CASES[case]
    port, prefill = _spawn_prefill(nixl_peer_factory, tp_p, mla, ratio, kv_heads, tcp=True)
    calls, real_start_read, started = itertools.count(), TransferEngine.start_read, []

    async def start_read(self, *args, **kwargs):
        if next(calls) == failing:
            if first_lands:
                await asyncio.wait_for(started[0].wait_quiet(), 10)
                assert started[0].exception() is None
            raise TransferFailed("a read could not start")
        started.append(transfer := await real_start_read(self, *args, **kwargs))
        return transfer

    monkeypatch.setattr(TransferEngine, "start_read", start_read)
    local_blocks = LOCAL_CANDIDATES[: -(-(len(REMOTE_BLOCKS) - LOCAL_HIT * ratio) // ratio)]
    with pytest.raises(TransferFailed, match="could not start"):
        await _decode_rank(0, tp_p, tp_d, mla, ratio, port, local_blocks, backend=backend, kv_heads=kv_heads)
    ranks = remote_ranks(local_tp=tp_d, local_rank=0, remote_tp=tp_p)
    await _assert_told_once([prefill[r] for r in ranks], expected_consumers(remote_tp=tp_p, local_tp=tp_d))


async def test_a_read_fenced_past_the_grace_tells_its_producers_once_it_is_quiet(nixl_peer_factory, monkeypatch):
    """TP 2 -> 1 over UCX/TCP: rank 1's read is in flight, its producer paused (SIGSTOP), when rank 0's
    cannot start; the read stays in NIXL past the grace, then the producer resumes. Once the read is
    quiet both producer ranks hear the notice once; before, neither ever did (each held the blocks
    until its lease ended)."""
    tp_p, tp_d, mla, ratio, backend, kv_heads = CASES[2]
    port, prefill = _spawn_prefill(nixl_peer_factory, tp_p, mla, ratio, kv_heads, tcp=True)
    real_start_read, resumed = TransferEngine.start_read, []

    async def start_read(self, peer, *args, **kwargs):
        if peer.engine_id == rank_engine_id("prefill", 0):
            await asyncio.sleep(0.3)  # rank 1's read is in flight meanwhile
            raise TransferFailed("rank 0's read could not start")
        os.kill(prefill[1].pid, signal.SIGSTOP)  # (connected already: the read goes out and stays out)
        asyncio.get_running_loop().call_later(2.0, lambda: resumed.append(os.kill(prefill[1].pid, signal.SIGCONT)))
        return await real_start_read(self, peer, *args, **kwargs)

    monkeypatch.setattr(TransferEngine, "start_read", start_read)
    local_blocks = LOCAL_CANDIDATES[: len(REMOTE_BLOCKS) - LOCAL_HIT]
    try:
        with pytest.raises(TransferFailed, match="could not start"):
            await _decode_rank(0, tp_p, tp_d, mla, ratio, port, local_blocks, backend=backend, kv_heads=kv_heads,
                               release_grace_s=0.3)  # fmt: skip
    finally:
        os.kill(prefill[1].pid, signal.SIGCONT)
    assert resumed, "the request ended before its read was quiet"
    await _assert_told_once(prefill, expected_consumers(remote_tp=tp_p, local_tp=tp_d))


async def _assert_told_once(prefill, readers: int) -> None:
    """Each prefill rank heard "req-p:<readers>" from decode's rank 0 exactly once."""
    notice = f"req-p:{readers}".encode()
    for proc in prefill:
        assert await proc.request(WaitNotifications(message=notice, count=1, timeout=10)) == ["decode/tp0"]
        with pytest.raises(PeerCommandError, match="NotificationTimeout"):  # (the wait above took the first)
            await proc.request(WaitNotifications(message=notice, count=1, timeout=0.5))


@pytest.mark.parametrize("blocks", ["to-read", "none"])
async def test_a_producer_rank_unreachable_before_the_reads_leaves_the_others_told(nixl_peer_factory, blocks):
    """TP 2 -> 1 with prefill's rank 1 gone: the request fails before any read, and rank 0, which
    answered, hears the notice once, so it frees the blocks at once; before, nobody was told and it
    held them until its lease ended. With no blocks to read (a full prefix hit), the same."""
    port, prefill = _spawn_prefill(nixl_peer_factory, 2, False, 1)
    prefill[1].kill()
    local = LOCAL_CANDIDATES[: len(REMOTE_BLOCKS) - LOCAL_HIT] if blocks == "to-read" else []
    with pytest.raises(HandshakeError):
        await _decode_rank(0, 2, 1, False, 1, port, local)
    await _assert_told_once(prefill[:1], expected_consumers(remote_tp=2, local_tp=1))


async def test_a_block_size_ratio_into_the_cpu_backend_is_refused_before_reading(nixl_peer_factory):
    # The CPU backend stores each head's K per ISA (transposed on "vec", tiled on AMX): smaller remote
    # blocks cannot be placed by token runs, so the read is refused rather than scrambled.
    port, prefill = _spawn_prefill(nixl_peer_factory, 1, False, 2)
    local = LOCAL_CANDIDATES[:4]
    with pytest.raises(LayoutError, match="CPU backend"):
        await _decode_rank(0, 1, 1, False, 2, port, local)
    await _assert_told_once(prefill, 1)  # connected before the refusal: it frees the blocks at once


_LAYOUT = (("kv_cache_layout", "LBNHC"),)
# (since session 40 also the packing's class and the element type: a two-plane block (ROCM_ATTN) is as large as a
# FlashAttention one in the same layout, an fp8 e5m2 one as an e4m3 one; under the opt-out they were read as garbage)
_PACKED = (*_LAYOUT, ("attention_packing", "kv_per_token_slot"), ("kv_cache_dtype", "fp8_e4m3"))


@pytest.mark.parametrize(
    "published, enforced, ours, refused",
    [
        ({"kv_cache_layout": "LBHNC"}, False, _LAYOUT, "'LBHNC', ours is 'LBNHC'"),  # the opt-out: still compared
        ({"kv_cache_layout": "LBHNC"}, True, _LAYOUT, "'LBHNC', ours is 'LBNHC'"),
        ({}, False, _LAYOUT, "kv_cache_layout is not published"),  # nothing to compare, and no hash compared it
        ({}, True, _LAYOUT, None),  # an adapter from before these were published: the enforced hash compared them
        ({"kv_cache_layout": "LBNHC"}, False, _LAYOUT, None),
        ({"kv_cache_layout": "LBNHC", "attention_packing": "ROCM_ATTN", "kv_cache_dtype": "fp8_e4m3"}, False,
         _PACKED, "'ROCM_ATTN', ours is 'kv_per_token_slot'"),
        ({"kv_cache_layout": "LBNHC", "attention_packing": "kv_per_token_slot", "kv_cache_dtype": "fp8_e5m2"}, False,
         _PACKED, "'fp8_e5m2', ours is 'fp8_e4m3'"),
        ({"kv_cache_layout": "LBNHC"}, False, _PACKED, None),  # an adapter from before session 40: the layout alone
    ],
    ids=["other_layout_opted_out", "other_layout", "unpublished_opted_out", "unpublished_hash_enforced", "same",
         "two_planes_opted_out", "other_fp8_opted_out", "older_producer_opted_out"],
)  # fmt: skip
async def test_a_producer_whose_blocks_mean_something_else_is_refused(nixl_peer_factory, published, enforced, ours,
                                                                       refused):  # fmt: skip
    """What a block's bytes mean (cache layout, CPU ISA, state layout and dtypes, packing class, element type) is
    compared before reading, even with ``enforce_handshake_compat: false``, which skips vLLM's hash only (as in
    vLLM). Before, the opt-out made a layout mismatch a warning: LBHNC blocks read into an LBNHC cache, tokens and
    heads transposed, no error."""
    port, prefill = _spawn_prefill(nixl_peer_factory, 1, False, 1, extra=published)
    local = LOCAL_CANDIDATES[: len(REMOTE_BLOCKS) - LOCAL_HIT]
    if refused is None:
        _caches, results = await _decode_rank(0, 1, 1, False, 1, port, local, bytes_meaning=ours,
                                              compat_enforced=enforced)  # fmt: skip
        assert results
    else:
        with pytest.raises(LayoutError, match=refused):
            await _decode_rank(0, 1, 1, False, 1, port, local, bytes_meaning=ours, compat_enforced=enforced)
        await _assert_told_once(prefill, 1)  # connected before the refusal: it frees the blocks at once


async def test_mla_blocks_are_read_whatever_layout_the_producer_names(nixl_peer_factory):
    """With MLA one latent "head" makes LBHNC and LBNHC the same bytes: vLLM skips its layout check there, and so
    does the adapter (it refused such a producer under the opt-out before this was found by a review)."""
    port, _prefill = _spawn_prefill(nixl_peer_factory, 1, True, 1, extra={"kv_cache_layout": "LBHNC"})
    local = LOCAL_CANDIDATES[: len(REMOTE_BLOCKS) - LOCAL_HIT]
    _caches, results = await _decode_rank(0, 1, 1, True, 1, port, local, bytes_meaning=(("kv_cache_layout", "LBNHC"),),
                                          compat_enforced=False)  # fmt: skip
    assert results


async def test_full_prefix_hit_only_notifies(nixl_peer_factory):
    port, prefill = _spawn_prefill(nixl_peer_factory, 1, False, 1)
    caches, results = await _decode_rank(0, 1, 1, False, 1, port, [])
    assert results == [] and not any(c.any() for c in caches)
    await _assert_notified(prefill, 1)  # so prefill frees its blocks at once


async def test_read_after_the_producer_lease_is_refused(nixl_peer_factory):
    port, _prefill = _spawn_prefill(nixl_peer_factory, 1, False, 1)
    local = LOCAL_CANDIDATES[: len(REMOTE_BLOCKS) - LOCAL_HIT]
    with pytest.raises(LeaseExpired):  # the blocks may belong to another request by now
        await _decode_rank(0, 1, 1, False, 1, port, local, expires_at=time.time() - 1)


def test_kv_regions_register_each_layer_once():
    buffer = torch.zeros(2 * NUM_BLOCKS * HEADS * LOCAL_BLOCK_SIZE * 2 * HEAD_DIM, dtype=torch.bfloat16)
    packed = buffer.view(2, NUM_BLOCKS, HEADS, LOCAL_BLOCK_SIZE, 2 * HEAD_DIM)  # one view per layer
    regions, block_len, pages = _kv_regions({"l0": packed[0], "l1": packed[1], "alias": packed[1]}, NUM_BLOCKS)
    assert len(regions) == 2 and block_len == HEADS * LOCAL_BLOCK_SIZE * ROW and pages == 1
    padded = torch.zeros(NUM_BLOCKS, HEADS + 1, LOCAL_BLOCK_SIZE, 2 * HEAD_DIM, dtype=torch.bfloat16)[:, :HEADS]
    with pytest.raises(LayoutError, match="dense"):
        _kv_regions({"l0": padded}, NUM_BLOCKS)
    kernel_pages = buffer.view(2 * NUM_BLOCKS, HEADS, LOCAL_BLOCK_SIZE, 2 * HEAD_DIM)  # 2 kernel pages per block
    _regions, page_len, pages = _kv_regions({"l0": kernel_pages}, NUM_BLOCKS)
    assert pages == 2 and page_len == HEADS * LOCAL_BLOCK_SIZE * ROW
    odd = buffer[: 3 * HEADS * LOCAL_BLOCK_SIZE * 2 * HEAD_DIM].view(3, HEADS, LOCAL_BLOCK_SIZE, 2 * HEAD_DIM)
    with pytest.raises(LayoutError, match=r"of \[3\] blocks: expected 40"):
        _kv_regions({"l0": odd}, NUM_BLOCKS)
    # a layer with half the KV heads and twice the tokens per block: pages of equal bytes, other packing
    other = buffer.view(2, NUM_BLOCKS, HEADS // 2, 2 * LOCAL_BLOCK_SIZE, 2 * HEAD_DIM)
    with pytest.raises(LayoutError, match="other KV heads or head sizes"):
        _kv_regions({"l0": packed[0], "l1": other[1]}, NUM_BLOCKS)


KERNEL_BLOCK = LOCAL_BLOCK_SIZE // 2  # vLLM split each logical block into 2 kernel pages


def _page_expected(cache_pages, local_blocks, remote_pages_per_block, remote_kernel, rank, tp_p, tp_d, layer):
    """Check decode's kernel pages token by token against prefill's pages: (head, token, K|V) by position."""
    heads_p, heads_d = HEADS // tp_p, HEADS // tp_d
    remote_page_len = _page(heads_p, remote_kernel, False)
    got = cache_pages.reshape(-1, heads_d, KERNEL_BLOCK, 2, VEC)
    for i, block in enumerate(local_blocks):
        for t in range(LOCAL_BLOCK_SIZE):
            pos = (LOCAL_HIT + i) * LOCAL_BLOCK_SIZE + t
            remote_logical = remote_kernel * remote_pages_per_block
            index, within = divmod(pos, remote_logical)
            if index >= len(REMOTE_BLOCKS):
                assert not got[block * 2 + t // KERNEL_BLOCK, :, t % KERNEL_BLOCK].any()
                continue
            page = REMOTE_BLOCKS[index] * remote_pages_per_block + within // remote_kernel
            for h in range(heads_d):
                p, hp = divmod(rank * heads_d + h, heads_p)
                src = pattern_block(100 + p, layer, page, remote_page_len).reshape(heads_p, remote_kernel, 2, VEC)
                want = src[hp, within % remote_kernel]
                assert np.array_equal(got[block * 2 + t // KERNEL_BLOCK, h, t % KERNEL_BLOCK], want), (i, t, h)


PAGED_CASES = [
    # tp_p, tp_d, prefill's kernel pages per logical block (prefill's kernel block is always KERNEL_BLOCK)
    (1, 1, 2),
    (1, 2, 2),
    (2, 1, 2),
    (1, 1, 1),  # prefill's logical block is one kernel page: half of decode's logical block
]


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "remote_ppb"), PAGED_CASES, ids=[f"p{a}-d{b}-ppb{c}" for a, b, c in PAGED_CASES]
)
async def test_kernel_pages_smaller_than_the_block_are_read_page_by_page(nixl_peer_factory, tp_p, tp_d, remote_ppb):
    """vLLM's views of `[blocks x pages, heads, kernel tokens, K|V]`: logical block b is pages b*k .. b*k+k-1."""
    port = free_port_base(4)
    prefill = [
        nixl_peer_factory(
            engine_id=rank_engine_id("prefill", p), port=port + p, num_regions=LAYERS,
            num_blocks=NUM_BLOCKS * remote_ppb, block_len=_page(HEADS // tp_p, KERNEL_BLOCK, False), seed=100 + p,
            extra={"block_size": str(KERNEL_BLOCK), "pages_per_block": str(remote_ppb)},
        )
        for p in range(tp_p)
    ]  # fmt: skip
    remote_tokens = len(REMOTE_BLOCKS) * KERNEL_BLOCK * remote_ppb
    local_blocks = LOCAL_CANDIDATES[: -(-remote_tokens // LOCAL_BLOCK_SIZE) - LOCAL_HIT]
    remote_blocks = REMOTE_BLOCKS

    async def decode_rank(rank: int):
        heads_d = HEADS // tp_d
        shape = (NUM_BLOCKS * 2, heads_d, KERNEL_BLOCK, ROW // 2)
        caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
        regions, page_len, pages_per_block = _kv_regions({f"l{i}": c for i, c in enumerate(caches)}, NUM_BLOCKS)
        cache = describe_cache("FLASH_ATTN", "LBHNC", shape, caches[0].stride(), 2, num_kv_heads=heads_d, mla=False)
        geometry = KVGeometry(
            tp_size=tp_d, tp_rank=rank, block_size=KERNEL_BLOCK, part_len=page_len, run_len=cache.run_len, mla=False,
            kv_heads=HEADS, head_window=cache.head_window, ratio_refusal=cache.ratio_refusal,
            pages_per_block=pages_per_block,
        )  # fmt: skip
        job = RecvJob(
            request_id="req-d", remote_request_id="req-p", remote_engine_id="prefill", host="127.0.0.1", port=port,
            remote_tp=tp_p, groups=(GroupBlocks("full", local_blocks, remote_blocks, LOCAL_HIT),), expires_at=None,
        )  # fmt: skip
        async with TransferEngine(EngineConfig(engine_id=f"decode/tp{rank}")) as engine:
            engine.register("kv", regions, num_blocks=NUM_BLOCKS * pages_per_block)
            await receive(engine, geometry, job)
        return [c.view(torch.uint8).numpy() for c in caches]

    outcomes = await asyncio.gather(*(decode_rank(d) for d in range(tp_d)))
    for rank, caches in enumerate(outcomes):
        for layer, cache in enumerate(caches):
            _page_expected(cache, local_blocks, remote_ppb, KERNEL_BLOCK, rank, tp_p, tp_d, layer)
            touched = {b * 2 + j for b in local_blocks for j in range(2)}
            untouched = [pg for pg in range(NUM_BLOCKS * 2) if pg not in touched]
            assert not cache.reshape(NUM_BLOCKS * 2, -1)[untouched].any(), "pages outside the request stay untouched"
    await _assert_notified(prefill, expected_consumers(remote_tp=tp_p, local_tp=tp_d))
