"""A decode server's KV loads, one at a time: the reading thread's CPU per small read.

A vLLM decode server reads each request's KV as it arrives (the tiny model: 4 blocks of 32 KiB,
~35 loads a second at concurrency 4). On its one core the CPU our loop thread spends on a load
is taken from the model thread in the very steps that run beside the load, so it shows in
decode's inter-token latency while KV is pulled (#13's ``itl_during_load``). That figure is
too noisy on these machines to tell 0.3 ms per load apart; this scenario measures the cost
itself.

Both readers run over UCX/TCP against the same peer process (checking every 2 ms when idle,
`BRISK_PEER_POLL_S`), one read with a notification to the peer after each pause of `PAUSE_S`
(drawn at random, the same for both: a fixed pause locks reads to the phase of the peer's checks),
and count the CPU of the thread that drives NIXL (``RUSAGE_THREAD``) and of ZMQ's I/O threads
(which send the engine's side-channel notifications), less what the pauses cost alone:

- ``engine``: `TransferEngine` configured as the vLLM adapter configures it (its poller and
  side-channel notifications, `nixl_async_vllm.settings.ADAPTER_POLL`);
- ``raw``: NIXL driven directly, as vLLM's worker does: one post carrying its notification,
  state checked every 1 ms until DONE (vLLM checks once per step, on the model thread);
- ``facade``: the same engine behind the sync facade, as the adapter runs it in vLLM: each read
  submitted from this thread, which then waits for it (`wait_activity`) and collects it
  (`get_finished`); CPU of this thread and of the loop thread together (the hand-over and the
  report are what the adapter adds to the engine's own cost).
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from .common import BRISK_PEER_POLL_S, RawReader, Result, percentiles, run_tcp_child

BLOCK = 32 << 10
BLOCKS = 64
PER_READ = 4  # the tiny vLLM model's load: 2 layers x K and V
PAUSE_S = (0.015, 0.025)  # between reads: ~40 loads a second


def _thread_cpu() -> float:
    """This thread's CPU seconds, and those of ZMQ's I/O threads: they send the engine's side-channel
    notifications (a raw READ carries its own), on the same core in a decode server."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime + _zmq_threads_cpu()


def _zmq_threads_cpu() -> float:
    total = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().startswith("ZMQbg"):
                total += int((task / "schedstat").read_text().split()[0])  # ns on a CPU
        except (OSError, ValueError, IndexError):  # (a thread that ended meanwhile)
            continue
    return total / 1e9


def _picks(reads: int) -> list[tuple[list[int], float]]:
    """Each read's blocks and the pause after it."""
    rng = np.random.default_rng(1)
    return [(sorted(rng.choice(BLOCKS, PER_READ, replace=False).tolist()), float(rng.uniform(*PAUSE_S)))
            for _ in range(reads)]  # fmt: skip


async def _per_read(picks: list[tuple[list[int], float]], read: Callable[[int, list[int]], Awaitable[None]],
                    pause: Callable[[float], Awaitable[None]], cpu: Callable[[], float] = _thread_cpu,
                    ) -> tuple[float, list[float]]:  # fmt: skip
    """(CPU seconds per read net of the pauses, each read's wall time); `cpu`: the clock counted."""
    walls = []
    cpu0 = cpu()
    for i, (ids, seconds) in enumerate(picks):
        began = time.perf_counter()
        await read(i, ids)
        walls.append(time.perf_counter() - began)
        await pause(seconds)
    spent = cpu() - cpu0
    cpu0 = cpu()
    for _, seconds in picks:
        await pause(seconds)
    return (spent - (cpu() - cpu0)) / len(picks), walls


async def _blocking_pause(seconds: float) -> None:
    """A pause for readers that block their thread (no loop runs beside them)."""
    time.sleep(seconds)


async def _engine(address: tuple[str, int], picks: list[tuple[list[int], float]]) -> tuple[float, list[float]]:
    from nixl_async import EngineConfig, TransferEngine
    from nixl_async_vllm.settings import ADAPTER_POLL

    region = np.zeros(BLOCK * BLOCKS, dtype=np.uint8)
    config = EngineConfig(engine_id="bench-small-reads", notify_via="side_channel", poll=ADAPTER_POLL)
    async with TransferEngine(config) as engine:
        engine.register("kv", [region], block_len=BLOCK)
        peer = await engine.connect(*address)
        await engine.read(peer, [0], [0], notify=b"warm-up")
        await asyncio.sleep(0.2)  # past the warm-up's activity

        async def read(i: int, ids: list[int]) -> None:
            await engine.read(peer, ids, ids, notify=b"read-%d" % i)

        return await _per_read(picks, read, asyncio.sleep)


