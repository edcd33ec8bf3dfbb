"""Building and preparing descriptors for 1 M blocks x 2 regions.

The engine builds descriptor arrays with numpy and prepares a view from one strided row per
region; the seed worker builds a Python list of (addr, len, device) tuples, one per block, and
hands it to NIXL. Both are timed to a prepared local descriptor list, and on their own.
"""

from __future__ import annotations

import time

import numpy as np

from nixl_async._agent import OwnedAgent
from nixl_async.layout import BlockLayout

from .common import Result

BLOCKS = 1 << 20
BLOCK_LEN = 16  # small blocks keep the registered memory small; descriptor counts are what matter


def _per_block_tuples(layout: BlockLayout) -> list[tuple[int, int, int]]:
    out = []
    for base in layout.region_addrs:
        for block_id in range(layout.num_blocks):
            out.append((base + block_id * layout.block_len, layout.block_len, layout.device_id))
    return out


def _timed(fn, repeats: int) -> tuple[float, object]:
    best, value = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t)
    return best, value


def run(quick: bool) -> Result:
    repeats = 2 if quick else 5
    regions = [np.zeros(BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in range(2)]
    layout = BlockLayout.from_regions("kv", [r.ctypes.data for r in regions], num_blocks=BLOCKS, block_len=BLOCK_LEN)
    agent = OwnedAgent("bench-descriptors", ("UCX",), {})
    memory = agent.register(layout.region_descriptors(), layout.mem_type)
    try:
        build_np, _ = _timed(lambda: layout.view().descriptors(), repeats)
        build_list, tuples = _timed(lambda: _per_block_tuples(layout), repeats)

        def prep_engine() -> None:
            agent.release_dlist(agent.prep_view("", layout.view()))

        def prep_list() -> None:
            handle = agent._agent.prep_xfer_dlist("", _per_block_tuples(layout), "DRAM")
            agent._agent.release_dlist_handle(handle)

        prep_np, _ = _timed(prep_engine, repeats)
        prep_tuples, _ = _timed(prep_list, repeats)
        del tuples
    finally:
        agent.deregister(memory)
    rows = [
        ["build descriptors (2 M rows)", build_np * 1e3, build_list * 1e3, build_list / build_np],
        ["build + prepare local list", prep_np * 1e3, prep_tuples * 1e3, prep_tuples / prep_np],
    ]
    return Result(
        "descriptors",
        ["step", "engine ms", "per-block tuples ms", "speed-up"],
        rows,
        metrics={
            "engine_build_ms": build_np * 1e3,
            "tuples_build_ms": build_list * 1e3,
            "engine_prep_ms": prep_np * 1e3,
            "tuples_prep_ms": prep_tuples * 1e3,
        },
        ratios={
            "tuples_over_engine_build_time_higher_is_better": build_list / build_np,
            "tuples_over_engine_prep_time_higher_is_better": prep_tuples / prep_np,
        },
        notes=["goal: >= 20x faster"],
    )
