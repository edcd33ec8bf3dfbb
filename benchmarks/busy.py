"""CPU per byte in flight: reads over UCX/TCP between two processes, where bytes really are in flight.

Over CMA a READ is a copy inside `transfer()`; over TCP it is in flight for milliseconds, and
whatever the reader's poller does meanwhile is paid by the server it runs in. Four readers, side
by side, alternating, on the same peer process (64 KiB blocks):

- ``engine``: `TransferEngine` as shipped (checks every ~1 ms until a transfer may end);
- ``engine_spin``: the same with ``PollConfig(busy_interval_s=0)``, the previous poller that
  checked on every loop iteration while anything was in flight;
- ``raw_1ms``: NIXL driven directly, one post, state checked every 1 ms (the goal's baseline);
- ``raw_hot``: the same checking without pause (sees completion first; the latency reference);
- ``engine_ucx_segments``: the engine on UCX's own 64 KiB TCP segments
  (``EngineConfig(tcp_segment_bytes=None)``), reading from a second peer process on them too:
  what the engine's 512 KiB segments (which the others use) gain.

CPU is this process's (all threads, UCX's included), per GB moved. Completion: how long after
NIXL's DONE the awaiting coroutine resumes, for the engine's reads, estimated as the `latency`
scenario does (from the middle of the last check that saw the read in flight and the one that saw
it done), the figure the issue bounds beside the CPU. The hot loop is no latency reference here:
on 2 cores it slows the transfer it watches (it takes the CPU the kernel and the peer need). The
table also gives each reader's p50 time per read. The measurement runs in a child process with
``UCX_TLS=tcp`` so no other scenario's agents are affected.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import msgspec
import numpy as np

from .common import BRISK_PEER_POLL_S, TCP, Result, percentiles, run_tcp_child

BLOCK = 64 << 10
SIZES = [4 << 20, 32 << 20, 192 << 20]
SETUPS = ["engine", "engine_spin", "raw_1ms", "raw_hot", "engine_ucx_segments"]


def _raw_reads(address: tuple[str, int], region: np.ndarray, blocks: int, sleep_s: float, n: int) -> list[tuple]:
    from nixl_async.layout import BlockLayout

    from .common import RawReader

    layout = BlockLayout.from_regions("kv", [region.ctypes.data], num_blocks=region.nbytes // BLOCK, block_len=BLOCK)
    raw = RawReader("busy-raw", layout, address, progress_thread=False)
    ids = np.arange(blocks)
    out = []
    try:
        for _ in range(n):
            cpu0, t0 = time.process_time(), time.perf_counter()
            raw.read(ids, ids, sleep_s)
            out.append((time.perf_counter() - t0, time.process_time() - cpu0, None))
    finally:
        raw.close()
    return out


async def _engine_reads(address: tuple[str, int], region: np.ndarray, blocks: int, setup: str, n: int) -> list[tuple]:
    from nixl_async import EngineConfig, PollConfig, TransferEngine

    poll = PollConfig(busy_interval_s=0.0) if setup == "engine_spin" else PollConfig()
    config = EngineConfig(engine_id=f"busy-{setup}", poll=poll)
    if setup == "engine_ucx_segments":
        config = config.replace(tcp_segment_bytes=None)
    out = []
    async with TransferEngine(config) as engine:
        engine.register("kv", [region], block_len=BLOCK)
        peer = await engine.connect(*address)
        ids = np.arange(blocks)
        for _ in range(n):
            cpu0, t0 = time.process_time(), time.perf_counter()
            transfer = await engine.start_read(peer, ids, ids)
            await transfer
            resumed = time.perf_counter()
            pending = transfer.last_pending_at or transfer.first_post_at  # (as the raw loop: from its post if no
            seen = (pending + transfer.done_seen_at) / 2 if pending else None  # check saw it in flight)
            out.append((resumed - t0, time.process_time() - cpu0, None if seen is None else resumed - seen))
    return out


def _child(quick: bool) -> dict[str, Any]:
    from nixl_async.testing.peer_process import PeerProcess, PeerSpec

    rounds, per_round = (2, 3) if quick else (4, 5)
    region = np.ones(max(SIZES), dtype=np.uint8)
    samples: dict[str, dict[int, list[tuple]]] = {s: {size: [] for size in SIZES} for s in SETUPS}
    spec = PeerSpec(
        engine_id="busy-peer",
        num_regions=1,
        num_blocks=max(SIZES) // BLOCK,
        block_len=BLOCK,
        idle_poll_s=BRISK_PEER_POLL_S,
    )
    ucx_spec = msgspec.structs.replace(spec, engine_id="busy-peer-ucx-segments", tcp_segment_bytes=None)
    with PeerProcess(spec, env=TCP) as ours, PeerProcess(ucx_spec, env=TCP) as ucx_segments:
        for round_ in range(rounds):
            order = SETUPS if round_ % 2 == 0 else SETUPS[::-1]  # alternate who goes first
            for setup in order:
                for size in SIZES:
                    blocks = size // BLOCK
                    address = (ucx_segments if setup == "engine_ucx_segments" else ours).address
                    if setup.startswith("engine"):
                        got = asyncio.run(_engine_reads(address, region, blocks, setup, per_round + 1))
                    else:
                        got = _raw_reads(address, region, blocks, 0.001 if setup == "raw_1ms" else 0.0, per_round + 1)
                    samples[setup][size] += got[1:]  # the first read of each batch warms up
    return {s: {str(size): v for size, v in by_size.items()} for s, by_size in samples.items()}


def run(quick: bool = False) -> Result:
    samples = run_tcp_child("busy", quick)
    rows, metrics, ratios = [], {}, {}
    completions: list[float] = []  # the engine's, every size
    for size in SIZES:
        stats = {}
        for setup in SETUPS:
            got = samples[setup][str(size)]
            wall = [w for w, _, _ in got]
            cpu_per_gb = float(np.median([c / (size / 1e9) for _, c, _ in got]))
            gbps = float(np.median([size / w / 1e9 for w in wall]))
            (p50,) = percentiles([w * 1e3 for w in wall], 50)
            stats[setup] = (cpu_per_gb, gbps, p50)
            rows.append([f"{size >> 20} MiB {setup}", cpu_per_gb, gbps, p50])
            key = f"{size >> 20}mib_{setup}"
            metrics.update({f"{key}_cpu_seconds_per_gb": cpu_per_gb, f"{key}_gb_per_s": gbps, f"{key}_ms_p50": p50})
            if setup == "engine":
                seen = [c * 1e6 for _, _, c in got if c is not None]
                completions += seen
                metrics[f"{key}_completion_p50_us"] = percentiles(seen, 50)[0] if seen else float("nan")
        ratios[f"engine_over_raw_cpu_seconds_per_gb_{size >> 20}mib_lower_is_better"] = (
            stats["engine"][0] / stats["raw_1ms"][0]
        )
        gbps_ratio = stats["engine"][1] / stats["raw_1ms"][1]
        ratios[f"engine_over_raw_throughput_{size >> 20}mib_higher_is_better"] = gbps_ratio
        segments = stats["engine"], stats["engine_ucx_segments"]
        ratios[f"segments_512k_over_64k_cpu_seconds_per_gb_{size >> 20}mib_lower_is_better"] = (
            segments[0][0] / segments[1][0]
        )
        ratios[f"segments_512k_over_64k_throughput_{size >> 20}mib_higher_is_better"] = segments[0][1] / segments[1][1]
    metrics["completion_p50_us"] = percentiles(completions, 50)[0] if completions else float("nan")
    largest = max(SIZES) >> 20
    ratios["engine_over_raw_cpu_seconds_per_gb_lower_is_better"] = ratios[
        f"engine_over_raw_cpu_seconds_per_gb_{largest}mib_lower_is_better"
    ]
    return Result(
        scenario="busy",
        columns=["read, reader", "CPU s per GB", "GB/s", "ms p50"],
        rows=rows,
        metrics=metrics,
        ratios=ratios,
        notes=[
            "UCX over TCP between two processes on loopback; CPU is the reader process's (all threads)",
            "raw_1ms = NIXL driven directly, one post, state checked every 1 ms; raw_hot = checked without pause",
            "completion_p50_us: the engine's reads, DONE -> awaiting coroutine resumed (as in `latency`), every size",
            "all but engine_ucx_segments move data in the engine's 512 KiB UCX/TCP segments (the raw loops too: their"
            " peer requires it); engine_ucx_segments = the engine and its own peer on UCX's 64 KiB",
        ],
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_child(sys.argv[2] == "quick")))
