"""READ throughput over UCX/TCP between two processes, engine against raw NIXL loops, side by side.

Over TCP a post returns before its data moves, so the engine's slicing and the way it watches
transfers in flight decide its throughput (over CMA each post is the copy itself). For each
block size and block order (a random permutation, or contiguous ids), 128 MiB is read from a
fresh peer process by four readers taking turns, whoever went first last goes last next:

- ``engine``: `await engine.read(...)` on one engine kept across the runs (it learns the wire);
- ``engine_inline_sizing``: the same with ``slice_flight_s=None``: every slice sized as if
  posts copied inline, as the engine did before it learned each peer's wire;
- ``raw_1ms``: NIXL driven directly, one post of the same descriptors, state checked every 1 ms;
- ``raw_hot``: the same checking without pause.

The ratio divides by the faster raw loop (on 2 cores the hot one often loses: it takes the CPU
the kernel's TCP stack and the peer need). Runs in a child process with ``UCX_TLS=tcp``.
Each order gets its own peer: after many 4 KiB reads a peer's UCX/TCP endpoint slows every
reader that follows (seen with raw loops too), which would bias whichever order runs second.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import numpy as np

from .common import BRISK_PEER_POLL_S, TCP, RawReader, Result, run_tcp_child

TOTAL = 128 << 20
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
ORDERS = ["random", "contiguous"]
SETUPS = ["engine", "engine_inline_sizing", "raw_1ms", "raw_hot"]
QUICK, FULL = (2, 2), (4, 3)  # (rounds, reads per reader and round)


async def _one_order(address: tuple[str, int], region: np.ndarray, block_len: int, order: np.ndarray,
                     rounds: int, per_round: int) -> dict[str, list[float]]:  # fmt: skip
    """GB/s of each reader, reading every block from the peer's block `order[i]`."""
    from nixl_async import EngineConfig, TransferEngine
    from nixl_async.layout import BlockLayout, pair_descriptor_ids

    blocks = TOTAL // block_len
    ids = np.arange(blocks)
    layout = BlockLayout.from_regions("kv", [region.ctypes.data], num_blocks=blocks, block_len=block_len)
    raw = RawReader(f"raw-tcp-{block_len}", layout, address, progress_thread=False)
    lidx, ridx = pair_descriptor_ids(raw.local_view, ids, raw.remote_layout.view(), order)
    samples: dict[str, list[float]] = {s: [] for s in SETUPS}
    try:
        async with (
            TransferEngine(EngineConfig()) as engine,
            TransferEngine(EngineConfig(slice_flight_s=None)) as inline_sized,
        ):
            peers = {}
            for name, eng in (("engine", engine), ("engine_inline_sizing", inline_sized)):
                eng.register("kv", [region], block_len=block_len)
                peers[name] = (eng, await eng.connect(*address))
                await eng.read(peers[name][1], ids, order)  # the first read teaches it the wire
            raw.read(lidx, ridx)
            for round_ in range(rounds):
                for setup in SETUPS if round_ % 2 == 0 else SETUPS[::-1]:
                    for _ in range(per_round):
                        t0 = time.perf_counter()
                        if setup in peers:
                            eng, peer = peers[setup]
                            await eng.read(peer, ids, order)
                        else:
                            raw.read(lidx, ridx, 0.001 if setup == "raw_1ms" else 0.0)
                        samples[setup].append(TOTAL / (time.perf_counter() - t0) / 1e9)
    finally:
        raw.close()
    return samples


def _child(quick: bool) -> dict[str, dict]:
    from nixl_async.testing.peer_process import PeerProcess, PeerSpec

    rounds, per_round = QUICK if quick else FULL
    region = np.ones(TOTAL, dtype=np.uint8)
    out: dict[str, dict] = {}
    for block_len in SIZES:
        blocks = TOTAL // block_len
        orders = {"random": np.random.default_rng(block_len).permutation(blocks), "contiguous": np.arange(blocks)}
        out[str(block_len)] = {}
        for name, order in orders.items():
            spec = PeerSpec(engine_id=f"tcp-tput-peer-{block_len}-{name}", num_regions=1, num_blocks=blocks,
                            block_len=block_len, idle_poll_s=BRISK_PEER_POLL_S)  # fmt: skip
            with PeerProcess(spec, env=TCP) as peer:
                got = asyncio.run(_one_order(peer.address, region, block_len, order, rounds, per_round))
            out[str(block_len)][name] = got
    return out


def _round_ratios(got: dict[str, list[float]], per_round: int) -> list[float]:
    """Engine ÷ the faster raw loop within each round (medians of its reads): drift between rounds cancels."""
    rounds = {s: np.median(np.reshape(got[s], (-1, per_round)), axis=1) for s in ("engine", "raw_1ms", "raw_hot")}
    return [float(r) for r in rounds["engine"] / np.maximum(rounds["raw_1ms"], rounds["raw_hot"])]


def run(quick: bool = False) -> Result:
    samples = run_tcp_child("throughput_tcp", quick)
    rows, metrics, ratios = [], {}, {}
    reads_per_round = (QUICK if quick else FULL)[1]
    for block_len in SIZES:
        for order in ORDERS:
            got = samples[str(block_len)][order]
            gbps = {s: float(np.median(got[s])) for s in SETUPS}
            raw = max(gbps["raw_1ms"], gbps["raw_hot"])
            key = f"{block_len >> 10}k_{order}"
            per_round = _round_ratios(got, reads_per_round)
            rows.append([f"{block_len >> 10} KiB {order}", gbps["engine"], gbps["engine_inline_sizing"],
                         gbps["raw_1ms"], gbps["raw_hot"], gbps["engine"] / raw,
                         f"{min(per_round):.2f}-{max(per_round):.2f}"])  # fmt: skip
            metrics.update({f"{setup}_gbps_{key}": v for setup, v in gbps.items()})
            metrics[f"engine_over_raw_per_round_min_{key}"] = min(per_round)
            metrics[f"engine_over_raw_per_round_max_{key}"] = max(per_round)
            ratios[f"engine_over_raw_throughput_{key}_higher_is_better"] = gbps["engine"] / raw
    return Result(
        "throughput_tcp",
        [
            "blocks",
            "engine GB/s",
            "inline-sized GB/s",
            "raw 1 ms GB/s",
            "raw hot GB/s",
            "engine/faster raw",
            "per round",
        ],
        rows,
        metrics=metrics,
        ratios=ratios,
        notes=[
            "UCX over TCP between two processes on loopback, 128 MiB per read, medians of alternating runs",
            "goal: engine >= 0.95x the faster raw loop at every block size",
            "per round: the same ratio within each round (its readers ran back to back): a size is clearly under"
            " the goal only if every round is",
        ],
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_child(sys.argv[2] == "quick")))
