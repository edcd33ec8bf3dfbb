"""Request-sized READs whose block ids come from vLLM's own block pools, over UCX/TCP between two processes.

NIXL merges neighbouring descriptors of a transfer into one copy where they are neighbours in its
prepared lists too and both sides' bytes run on: only in ascending order. vLLM's pool hands a
finished request's blocks back last first, so a later request often holds runs in descending order.
The engine orders each transfer's block pairs by local block, so a run that descends on both servers
is one copy; vLLM's connector posts the blocks in the order the scheduler gives them. How often both
servers' runs line up is up to their traffic, so the ids come from two real vLLM `BlockPool`s, one
per server, driven by one of these patterns:

- ``sequential``: one request at a time, nothing generated past the prompt's last block: both
  pools see the same history (a benchmark at concurrency 1); prefix caching off, so a freed
  request's blocks go back to the front of the queue, last first;
- ``sequential_cached``: the same with prefix caching on (vLLM's default): a freed request's full
  blocks carry a hash (a stand-in) and queue at the back, last first, its last block at the front;
- ``steady``: prefill holds 4 requests, decode runs 16, each of them taking a new block now and
  then as it generates: the pools drift apart and few runs line up (prefix caching off).

Each pattern reads from a fresh peer (4 regions, as layers are), each request's blocks by three
readers in turn: ``engine`` (`await engine.read`), ``raw_vllm_order`` (NIXL driven directly, one post in the
scheduler's order, state checked without pause) and ``raw_sorted`` (the same with the engine's
order). Reported: descriptors per read as NIXL posts them (runs counted from the ids; the engine may
cut a read into slices, each merged alone, so its count is a floor), read time and the reading
thread's CPU per read. Runs in a child process with ``UCX_TLS=tcp``.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from typing import Any

import numpy as np

from .common import BRISK_PEER_POLL_S, TCP, RawReader, Result, run_tcp_child

BLOCKS, BLOCK_LEN, REGIONS = 1024, 16 << 10, 4
PATTERNS = ["sequential", "sequential_cached", "steady"]
SETUPS = ["engine", "raw_vllm_order", "raw_sorted"]
QUICK, FULL = 60, 240  # requests per pattern
WARM_UP = 40  # requests before any is read: the pools leave their first, fresh order
WARM_UP_CACHED = 120  # with prefix caching freed blocks queue behind the fresh ones: a whole round of the pool


def vllm_block_ids(pattern: str, requests: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """(decode's block ids, prefill's) of each request, as two vLLM block pools hand them out."""
    from vllm.v1.core.block_pool import BlockPool

    rng = random.Random(seed)
    cached = pattern.endswith("_cached")
    prefill, decode = (BlockPool(BLOCKS, enable_caching=cached, hash_block_size=16) for _ in range(2))
    p_held: list[list] = []
    d_held: list[list] = []
    out = []
    sequential = pattern.startswith("sequential")
    p_limit, d_limit, grows = (1, 1, 0.0) if sequential else (4, 16, 0.3)
    warm_up = WARM_UP_CACHED if cached else WARM_UP
    for _ in range(warm_up + requests):
        n = rng.randint(4, 32)
        p_blocks, d_blocks = _allocate(prefill, n), _allocate(decode, n)
        out.append(([b.block_id for b in d_blocks], [b.block_id for b in p_blocks]))
        for held, pool, limit, blocks in ((p_held, prefill, p_limit, p_blocks), (d_held, decode, d_limit, d_blocks)):
            for running in held:
                if rng.random() < grows:
                    running += _allocate(pool, 1)
            held.append(blocks)
            while len(held) > limit:  # one finishes (the oldest, or one at random)
                _free(pool, held.pop(0 if sequential else rng.randrange(len(held) - 1)))
    return out[warm_up:]


def _allocate(pool: Any, n: int) -> list:
    """`n` blocks as vLLM's scheduler takes them (a cached block taken is evicted: its hash goes)."""
    blocks = pool.get_new_blocks(n)
    for block in blocks:
        if block.block_hash is not None:  # (our stand-in hashes are in no cache map: drop them here)
            block.reset_hash()
    return blocks


def _free(pool: Any, blocks: list) -> None:
    """Free a finished request's blocks as vLLM's manager does: last block first. With prefix caching
    every full block has a hash (a stand-in here), and the pool keeps those at the queue's tail."""
    if pool.enable_caching:
        for i, block in enumerate(blocks[:-1]):  # the last block may be partly filled: no hash
            block.set_block_hash(b"stand-in-%d-%d" % (id(blocks), i))
    pool.free_blocks(reversed(blocks))


def posted_descriptors(lidx: np.ndarray, ridx: np.ndarray, local_addrs: np.ndarray, remote_addrs: np.ndarray,
                       piece_len: int) -> int:  # fmt: skip
    """How many copies NIXL makes of a transfer's descriptors: a descriptor merges into the one before it
    where it is the next one in both prepared lists and both sides' bytes follow on."""
    ids, addrs = (np.diff(a.astype(np.int64)) for a in (lidx, ridx)), (local_addrs, remote_addrs)
    next_ids = np.logical_and(*(step == 1 for step in ids))
    follows = np.logical_and(*(np.diff(a.astype(np.int64)) == piece_len for a in addrs))
    return int(len(lidx) - np.count_nonzero(next_ids & follows))


