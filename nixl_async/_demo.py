"""`nixl-async demo`: a decode-side engine pulling a prefill peer's KV blocks, verified.

A peer process exposes a KV-cache-shaped set of blocks (layers x K/V regions, pattern-filled);
this process connects through the handshake and reads them request by request (each request
a random set of blocks, several requests in flight) through the awaitable API, then checks
every byte against the pattern and reports throughput, request latency and CPU use.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .config import EngineConfig
from .engine import TransferEngine
from .stats import LatencyHistogram
from .testing.patterns import verify_blocks
from .testing.peer_process import PeerProcess, PeerSpec


@dataclass
class DemoReport:
    layers: int
    regions: int
    num_blocks: int
    block_len: int
    requests: int
    bytes_moved: int
    seconds: float
    throughput_gbps: float
    request_latency_p50_us: float
    request_latency_p99_us: float
    completion_latency_p50_us: float
    completion_latency_p99_us: float
    cpu_percent: float
    peer_cpu_percent: float
    handshake_ms: float
    verified: bool


def _cpu_seconds(pid: int) -> float:
    """User+system CPU seconds of a process (all threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_demo(*, quick: bool, concurrency: int = 8, blocks_per_request: int = 16) -> DemoReport:
    layers = 4 if quick else 8
    block_len = 64 << 10  # a 128-token block of a small model's layer half
    num_blocks = 128 if quick else 512
    regions = 2 * layers  # K and V per layer
    seed = 2026
    spec = PeerSpec(
        engine_id="demo-prefill", num_regions=regions, num_blocks=num_blocks, block_len=block_len, seed=seed
    )
    local = [
        np.full(num_blocks * block_len, 0xEE, dtype=np.uint8) for _ in range(regions)
    ]  # resident, like a real cache
    rng = np.random.default_rng(seed)
    passes = 4 if quick else 8
    latency = LatencyHistogram()
    completion = LatencyHistogram()  # NIXL reported DONE -> the awaiting coroutine runs
    verified = True
    seconds = cpu = peer_cpu = 0.0
    moved = 0
    with PeerProcess(spec) as peer:
        async with TransferEngine(EngineConfig(engine_id="demo-decode")) as engine:
            engine.register("kv", local, block_len=block_len)
            started = time.perf_counter()
            remote = await engine.connect(*peer.address, expected_engine_id=spec.engine_id)
            handshake_ms = (time.perf_counter() - started) * 1e3
            await engine.read(remote, [0], [0])  # UCX wire-up, not timed
            gate = asyncio.Semaphore(concurrency)
            bar = tqdm(total=passes * num_blocks * regions * block_len, unit="B", unit_scale=True,
                       desc="reading KV blocks", disable=None)  # fmt: skip

            async def one(local_ids: np.ndarray, remote_ids: np.ndarray) -> None:
                async with gate:
                    t = time.perf_counter()
                    transfer = await engine.start_read(remote, local_ids, remote_ids, notify=b"demo-done")
                    result = await transfer
                    resumed = time.perf_counter()
                    latency.record(resumed - t)
                    completion.record(resumed - transfer.done_seen_at)
                    bar.update(result.nbytes)

            for _ in range(passes):
                order = rng.permutation(num_blocks)  # remote block order[i] lands in local block i
                requests = [
                    (np.arange(i, min(i + blocks_per_request, num_blocks)), order[i : i + blocks_per_request])
                    for i in range(0, num_blocks, blocks_per_request)
                ]
                cpu0, peer_cpu0, t0 = time.process_time(), _cpu_seconds(peer.pid), time.perf_counter()
                await asyncio.gather(*(one(lids, rids) for lids, rids in requests))
                seconds += time.perf_counter() - t0
                cpu += time.process_time() - cpu0
                peer_cpu += _cpu_seconds(peer.pid) - peer_cpu0
                moved += num_blocks * regions * block_len
                verified &= verify_blocks(local, block_len, range(num_blocks), order, seed) == []
                for region in local:
                    region.fill(0xEE)  # so the next pass cannot pass on stale bytes
            bar.close()
    return DemoReport(
        layers=layers,
        regions=regions,
        num_blocks=num_blocks,
        block_len=block_len,
        requests=passes * len(requests),
        bytes_moved=moved,
        seconds=seconds,
        throughput_gbps=moved / seconds / 1e9,
        request_latency_p50_us=latency.percentile(0.5),
        request_latency_p99_us=latency.percentile(0.99),
        completion_latency_p50_us=completion.percentile(0.5),
        completion_latency_p99_us=completion.percentile(0.99),
        cpu_percent=cpu / seconds * 100,
        peer_cpu_percent=peer_cpu / seconds * 100,
        handshake_ms=handshake_ms,
        verified=verified,
    )


def main(*, quick: bool, json_path: str | None, concurrency: int = 8) -> int:
    try:
        import uvloop

        report = uvloop.run(run_demo(quick=quick, concurrency=concurrency))
    except ImportError:  # pragma: no cover
        report = asyncio.run(run_demo(quick=quick, concurrency=concurrency))
    print(
        f"\nRead {report.bytes_moved / 2**20:.0f} MiB in {report.requests} requests "
        f"({report.layers} layers x K/V, {report.num_blocks} blocks of {report.block_len >> 10} KiB) "
        f"from a peer process over NIXL/UCX\n"
        f"  throughput        {report.throughput_gbps:.2f} GB/s\n"
        f"  request latency   p50 {report.request_latency_p50_us / 1e3:.2f} ms, "
        f"p99 {report.request_latency_p99_us / 1e3:.2f} ms (submit -> done, {concurrency} in flight)\n"
        f"  completion        p50 {report.completion_latency_p50_us:.0f} us, "
        f"p99 {report.completion_latency_p99_us:.0f} us (NIXL says DONE -> the awaiting coroutine runs)\n"
        f"  CPU               this process {report.cpu_percent:.0f} %, peer {report.peer_cpu_percent:.0f} % of a core\n"
        f"  handshake         {report.handshake_ms:.1f} ms\n"
        f"  every byte verified: {'yes' if report.verified else 'NO'}"
    )
    if json_path:
        Path(json_path).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return 0 if report.verified else 1
