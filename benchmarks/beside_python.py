"""Reads beside a busy Python thread: what the engine moves, and what the other thread keeps.

In a vLLM worker the engine's loop thread shares the GIL with the model thread. NIXL gives the
GIL up while it copies (a CMA or cuda_ipc post) and the loop gives it up while it sleeps; getting
it back from a thread that holds it takes up to Python's switch interval (5 ms). Here the other
thread is pure Python (it holds the GIL but for the interpreter's switches), the worst case.

Per transport, 64 MiB reads between two processes, each reader alone and beside the thread:
``engine`` (`TransferEngine`), ``raw`` (NIXL driven directly: one post, then its state checked
without pause or, over TCP, also every 1 ms as ``raw_1ms``). "other thread" is how fast the busy
thread ran while the reads went on, against its speed with the reader's process idle. Over
CMA every post copies inline (so the raw loops are one); over TCP the data is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from .common import BRISK_PEER_POLL_S, TCP, RawReader, Result, busy_python_thread, run_tcp_child

SIZE = 64 << 20
BLOCK = {"cma": 1 << 20, "tcp": 64 << 10}
READERS = {"cma": ["engine", "raw"], "tcp": ["engine", "raw_1ms", "raw"]}


def _idle_speed(seconds: float = 0.3) -> float:
    """Counts per second of the busy thread while this process does nothing else."""
    with busy_python_thread() as count:
        time.sleep(0.05)
        start = count[0]
        time.sleep(seconds)
        return (count[0] - start) / seconds


async def _timed(read: Callable[[], Awaitable[Any]], n: int, beside: bool, idle: float) -> list[tuple[float, float]]:
    """(seconds, the busy thread's share of its idle speed; nan when alone) of `n` reads after one to warm up."""
    out = []
    with busy_python_thread() if beside else contextlib.nullcontext([0]) as count:
        await read()
        for _ in range(n):
            start, t0 = count[0], time.perf_counter()
            await read()
            took = time.perf_counter() - t0
            out.append((took, (count[0] - start) / took / idle if beside else float("nan")))
    return out


async def _measure(transport: str, quick: bool) -> dict[str, list[tuple[float, float]]]:
    """Every reader of `transport`, alone and beside the busy thread, in alternating order."""
    from nixl_async import EngineConfig, TransferEngine
    from nixl_async.layout import BlockLayout
    from nixl_async.testing.peer_process import PeerProcess, PeerSpec

    block = BLOCK[transport]
    blocks = SIZE // block
    rounds, per_round = (2, 3) if quick else (3, 5)
    region = np.ones(SIZE, dtype=np.uint8)
    ids = np.arange(blocks)
    idle = _idle_speed()
    samples: dict[str, list[tuple[float, float]]] = {}
    spec = PeerSpec(
        engine_id=f"beside-python-peer-{transport}",
        num_regions=1,
        num_blocks=blocks,
        block_len=block,
        idle_poll_s=BRISK_PEER_POLL_S if transport == "tcp" else None,
    )
    layout = BlockLayout.from_regions("kv", [region.ctypes.data], num_blocks=blocks, block_len=block)
    with PeerProcess(spec, env=TCP if transport == "tcp" else None) as peer:
        raw = RawReader(f"beside-python-raw-{transport}", layout, peer.address, progress_thread=False)
        try:
            async with TransferEngine(EngineConfig(engine_id=f"beside-python-{transport}")) as engine:
                engine.register("kv", [region], block_len=block)
                remote = await engine.connect(*peer.address)

                async def read_with(reader: str) -> None:
                    if reader == "engine":
                        await engine.read(remote, ids, ids)
                    else:  # the raw loop blocks the event loop: nothing else runs on it meanwhile
                        raw.read(ids, ids, 0.001 if reader == "raw_1ms" else 0.0)

                for round_ in range(rounds):
                    readers = READERS[transport] if round_ % 2 == 0 else READERS[transport][::-1]
                    for reader in readers:
                        for beside in (False, True):
                            got = await _timed(functools.partial(read_with, reader), per_round, beside, idle)
                            samples.setdefault(f"{reader}_{'beside' if beside else 'alone'}", []).extend(got)
        finally:
            raw.close()
    return samples


def _run_measure(transport: str, quick: bool) -> dict[str, list[tuple[float, float]]]:
    """On uvloop where installed, as the sync facade runs the engine in a vLLM worker."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_measure(transport, quick))
    return uvloop.run(_measure(transport, quick))


def run(quick: bool = False) -> Result:
    by_transport = {"cma": _run_measure("cma", quick), "tcp": run_tcp_child("beside_python", quick)}
    rows, metrics, ratios = [], {}, {}
    for transport, samples in by_transport.items():
        figures: dict[str, tuple[float, float]] = {}
        for key, got in samples.items():
            gbps = float(np.median([SIZE / took / 1e9 for took, _ in got]))
            share = float(np.median([s for _, s in got])) * 100 if key.endswith("beside") else float("nan")
            figures[key] = (gbps, share)
            reader, where = key.rsplit("_", 1)
            rows.append([f"{transport} {reader}", where, gbps, share])
            metrics[f"{transport}_{key}_gb_per_s"] = gbps
            if where == "beside":
                metrics[f"{transport}_{key}_other_thread_percent"] = share
        baseline = "raw" if transport == "cma" else "raw_1ms"
        ratios[f"{transport}_engine_over_{baseline}_beside_python_higher_is_better"] = (
            figures["engine_beside"][0] / figures[f"{baseline}_beside"][0]
        )
        ratios[f"{transport}_engine_beside_over_alone_higher_is_better"] = (
            figures["engine_beside"][0] / figures["engine_alone"][0]
        )
    return Result(
        scenario="beside_python",
        columns=["transport, reader", "busy thread", "GB/s", "other thread %"],
        rows=rows,
        metrics=metrics,
        ratios=ratios,
        notes=[
            "64 MiB reads between two processes (CMA: 1 MiB blocks, TCP: 64 KiB); median of every read",
            "busy thread: a thread of pure Python in the reader's process; other thread % = its speed meanwhile,"
            " against its speed with the process idle",
            "raw = one post, state checked without pause; raw_1ms = checked every 1 ms",
        ],
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_run_measure("tcp", sys.argv[2] == "quick")))