async def _one_pattern(address: tuple[str, int], region: np.ndarray, pairs: list[tuple[list[int], list[int]]],
                       ) -> dict[str, dict[str, list[float]]]:  # fmt: skip
    from nixl_async import EngineConfig, TransferEngine
    from nixl_async.layout import BlockLayout, pair_descriptor_ids

    region_len = BLOCKS * BLOCK_LEN
    addrs = [region.ctypes.data + i * region_len for i in range(REGIONS)]
    layout = BlockLayout.from_regions("kv", addrs, num_blocks=BLOCKS, block_len=BLOCK_LEN)
    raw = RawReader("raw-block-order", layout, address, progress_thread=False)
    lview, rview = raw.local_view, raw.remote_layout.view()
    ldescs, rdescs = lview.descriptors()[:, 0], rview.descriptors()[:, 0]
    out: dict[str, dict[str, list[float]]] = {s: {"ms": [], "cpu_us": [], "descriptors": []} for s in SETUPS}
    try:
        async with TransferEngine(EngineConfig()) as engine:
            engine.register("kv", [region[i * region_len:(i + 1) * region_len] for i in range(REGIONS)],
                            block_len=BLOCK_LEN)  # fmt: skip
            peer = await engine.connect(*address)
            for i, (local, remote) in enumerate(pairs):
                given = (lview.descriptor_ids(np.array(local)), rview.descriptor_ids(np.array(remote)))
                ordered = pair_descriptor_ids(lview, np.array(local), rview, np.array(remote))
                for setup in SETUPS if i % 2 == 0 else SETUPS[::-1]:
                    lidx, ridx = given if setup == "raw_vllm_order" else ordered
                    t0, c0 = time.perf_counter(), time.thread_time()
                    if setup == "engine":
                        await engine.read(peer, local, remote)
                    else:
                        raw.read(lidx, ridx)
                    cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
                    out[setup]["ms"].append(wall * 1e3)
                    out[setup]["cpu_us"].append(cpu * 1e6)
                    out[setup]["descriptors"].append(
                        posted_descriptors(lidx, ridx, ldescs[lidx], rdescs[ridx], BLOCK_LEN)
                    )
    finally:
        raw.close()
    return out


def _child(quick: bool) -> dict[str, dict]:
    from nixl_async.testing.peer_process import PeerProcess, PeerSpec

    requests = QUICK if quick else FULL
    region = np.ones(REGIONS * BLOCKS * BLOCK_LEN, dtype=np.uint8)
    out = {}
    for pattern in PATTERNS:
        spec = PeerSpec(engine_id=f"block-order-peer-{pattern}", num_regions=REGIONS, num_blocks=BLOCKS,
                        block_len=BLOCK_LEN, idle_poll_s=BRISK_PEER_POLL_S)  # fmt: skip
        with PeerProcess(spec, env=TCP) as peer:
            out[pattern] = asyncio.run(_one_pattern(peer.address, region, vllm_block_ids(pattern, requests)))
    return out


def run(quick: bool = False) -> Result:
    samples = run_tcp_child("block_order", quick)
    rows, metrics, ratios = [], {}, {}
    for pattern in PATTERNS:
        got = samples[pattern]
        med = {s: {k: float(np.median(v)) for k, v in got[s].items()} for s in SETUPS}
        for setup in SETUPS:
            rows.append([pattern, setup, float(np.mean(got[setup]["descriptors"])), med[setup]["ms"],
                         med[setup]["cpu_us"]])  # fmt: skip
            metrics.update({f"{setup}_{k}_p50_{pattern}": v for k, v in med[setup].items()})
        base = med["raw_vllm_order"]
        ratios[f"engine_over_raw_vllm_order_read_time_{pattern}_lower_is_better"] = med["engine"]["ms"] / base["ms"]
        copies = {s: float(np.mean(got[s]["descriptors"])) for s in ("raw_sorted", "raw_vllm_order")}
        ratios[f"sorted_over_vllm_order_descriptors_{pattern}_lower_is_better"] = (
            copies["raw_sorted"] / copies["raw_vllm_order"]
        )
    return Result(
        "block_order",
        ["pattern", "reader", "descriptors posted per read", "read ms p50", "reader CPU µs p50"],
        rows,
        metrics=metrics,
        ratios=ratios,
        notes=[
            f"UCX over TCP between two processes; each request 4-32 blocks of {BLOCK_LEN >> 10} KiB in {REGIONS}"
            " regions, its ids from two vLLM BlockPools; the peer checks every 2 ms",
            "raw_vllm_order posts the blocks in the scheduler's order, as vLLM's connector does; raw_sorted and the"
            " engine in the order of the local blocks",
        ],
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_child(sys.argv[2] == "quick")))
