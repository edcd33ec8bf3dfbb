"""The longest stall of other coroutines on the engine's loop during a 256 MiB read.

Over UCX's CMA transport a READ is a synchronous copy inside `transfer()`. A heartbeat
coroutine yields in a loop and records the longest gap between its turns; compared with the
same engine posting the whole read in one slice. One untimed read first brings the memory to
its steady state (the first copy through freshly mapped pages runs several times slower).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from nixl_async import EngineConfig, TransferEngine
from nixl_async.testing.peer_process import PeerProcess, PeerSpec

from .common import Result

BLOCK = 64 << 10
TOTAL = 256 << 20


async def _stall(address: tuple[str, int], config: EngineConfig, repeats: int) -> tuple[float, float]:
    blocks = TOTAL // BLOCK
    region = np.full(TOTAL, 1, dtype=np.uint8)  # fmt: skip
    async with TransferEngine(config) as engine:
        engine.register("kv", [region], block_len=BLOCK)
        peer = await engine.connect(*address)
        order = np.random.default_rng(0).permutation(blocks)
        await engine.read(peer, np.arange(blocks), order)  # steady state: pages touched, rate measured
        worst = 0.0
        running = True

        async def heartbeat() -> None:
            nonlocal worst
            while running:
                t = time.perf_counter()
                await asyncio.sleep(0)
                worst = max(worst, time.perf_counter() - t)

        beat = asyncio.ensure_future(heartbeat())
        await asyncio.sleep(0.01)
        started = time.perf_counter()
        for _ in range(repeats):
            await engine.read(peer, np.arange(blocks), order)
        seconds = time.perf_counter() - started
        running = False
        await beat
    return worst, TOTAL * repeats / seconds / 1e9


def run(quick: bool) -> Result:
    repeats = 4 if quick else 10
    spec = PeerSpec(engine_id="bench-stall-peer", num_regions=1, num_blocks=TOTAL // BLOCK, block_len=BLOCK)
    with PeerProcess(spec) as peer:
        sliced, sliced_gbps = asyncio.run(_stall(peer.address, EngineConfig(engine_id="bench-stall"), repeats))
        one_post = EngineConfig(
            engine_id="bench-stall-one-post", min_post_bytes=TOTAL, max_post_bytes=TOTAL, max_post_descriptors=1 << 20
        )
        whole, whole_gbps = asyncio.run(_stall(peer.address, one_post, repeats))
    rows = [
        ["engine, ~2 ms slices (default)", sliced * 1e3, sliced_gbps],
        ["engine, one 256 MiB post", whole * 1e3, whole_gbps],
    ]
    return Result(
        "stall",
        ["setup", "longest stall ms", "GB/s"],
        rows,
        metrics={"engine_stall_ms": sliced * 1e3, "single_post_stall_ms": whole * 1e3, "engine_gbps": sliced_gbps},
        ratios={"sliced_over_single_post_stall_lower_is_better": sliced / whole if whole else float("nan")},
        notes=["goal: stall <= 5 ms"],
    )
