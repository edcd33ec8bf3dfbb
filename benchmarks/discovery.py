"""Fleet discovery: time until 16 peers are usable, found through etcd vs by address on the side channel.

16 peer processes publish themselves in a local etcd (Debian's etcd-server, on loopback) and serve
their side channel. For each trial a fresh reader engine connects to all 16 at once and reads one
block from each; "usable" is when every read is done. Three ways, alternating trials:

- side channel: ``connect(host, port)`` to each (the reader knows every address);
- etcd: ``connect(engine_id=...)``, each peer's record used as its handshake reply (the peers'
  loops do no work for it);
- etcd + side channel: etcd gives the address, then the side-channel handshake (what the vLLM
  adapter does, as its notifications need a session the peer issues).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np

from nixl_async import EngineConfig, EtcdConfig, TransferEngine
from nixl_async.testing.etcd import EtcdServer, EtcdUnavailable
from nixl_async.testing.peer_process import PeerProcess, PeerSpec, Stats

from .common import Result

PEERS = 16
BLOCK = 4096
WAYS = ("side channel", "etcd", "etcd + side channel")


async def _trial(way: str, peers: list[PeerProcess], etcd: EtcdConfig, trial: int) -> tuple[float, float]:
    """(all connected, all read once) in seconds, for a fresh reader engine."""
    config = EngineConfig(engine_id=f"bench-discovery-{trial}", etcd=etcd,
                          notify_via="side_channel" if way == "etcd + side channel" else "nixl")  # fmt: skip
    async with TransferEngine(config) as engine:
        engine.register("kv", [np.zeros(4 * BLOCK, dtype=np.uint8)], block_len=BLOCK)
        started = time.perf_counter()
        if way == "side channel":
            connecting = [engine.connect(*p.address, expected_engine_id=p.engine_id) for p in peers]
        else:
            connecting = [engine.connect(engine_id=p.engine_id) for p in peers]
        connected = await asyncio.gather(*connecting)
        joined = time.perf_counter() - started
        await asyncio.gather(*(engine.read(peer, [0], [1]) for peer in connected))
        usable = time.perf_counter() - started
    return joined, usable


async def _measure(peers: list[PeerProcess], etcd: EtcdConfig, trials: int) -> dict[str, list[tuple[float, float]]]:
    samples: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    answered: dict[str, int] = {}
    for trial in range(trials):
        order = WAYS if trial % 2 == 0 else WAYS[::-1]
        for way in order:
            before = sum([(await p.request(Stats()))["counters"].get("handshakes_answered", 0) for p in peers])
            samples[way].append(await _trial(way, peers, etcd, trial))
            after = sum([(await p.request(Stats()))["counters"].get("handshakes_answered", 0) for p in peers])
            answered[way] = answered.get(way, 0) + after - before
    samples["_answered"] = [(float(answered[w]), 0.0) for w in WAYS]
    return samples


async def _start(peers: list[PeerProcess]) -> None:
    await asyncio.gather(*(p.astart() for p in peers))


def run(quick: bool) -> Result:
    trials = 5 if quick else 15
    try:
        server = EtcdServer().start()
    except EtcdUnavailable as exc:
        return Result("discovery", ["setup"], [], notes=[f"skipped: {exc}"])
    etcd = EtcdConfig(server.endpoint, namespace="bench-discovery")
    peers = [
        PeerProcess(PeerSpec(engine_id=f"bench-disc-{i}", num_regions=1, num_blocks=8, block_len=BLOCK,
                             etcd_endpoint=server.endpoint, etcd_namespace="bench-discovery"))
        for i in range(PEERS)
    ]  # fmt: skip
    try:
        asyncio.run(_start(peers))
        samples = asyncio.run(_measure(peers, etcd, trials))
    finally:
        for p in peers:
            p.stop()
        server.close()
    answered = dict(zip(WAYS, (int(a) for a, _ in samples.pop("_answered")), strict=True))
    rows, metrics = [], {}
    for way in WAYS:
        joined = [j * 1e3 for j, _ in samples[way]]
        usable = [u * 1e3 for _, u in samples[way]]
        rows.append([way, statistics.median(joined), statistics.median(usable), min(usable), max(usable),
                     answered[way] / trials])  # fmt: skip
        key = way.replace(" + ", "_then_").replace(" ", "_")
        metrics[f"{key}_usable_ms_p50"] = statistics.median(usable)
        metrics[f"{key}_connected_ms_p50"] = statistics.median(joined)
    side = metrics["side_channel_usable_ms_p50"]
    return Result(
        "discovery",
        ["way", "connected p50 (ms)", "usable p50 (ms)", "usable min", "usable max", "handshakes answered by peers"],
        rows,
        metrics=metrics,
        ratios={
            "etcd_over_side_channel_usable_time_lower_is_better": metrics["etcd_usable_ms_p50"] / side,
            "etcd_then_side_channel_over_side_channel_usable_time_lower_is_better": (
                metrics["etcd_then_side_channel_usable_ms_p50"] / side
            ),
        },
        notes=[
            f"{PEERS} peer processes, etcd {server.endpoint} on loopback, {trials} alternating trials, medians;"
            " 'usable': connected and one 4 KiB read from each done; fresh reader engine per trial",
            "'handshakes answered by peers': per trial, summed over the 16 (work their loops did for the reader)",
        ],
    )
