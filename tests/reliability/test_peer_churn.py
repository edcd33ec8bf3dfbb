"""Peer churn: 200 peer incarnations connect, transfer and vanish; what the engine holds stays flat.

Two peer processes are reincarnated round after round (`PeerProcess.reincarnate`: a new engine,
NIXL agent and address over the same memory; the old incarnation vanishes). One takes a new
engine id every round, as a fleet whose prefill instances come and go: only
`EngineConfig.peer_ttl_s` can reclaim what we held for its old incarnations. The other keeps its
engine id and restarts (a new agent), which the re-handshake must replace. Every round we
connect to both, read a block from each (verified byte for byte, into a zeroed block) with a
side-channel notification (so notifier sockets open), and check the notification arrived.

Every SAMPLE_EVERY rounds we wait past the TTL and sample remote agents, descriptor lists, peers,
notifier sockets and RSS: all must stay bounded, the RSS slope small (numbers printed; run with
-s). Before eviction existed each round leaked a remote agent, a descriptor list, a peer and a
socket, about 40 KiB of RSS per vanished peer.
"""

import asyncio
import os

import numpy as np

from nixl_async import EngineConfig, TransferEngine
from nixl_async.testing import WaitNotifications, verify_blocks

ROUNDS = int(os.environ.get("NIXL_ASYNC_CHURN_ROUNDS", "100"))  # two incarnations per round
SAMPLE_EVERY = 10
TTL_S = 0.2
BLOCK, BLOCKS = 4096, 8
BOUND = 3  # remote agents, remote descriptor lists, peers, sockets once idle peers are gone
MAX_RSS_SLOPE_MIB = 1.0  # per 100 incarnations (the leak measured 2; with eviction about 0.05)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def _sample(engine: TransferEngine) -> dict[str, float]:
    live = engine.live_handles()
    return {
        "remote_agents": live.get("remote_agents", 0),
        "remote_dlists": live.get("dlists", 0) - 1,  # our own layout's list stays
        "peers": len(engine.peers),
        "sockets": engine._notify.side_sockets,  # side-channel notifier sockets, one per peer address
        "rss_mib": _rss_mib(),
    }


async def test_churning_peers_leave_nothing_behind(nixl_peer_factory):
    spec = dict(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK)
    comers = nixl_peer_factory(engine_id="churn-new-0", seed=21, **spec)  # a new engine id each round
    restarter = nixl_peer_factory(engine_id="churn-same", seed=22, **spec)  # the same id, a new agent
    procs = [comers, restarter]
    config = EngineConfig(engine_id="churn-local", peer_ttl_s=TTL_S, notify_via="side_channel")
    samples: list[tuple[int, dict[str, float], dict[str, float]]] = []
    async with TransferEngine(config) as engine:
        kv = [np.zeros(BLOCKS * BLOCK, np.uint8)]
        engine.register("kv", kv, block_len=BLOCK)
        for rnd in range(1, ROUNDS + 1):
            for proc in procs:
                peer = await engine.connect(*proc.address, expected_engine_id=proc.engine_id)
                local, remote = rnd % BLOCKS, (rnd * 3 + 1) % BLOCKS
                kv[0][local * BLOCK : (local + 1) * BLOCK] = 0
                message = f"churn-{rnd}-{proc.engine_id}".encode()
                await engine.read(peer, [local], [remote], notify=message, timeout=10)
                assert verify_blocks(kv, BLOCK, [local], [remote], proc.spec.seed) == [], (rnd, proc.engine_id)
                await proc.request(WaitNotifications(message=message, timeout=10))
            # The incarnations we just used vanish; new ones take their place at new addresses.
            await asyncio.gather(comers.reincarnate(f"churn-new-{rnd}"), restarter.reincarnate("churn-same"))
            if rnd % SAMPLE_EVERY == 0:
                hot = _sample(engine)
                await asyncio.sleep(3 * TTL_S)  # idle past the TTL: every peer we knew is unused now
                cold = _sample(engine)
                samples.append((2 * rnd, hot, cold))
                print(f"{2 * rnd:4d} incarnations  hot {hot}  after {3 * TTL_S:.1f}s idle {cold}")
    assert engine.live_handles() == {}

    for incarnations, _hot, cold in samples:
        for what in ("remote_agents", "remote_dlists", "peers", "sockets"):
            assert cold[what] <= BOUND, f"{what} after {incarnations} incarnations: {cold}"
    steady = samples[2:]  # the first two are warm-up
    x = np.array([n for n, _, _ in steady], dtype=float)
    rss = np.array([cold["rss_mib"] for _, _, cold in steady])
    slope = float(np.polyfit(x, rss, 1)[0]) * 100
    print(f"RSS {rss[0]:.1f} -> {rss[-1]:.1f} MiB, slope {slope:+.3f} MiB per 100 incarnations")
    assert slope < MAX_RSS_SLOPE_MIB, f"RSS grows {slope:.3f} MiB per 100 incarnations"
