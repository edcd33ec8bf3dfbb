"""Soak: many transfers over 4 peers with random cancellations and deadlines.

Every completed read is verified byte for byte. Cancelled and deadline-bound reads go into the
very blocks later reads verify: blocks return to the pool (last in, first out, so the next read
reuses them at once) as soon as the error reaches the caller, which is the engine's contract --
a late write from a cancelled read would show up as a corrupt verified block. A read reported
`TransferFenced` keeps its blocks out of the pool until it is quiet. RSS and live
NIXL handles are sampled every 2 k transfers and must stay flat (slope reported per 10 k). CI runs 20 k transfers; set
NIXL_ASYNC_SOAK_TRANSFERS=100000 (or more) for the long soak.
"""

import asyncio
import contextlib
import os
import time

import numpy as np

from nixl_async import TransferCancelled, TransferFenced, TransferTimeout
from nixl_async.testing import transfers_settled, verify_blocks

TRANSFERS = int(os.environ.get("NIXL_ASYNC_SOAK_TRANSFERS", "20000"))
BATCH = 2_000  # sample every BATCH transfers; the first two samples are warm-up
BLOCK, REMOTE_BLOCKS, LOCAL_BLOCKS, SCRATCH_BLOCKS = 4096, 256, 1024, 256
CONCURRENCY = 64


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


async def test_soak_over_four_peers(nixl_engine, nixl_peer_factory):
    peers_procs = [
        nixl_peer_factory(num_regions=2, num_blocks=REMOTE_BLOCKS, block_len=BLOCK, seed=10 + i, tcp=i >= 2)
        for i in range(4)
    ]
    kv = [np.zeros(LOCAL_BLOCKS * BLOCK, np.uint8) + 1 for _ in range(2)]
    nixl_engine.register("kv", kv, block_len=BLOCK)
    peers = [await nixl_engine.connect(*p.address) for p in peers_procs]
    seeds = {p.engine_id: p.spec.seed for p in peers_procs}
    free = list(range(LOCAL_BLOCKS))
    gate = asyncio.Semaphore(CONCURRENCY)
    rng = np.random.default_rng(2026)
    outcome = {"verified": 0, "cancelled": 0, "timed_out": 0, "fenced": 0, "bad": 0}

    async def one() -> None:
        peer = peers[int(rng.integers(len(peers)))]
        n = int(rng.integers(1, 5))
        remote = rng.choice(REMOTE_BLOCKS, n, replace=False).tolist()
        roll = rng.random()
        async with gate:
            local = [free.pop() for _ in range(n)]
            try:
                if roll < 0.1:  # cancelled right after submit
                    transfer = await nixl_engine.start_read(peer, local, remote)
                    if transfer.cancel():
                        outcome["cancelled"] += 1
                    with contextlib.suppress(TransferCancelled):
                        await transfer
                elif roll < 0.2:  # a deadline that may or may not be met
                    try:
                        await nixl_engine.read(peer, local, remote, timeout=float(rng.uniform(0, 0.002)))
                    except TransferTimeout:
                        outcome["timed_out"] += 1
                else:
                    await nixl_engine.read(peer, local, remote)
                    if verify_blocks(kv, BLOCK, local, remote, seeds[peer.engine_id]):
                        outcome["bad"] += 1
                    else:
                        outcome["verified"] += 1
            except TransferFenced as fenced:
                outcome["fenced"] += 1
                assert fenced.quiet is not None
                await fenced.quiet(None)  # only then may the blocks go back
            finally:
                free.extend(local)

    samples = []
    started = time.perf_counter()
    for done in range(0, TRANSFERS, BATCH):
        await asyncio.gather(*(one() for _ in range(min(BATCH, TRANSFERS - done))))
        samples.append((_rss_mib(), await transfers_settled(nixl_engine, timeout=2.0)))
    elapsed = time.perf_counter() - started

    rss = [s[0] for s in samples[2:]]
    slope = float(np.polyfit(range(len(rss)), rss, 1)[0]) * (10_000 / BATCH) if len(rss) > 2 else 0.0
    live = [s[1] for s in samples]
    print(f"\nsoak: {TRANSFERS} transfers in {elapsed:.1f} s, {outcome}; RSS after warm-up {rss[0]:.1f} -> "
          f"{rss[-1]:.1f} MiB, slope {slope:+.2f} MiB per 10k; live xfers per sample {live}")  # fmt: skip
    assert outcome["bad"] == 0
    assert outcome["verified"] > TRANSFERS * 0.7 and outcome["cancelled"] > 0
    assert all(s[1] == 0 for s in samples), "NIXL transfer handles leaked"
    assert slope < 2.0, f"RSS grows {slope:.2f} MiB per 10k transfers"
    counters = nixl_engine.snapshot().counters
    assert counters.get("transfers_failures", 0) == 0


