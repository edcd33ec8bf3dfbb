"""READ throughput of 256 MiB between two processes, engine against raw NIXL and the ceilings.

For each block size and block order (random permutation, or contiguous ids that NIXL merges):
the engine (`await engine.read`), a raw synchronous NIXL loop over the same prepared
descriptors (one transfer, progress thread off, spin until done), `process_vm_readv` over the
same blocks (the CMA ceiling UCX uses here), and a single-thread numpy copy (memory ceiling).
Engine and raw loop alternate which reads first in each repeat.
"""

from __future__ import annotations

import asyncio
import ctypes
import time

import numpy as np
from tqdm import tqdm

from nixl_async import EngineConfig, TransferEngine
from nixl_async.layout import BlockLayout, pair_descriptor_ids
from nixl_async.testing.peer_process import PeerProcess, PeerSpec

from .common import RawReader, Result

TOTAL = 256 << 20
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
_libc = ctypes.CDLL(None, use_errno=True)
_IOV_MAX = 1024


def _vm_readv(pid: int, local_base: int, remote_base: int, block_len: int, order: np.ndarray) -> None:
    """Copy remote block order[i] into local block i with process_vm_readv, IOV_MAX at a time."""
    n = len(order)
    local = np.empty((n, 2), dtype=np.uint64)
    local[:, 0] = local_base + np.arange(n, dtype=np.uint64) * np.uint64(block_len)
    local[:, 1] = block_len
    remote = np.empty((n, 2), dtype=np.uint64)
    remote[:, 0] = remote_base + order.astype(np.uint64) * np.uint64(block_len)
    remote[:, 1] = block_len
    for i in range(0, n, _IOV_MAX):
        k = min(_IOV_MAX, n - i)
        got = _libc.process_vm_readv(
            pid,
            ctypes.c_void_p(local[i:].ctypes.data),
            ctypes.c_ulong(k),
            ctypes.c_void_p(remote[i:].ctypes.data),
            ctypes.c_ulong(k),
            ctypes.c_ulong(0),
        )
        if got != k * block_len:
            raise OSError(ctypes.get_errno(), f"process_vm_readv copied {got} bytes")


def _best(fn, repeats: int) -> float:
    """Median GB/s of `repeats` runs of fn (which moves TOTAL bytes)."""
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        rates.append(TOTAL / (time.perf_counter() - t) / 1e9)
    return float(np.median(rates))


async def _side_by_side(peer: PeerProcess, region: np.ndarray, block_len: int, order: np.ndarray, repeats: int):
    """Median GB/s of the engine, a raw NIXL loop and process_vm_readv, runs interleaved."""
    blocks = TOTAL // block_len
    layout = BlockLayout.from_regions("kv", [region.ctypes.data], num_blocks=blocks, block_len=block_len)
    raw = RawReader(f"raw-tput-{block_len}", layout, peer.address, progress_thread=False)
    lidx, ridx = pair_descriptor_ids(raw.local_view, np.arange(blocks), raw.remote_layout.view(), order)
    remote_base = raw.remote_layout.region_addrs[0]

    def raw_once() -> None:
        raw.read(lidx, ridx)

    ids = np.arange(blocks)
    rates: dict[str, list[float]] = {"engine": [], "raw": [], "cma": []}
    try:
        async with TransferEngine(EngineConfig(engine_id=f"bench-tput-{block_len}")) as engine:
            # the engine's registration overlaps the raw agent's: they are different agents
            engine.register("kv", [region], block_len=block_len)
            remote = await engine.connect(*peer.address)
            await engine.read(remote, [0], [0])
            raw_once()
            for repeat in range(repeats):
                if repeat % 2:  # every other repeat the raw loop goes first: neither reader always follows the other
                    rates["raw"].append(_best(raw_once, 1))
                t = time.perf_counter()
                await engine.read(remote, ids, order)
                rates["engine"].append(TOTAL / (time.perf_counter() - t) / 1e9)
                if not repeat % 2:
                    rates["raw"].append(_best(raw_once, 1))
                rates["cma"].append(
                    _best(lambda: _vm_readv(peer.pid, region.ctypes.data, remote_base, block_len, order), 1)
                )
    finally:
        raw.close()
    return {k: float(np.median(v)) for k, v in rates.items()}


def run(quick: bool) -> Result:
    repeats = 5 if quick else 11
    region = np.full(TOTAL, 1, dtype=np.uint8)
    scratch = np.full(TOTAL, 2, dtype=np.uint8)
    memcpy = _best(lambda: np.copyto(region, scratch), repeats)
    rows, ratios, metrics = [], {}, {"numpy_memcpy_gbps": memcpy}
    bar = tqdm(total=len(SIZES), desc="throughput", unit="size", disable=None)
    for block_len in SIZES:
        blocks = TOTAL // block_len
        spec = PeerSpec(engine_id=f"bench-tput-peer-{block_len}", num_regions=1, num_blocks=blocks, block_len=block_len)
        orders = {"random": np.random.default_rng(block_len).permutation(blocks), "contiguous": np.arange(blocks)}
        with PeerProcess(spec) as peer:
            for name, order in orders.items():
                got = asyncio.run(_side_by_side(peer, region, block_len, order, repeats))
                engine, raw, cma = got["engine"], got["raw"], got["cma"]
                rows.append([f"{block_len >> 10} KiB {name}", engine, raw, cma, memcpy, engine / raw])
                key = f"{block_len >> 10}k_{name}"
                metrics[f"engine_gbps_{key}"] = engine
                metrics[f"raw_gbps_{key}"] = raw
                metrics[f"vm_readv_gbps_{key}"] = cma
                ratios[f"engine_over_raw_throughput_{key}_higher_is_better"] = engine / raw
        bar.update()
    bar.close()
    return Result(
        "throughput",
        ["blocks", "engine GB/s", "raw NIXL GB/s", "process_vm_readv GB/s", "numpy memcpy GB/s", "engine/raw"],
        rows,
        metrics=metrics,
        ratios=ratios,
        notes=["goal: engine >= 0.95x raw at every block size", "figures vary +-30 % run to run on this machine"],
    )
