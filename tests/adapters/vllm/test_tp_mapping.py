"""Heterogeneous TP and MLA at worker level, over real NIXL.

Prefill ranks are peer processes whose KV caches have the shape vLLM's CPU backend allocates
per layer, ``[num_blocks, kv_heads_per_rank, block_size, 2 * head_dim]`` in bf16 (a block is
head-major). Decode ranks are engines reading what `plan_reads` tells them. The expected bytes
are assembled independently, by global head index, from the prefill ranks' fill pattern.
"""

import asyncio

import numpy as np
import pytest
import torch

from nixl_async import EngineConfig, LayoutError, TransferEngine, ViewSpec
from nixl_async.testing import WaitNotifications, pattern_block
from nixl_async_vllm.tp_mapping import expected_consumers, plan_reads

LAYERS, HEADS, BLOCK_SIZE, HEAD_DIM, NUM_BLOCKS = 2, 4, 16, 8, 32
TOKEN_HEAD_BYTES = 2 * HEAD_DIM * 2  # K and V of one head for one token, bf16
MLA_TOKEN_BYTES = 64  # a latent of 32 bf16 values per token, the same on every rank
REMOTE_BLOCKS, LOCAL_BLOCKS = [3, 17, 5], [0, 1, 2]


def _page(heads: int, mla: bool) -> int:
    return BLOCK_SIZE * (MLA_TOKEN_BYTES if mla else heads * TOKEN_HEAD_BYTES)


def _expected_block(layer: int, remote_block: int, decode_rank: int, tp_p: int, tp_d: int, mla: bool) -> np.ndarray:
    """The bytes decode rank `decode_rank` must hold for `remote_block`, built head by head."""
    if mla:
        return pattern_block(100, layer, remote_block, _page(0, True))
    heads_p, heads_d = HEADS // tp_p, HEADS // tp_d
    rows = []
    for global_head in range(decode_rank * heads_d, (decode_rank + 1) * heads_d):
        p, h = divmod(global_head, heads_p)
        prefill_block = pattern_block(100 + p, layer, remote_block, _page(heads_p, False))
        rows.append(prefill_block.reshape(heads_p, BLOCK_SIZE * TOKEN_HEAD_BYTES)[h])  # [heads, tokens * 2 * dim]
    return np.concatenate(rows)


async def _decode_rank(rank, tp_p, tp_d, mla, prefill, message_for):
    heads_d = HEADS // tp_d
    shape = (NUM_BLOCKS, BLOCK_SIZE, MLA_TOKEN_BYTES // 2) if mla else (NUM_BLOCKS, heads_d, BLOCK_SIZE, 2 * HEAD_DIM)
    caches = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    async with TransferEngine(EngineConfig(engine_id=f"decode-rank{rank}")) as engine:
        engine.register("kv", caches, num_blocks=NUM_BLOCKS)
        plan = plan_reads(
            local_tp=tp_d, local_rank=rank, remote_tp=tp_p, mla=mla, kv_heads=HEADS,
            local_part_len=_page(heads_d, mla), remote_part_len=_page(HEADS // tp_p, mla),
        )  # fmt: skip
        for step in plan:
            peer = await engine.connect(*prefill[step.remote_rank].address)
            message = message_for(step.remote_rank)
            if step.read:
                await engine.read(
                    peer, LOCAL_BLOCKS, REMOTE_BLOCKS, local=step.local, remote=step.remote, notify=message
                )
            else:
                await engine.notify(peer, message)
    return [c.view(torch.uint8).numpy().reshape(NUM_BLOCKS, -1) for c in caches], plan


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "mla"),
    [(1, 1, False), (1, 2, False), (2, 1, False), (4, 2, False), (1, 2, True), (2, 1, True)],
    ids=["tp1-tp1", "prefill1-decode2", "prefill2-decode1", "prefill4-decode2", "mla-prefill1-decode2",
         "mla-prefill2-decode1"],
)  # fmt: skip
async def test_every_byte_lands_where_vllm_expects_it(nixl_peer_factory, tp_p, tp_d, mla):
    heads_p = HEADS // tp_p
    prefill = [
        nixl_peer_factory(
            engine_id=f"prefill-rank{p}",
            num_regions=LAYERS,
            num_blocks=NUM_BLOCKS,
            block_len=_page(heads_p, mla),
            seed=100 if mla else 100 + p,
        )
        for p in range(tp_p)
    ]
    consumers = expected_consumers(remote_tp=tp_p, local_tp=tp_d)

    def message_for(remote_rank: int) -> bytes:
        return f"req-1:{consumers}".encode()

    results = await asyncio.gather(*(_decode_rank(d, tp_p, tp_d, mla, prefill, message_for) for d in range(tp_d)))
    for rank, (caches, _plan) in enumerate(results):
        for layer, cache in enumerate(caches):
            for local, remote in zip(LOCAL_BLOCKS, REMOTE_BLOCKS, strict=True):
                want = _expected_block(layer, remote, rank, tp_p, tp_d, mla)
                assert np.array_equal(cache[local], want), (rank, layer, local)
            untouched = [b for b in range(NUM_BLOCKS) if b not in LOCAL_BLOCKS]
            assert not cache[untouched].any(), "blocks outside the request must stay untouched"
    # every prefill rank hears from exactly its consumers, so it can free the request's blocks
    for p, proc in enumerate(prefill):
        senders = await proc.request(WaitNotifications(message=message_for(p), count=consumers, timeout=10))
        assert len(senders) == consumers
        readers = {f"decode-rank{d}" for d, (_, plan) in enumerate(results) if any(s.remote_rank == p for s in plan)}
        assert set(senders) == readers