async def test_soak_batches_over_tcp(nixl_engine, nixl_peer_factory):
    """Batches of single-block rows over UCX/TCP (really in flight), 10 % cancelled at once and 10 % with deadlines
    of a few ms, their blocks back in the LIFO pool as soon as the error reaches the caller: a row landing late would
    corrupt a block a later batch verifies."""
    procs = [nixl_peer_factory(num_regions=2, num_blocks=REMOTE_BLOCKS, block_len=BLOCK, seed=20 + i, tcp=True)
             for i in range(2)]  # fmt: skip
    kv = [np.zeros(LOCAL_BLOCKS * BLOCK, np.uint8) + 1 for _ in range(2)]
    nixl_engine.register("kv", kv, block_len=BLOCK)
    peers = [await nixl_engine.connect(*p.address) for p in procs]
    seeds = {p.engine_id: p.spec.seed for p in procs}
    free = list(range(LOCAL_BLOCKS))
    gate = asyncio.Semaphore(8)
    rng = np.random.default_rng(7)
    outcome = {"verified_rows": 0, "cancelled": 0, "timed_out": 0, "fenced": 0, "bad": 0}

    async def one() -> None:
        peer = peers[int(rng.integers(len(peers)))]
        rows = int(rng.integers(16, 96))
        remote = rng.choice(REMOTE_BLOCKS, rows, replace=False)
        roll = rng.random()
        async with gate:
            local = [free.pop() for _ in range(rows)]
            try:
                timeout = float(rng.uniform(0.001, 0.005)) if 0.1 <= roll < 0.2 else None
                batch = await nixl_engine.start_read_batch(peer, np.array(local)[:, None], remote[:, None],
                                                           timeout=timeout)  # fmt: skip
                if roll < 0.1 and batch.cancel():
                    outcome["cancelled"] += 1
                try:
                    await batch
                except (TransferCancelled, TransferTimeout):
                    outcome["timed_out"] += timeout is not None
                    return
                if verify_blocks(kv, BLOCK, local, remote.tolist(), seeds[peer.engine_id]):
                    outcome["bad"] += 1
                else:
                    outcome["verified_rows"] += rows
            except TransferFenced as fenced:
                outcome["fenced"] += 1
                assert fenced.quiet is not None
                await fenced.quiet(None)  # only then may the blocks go back
            finally:
                free.extend(local)

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(300)))
    elapsed = time.perf_counter() - started
    print(f"\nbatch soak: 300 batches in {elapsed:.1f} s, {outcome}")
    assert outcome["bad"] == 0
    assert outcome["cancelled"] > 0 and outcome["verified_rows"] > 300 * 16 * 0.7
    assert await transfers_settled(nixl_engine, timeout=5.0) == 0
    counters = nixl_engine.snapshot().counters
    assert counters.get("transfers_failures", 0) == 0
    assert counters["inflight_transfers"] == 0 and counters["inflight_bytes"] == 0
