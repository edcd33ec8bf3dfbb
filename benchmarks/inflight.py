"""10 k transfers in flight at once: the engine's overhead per completion, and its memory.

The peer speaks UCX over TCP so the reads are really in flight. The engine submits 10 k
single-block reads and awaits them all; the raw baseline posts the same 10 k reads on a bare
agent and sweeps `check_xfer_state` over the pending handles until all are done (what a
hand-written or vLLM-style poller does). Overhead = the engine's extra time per completion.
"""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc

import numpy as np

from nixl_async import EngineConfig, TransferEngine
from nixl_async.layout import BlockLayout, pair_descriptor_ids
from nixl_async.testing.peer_process import PeerProcess, PeerSpec

from .common import RawReader, Result

BLOCK = 4096
BLOCKS = 1024


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


async def _engine(address, n: int) -> tuple[float, float, float, float]:
    region = np.full(BLOCKS * BLOCK, 1, dtype=np.uint8)
    config = EngineConfig(engine_id="bench-inflight", max_inflight_transfers=n + 1)
    async with TransferEngine(config) as engine:
        engine.register("kv", [region], block_len=BLOCK)
        peer = await engine.connect(*address)
        await engine.read(peer, [0], [0])
        ids = np.random.default_rng(0).integers(0, BLOCKS, n)
        started = time.perf_counter()
        transfers = [await engine.start_read(peer, [i % BLOCKS], [int(r)]) for i, r in enumerate(ids)]
        await asyncio.gather(*(t.future for t in transfers))
        elapsed = time.perf_counter() - started
        # memory, measured in a second, untimed round (tracemalloc slows Python down)
        del transfers  # the first round's, finished
        gc.collect()
        tracked = len(gc.get_objects())
        tracemalloc.start()
        rss0 = _rss_mib()
        transfers = [await engine.start_read(peer, [i % BLOCKS], [int(r)]) for i, r in enumerate(ids)]
        _, peak = tracemalloc.get_traced_memory()
        rss = _rss_mib() - rss0
        # objects the garbage collector tracks while the transfers are live (the bench's own list aside):
        # its full collections walk them all, so each one costs time at 10 k in flight
        tracked = (len(gc.get_objects()) - tracked - 1) / n
        await asyncio.gather(*(t.future for t in transfers))
        tracemalloc.stop()
    return elapsed, peak / n, rss, tracked


def _raw(address, n: int) -> float:
    region = np.full(BLOCKS * BLOCK, 1, dtype=np.uint8)
    layout = BlockLayout.from_regions("kv", [region.ctypes.data], num_blocks=BLOCKS, block_len=BLOCK)
    raw = RawReader("raw-inflight", layout, address, progress_thread=False)
    try:
        ids = np.random.default_rng(0).integers(0, BLOCKS, n)
        started = time.perf_counter()
        pending = []
        for i, r in enumerate(ids):
            li, ri = pair_descriptor_ids(
                raw.local_view, np.array([i % BLOCKS]), raw.remote_layout.view(), np.array([r])
            )
            handle, state = raw.post(li, ri)
            if state == "PROC":
                pending.append(handle)
            else:
                raw.agent.release_xfer(handle)
        while pending:
            still = []
            for handle in pending:
                if raw.agent.state(handle) == "PROC":
                    still.append(handle)
                else:
                    raw.agent.release_xfer(handle)
            pending = still
        return time.perf_counter() - started
    finally:
        raw.close()


def run(quick: bool) -> Result:
    n = 10_000
    spec = PeerSpec(engine_id="bench-inflight-peer", num_regions=1, num_blocks=BLOCKS, block_len=BLOCK)
    with PeerProcess(spec, env={"UCX_TLS": "tcp"}) as peer:
        engine_s, bytes_per, rss, tracked = asyncio.run(_engine(peer.address, n))
        raw_s = _raw(peer.address, n)
    overhead_us = (engine_s - raw_s) / n * 1e6
    rows = [
        ["engine", engine_s * 1e3, engine_s / n * 1e6, bytes_per, tracked, rss],
        ["raw post + sweep", raw_s * 1e3, raw_s / n * 1e6, float("nan"), float("nan"), float("nan")],
    ]
    return Result(
        "inflight",
        [
            "setup",
            "10k reads ms",
            "us per completion",
            "Python bytes per transfer",
            "GC objects per transfer",
            "RSS growth MiB",
        ],
        rows,
        metrics={
            "engine_ms": engine_s * 1e3,
            "raw_ms": raw_s * 1e3,
            "engine_overhead_us_per_completion": overhead_us,
            "python_bytes_per_transfer": bytes_per,
            "gc_tracked_objects_per_transfer": tracked,
            "rss_growth_mib": rss,
        },
        ratios={"engine_over_raw_time_lower_is_better": engine_s / raw_s},
        notes=["goal: <= 10 us of engine overhead per completion at 10 k in flight"],
    )