def test_plans_cover_each_case():
    whole = plan_reads(local_tp=2, local_rank=1, remote_tp=2, local_part_len=512, remote_part_len=512, kv_heads=4)
    assert [(s.remote_rank, s.remote.chunk_offset) for s in whole] == [(1, 0)]
    up = plan_reads(local_tp=4, local_rank=3, remote_tp=2, local_part_len=256, remote_part_len=512, kv_heads=4)
    assert [(s.remote_rank, s.remote.chunk_offset, s.remote.chunk_len) for s in up] == [(1, 256, 256)]
    down = plan_reads(local_tp=1, local_rank=0, remote_tp=2, local_part_len=1024, remote_part_len=512, kv_heads=4)
    assert [(s.remote_rank, s.local.chunk_offset) for s in down] == [(0, 0), (1, 512)]
    mla = plan_reads(local_tp=1, local_rank=0, remote_tp=4, local_part_len=64, remote_part_len=64, kv_heads=1,
                     mla=True)  # fmt: skip
    assert [(s.remote_rank, s.read) for s in mla] == [(0, True), (1, False), (2, False), (3, False)]
    assert expected_consumers(remote_tp=1, local_tp=4) == 4 and expected_consumers(remote_tp=4, local_tp=1) == 1


def test_replicated_heads_are_read_once_and_their_replicas_notified():
    # 2 KV heads of 256 bytes; at TP 4 every rank holds one head, ranks (0, 1) head 0 and (2, 3) head 1
    into_replicas = [
        plan_reads(local_tp=4, local_rank=d, remote_tp=1, local_part_len=256, remote_part_len=512, kv_heads=2)
        for d in range(4)
    ]
    assert [[(s.remote_rank, s.remote.chunk_offset, s.remote.chunk_len) for s in p] for p in into_replicas] == [
        [(0, 0, 256)],
        [(0, 0, 256)],
        [(0, 256, 256)],
        [(0, 256, 256)],
    ]
    same_head = plan_reads(local_tp=4, local_rank=3, remote_tp=2, local_part_len=256, remote_part_len=256, kv_heads=2)
    assert [(s.remote_rank, s.remote, s.local) for s in same_head] == [(1, ViewSpec(), ViewSpec())]
    from_replicas = plan_reads(local_tp=1, local_rank=0, remote_tp=4, local_part_len=512, remote_part_len=256,
                               kv_heads=2)  # fmt: skip
    assert [(s.remote_rank, s.read, s.local.chunk_offset) for s in from_replicas] == [
        (0, True, 0),
        (1, False, 0),
        (2, True, 256),
        (3, False, 0),
    ]
    half = plan_reads(local_tp=2, local_rank=1, remote_tp=4, local_part_len=256, remote_part_len=256, kv_heads=2)
    assert [(s.remote_rank, s.read, s.local) for s in half] == [(2, True, ViewSpec()), (3, False, ViewSpec())]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"local_tp": 3, "local_rank": 0, "remote_tp": 2, "local_part_len": 1, "remote_part_len": 1, "kv_heads": 4},
        {"local_tp": 3, "local_rank": 1, "remote_tp": 2, "local_part_len": 2, "remote_part_len": 3, "kv_heads": 6},
        {"local_tp": 2, "local_rank": 0, "remote_tp": 1, "local_part_len": 512, "remote_part_len": 512, "kv_heads": 4},
        {"local_tp": 2, "local_rank": 2, "remote_tp": 1, "local_part_len": 512, "remote_part_len": 1024, "kv_heads": 4},
        {"local_tp": 4, "local_rank": 0, "remote_tp": 1, "local_part_len": 256, "remote_part_len": 1024, "kv_heads": 2},
        {"local_tp": 3, "local_rank": 0, "remote_tp": 1, "local_part_len": 256, "remote_part_len": 512, "kv_heads": 2},
        {"local_tp": 1, "local_rank": 0, "remote_tp": 2, "local_part_len": 64, "remote_part_len": 32, "kv_heads": 1,
         "mla": True},
    ],
)  # fmt: skip
def test_impossible_placements_are_refused(kwargs):
    with pytest.raises(LayoutError):
        plan_reads(**kwargs)