def _facade(address: tuple[str, int], picks: list[tuple[list[int], float]]) -> tuple[float, list[float]]:
    from nixl_async import EngineConfig
    from nixl_async.sync import SyncEngine
    from nixl_async_vllm.settings import ADAPTER_POLL

    region = np.zeros(BLOCK * BLOCKS, dtype=np.uint8)
    config = EngineConfig(engine_id="bench-small-reads-facade", notify_via="side_channel", poll=ADAPTER_POLL)
    with SyncEngine(config) as sync:
        sync.register("kv", [region], block_len=BLOCK)
        loop_clock = time.pthread_getcpuclockid(sync.call(threading.get_ident))
        host, port = address

        def read_and_collect(request_id: str, ids: list[int], notify: bytes) -> None:
            sync.submit_read(request_id, host, port, ids, ids, notify=notify)
            while not sync.wait_activity(1.0) and sync.in_flight:
                pass
            finished = sync.get_finished()
            assert request_id in finished.done, finished

        read_and_collect("warm-up", [0], b"warm-up")
        time.sleep(0.2)  # past the warm-up's activity

        async def read(i: int, ids: list[int]) -> None:  # blocking inside, as vLLM's thread is
            read_and_collect(f"read-{i}", ids, b"read-%d" % i)

        def both_threads() -> float:
            return _thread_cpu() + time.clock_gettime(loop_clock)

        return asyncio.run(_per_read(picks, read, _blocking_pause, both_threads))


def _raw(address: tuple[str, int], picks: list[tuple[list[int], float]]) -> tuple[float, list[float]]:
    from nixl_async.layout import BlockLayout

    region = np.zeros(BLOCK * BLOCKS, dtype=np.uint8)
    layout = BlockLayout.from_regions("kv", [region.ctypes.data], num_blocks=BLOCKS, block_len=BLOCK)
    raw = RawReader("bench-small-reads-raw", layout, address, progress_thread=False)

    async def read(i: int, ids: list[int]) -> None:  # blocking inside: no loop runs here
        index = np.asarray(ids)
        raw.read(index, index, check_every_s=0.001, notify=b"read-%d" % i)

    try:
        # Warmed up as the engine and the facade are: the connection's wire-up is no read's cost.
        raw.read(np.zeros(1, np.int64), np.zeros(1, np.int64), check_every_s=0.001, notify=b"warm-up")
        time.sleep(0.2)
        return asyncio.run(_per_read(picks, read, _blocking_pause))
    finally:
        raw.close()
        del region


def _child(quick: bool) -> dict[str, Any]:
    from nixl_async.testing.peer_process import PeerProcess, PeerSpec

    picks = _picks(200 if quick else 1000)
    spec = PeerSpec(engine_id="bench-small-reads-peer", num_regions=1, num_blocks=BLOCKS, block_len=BLOCK,
                    idle_poll_s=BRISK_PEER_POLL_S)  # fmt: skip
    out: dict[str, Any] = {}
    with PeerProcess(spec) as peer:  # inherits UCX over TCP from this child's environment
        for name in ("engine", "raw", "facade", "raw", "engine", "facade"):  # none always first or last
            if name == "engine":
                cpu, walls = asyncio.run(_engine(peer.address, picks))
            else:
                cpu, walls = (_raw if name == "raw" else _facade)(peer.address, picks)
            out.setdefault(name, []).append({"cpu": cpu, "walls": walls})
    return out


def run(quick: bool = False) -> Result:
    samples = run_tcp_child("small_reads", quick)
    rows: list[list[Any]] = []
    metrics: dict[str, float] = {}
    for name, runs in samples.items():
        cpu_us = float(np.median([r["cpu"] for r in runs])) * 1e6
        (wall_p50,) = percentiles([w for r in runs for w in r["walls"]], 50)
        rows.append([name, sum(len(r["walls"]) for r in runs), cpu_us, wall_p50 * 1e3])
        metrics[f"{name}_cpu_us_per_read"] = cpu_us
        metrics[f"{name}_read_p50_ms"] = wall_p50 * 1e3
    raw_cpu = metrics["raw_cpu_us_per_read"]
    ratios = {"engine_over_raw_cpu_per_read_lower_is_better": metrics["engine_cpu_us_per_read"] / raw_cpu,
              "facade_over_raw_cpu_per_read_lower_is_better": metrics["facade_cpu_us_per_read"] / raw_cpu}  # fmt: skip
    return Result(
        "small_reads",
        ["reader", "reads", "CPU us per read (median of 2 runs)", "read p50 ms"],
        rows,
        metrics=metrics,
        ratios=ratios,
        notes=[
            f"UCX over TCP on loopback; {PER_READ} x {BLOCK >> 10} KiB per read with a notification, pauses of"
            f" {PAUSE_S[0] * 1e3:g}-{PAUSE_S[1] * 1e3:g} ms; CPU: the thread driving NIXL (RUSAGE_THREAD) and ZMQ's"
            " I/O threads, less the pauses' own",
            "engine = TransferEngine with the vLLM adapter's poller and side-channel notifications;"
            " raw = NIXL directly, the notification carried by the READ, state checked every 1 ms;"
            " facade = the engine behind the sync facade, reads submitted and collected from a plain thread"
            " (CPU of both threads)",
        ],
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_child(sys.argv[2] == "quick")))
