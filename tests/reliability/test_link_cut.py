"""Link cut: a peer in its own network namespace (another host on a bridge), UCX over TCP.

The tests create the namespace and remove it afterwards; where that is not permitted they skip,
saying why, unless NIXL_ASYNC_REQUIRE_NETNS=1 (scripts/test.sh as root), where they fail.
Taking the link down mid-transfer must end the transfer within its deadline (fenced while UCX
has not noticed); a link that stays down must be noticed within the engine's link timeout, so
the memory goes quiet without the link coming back; bringing it back must let new transfers
succeed.
"""

import asyncio
import time

import numpy as np
import pytest

from nixl_async import EngineConfig, HandshakeError, TransferEngine, TransferFailed, TransferFenced, TransferTimeout
from nixl_async.testing import TCP_TLS, PeerProcess, PeerSpec, verify_blocks
from nixl_async.testing.netns import network_or_skip

BLOCK, BLOCKS = 1 << 20, 64


@pytest.fixture(scope="module")
def net():
    # One network for the module: UCX reads the routing table once per process, so a bridge
    # made after this process's first UCX connection over it would be unreachable.
    with network_or_skip(1, subnet="10.211.7") as network:
        yield network


def _tcp_between(monkeypatch, net) -> dict[str, str]:
    """UCX over TCP on the bridge for us (UCX skips bridges unless told), on its veth for the
    peer; returns the peer's environment."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    monkeypatch.setenv("UCX_NET_DEVICES", net.bridge)
    monkeypatch.setenv("UCX_TCP_BRIDGE_ENABLE", "y")
    return {"UCX_TLS": TCP_TLS, "UCX_NET_DEVICES": net.hosts[0].device}


async def test_link_down_fails_in_time_and_link_up_recovers(net, monkeypatch):
    host = net.hosts[0]
    spec = PeerSpec(engine_id="peer-across-veth", num_regions=1, num_blocks=BLOCKS, block_len=BLOCK,
                    host=host.address, seed=4)  # fmt: skip
    env = _tcp_between(monkeypatch, net)
    async with PeerProcess(spec, env=env, command_prefix=host.prefix) as peer_proc:
        region = np.zeros(BLOCKS * BLOCK, np.uint8) + 1
        async with TransferEngine(
            EngineConfig(engine_id="local-across-veth", handshake_timeout_s=2, link_timeout_s=None)
        ) as engine:
            engine.register("kv", [region], block_len=BLOCK)
            peer = await engine.connect(host.address, peer_proc.port)
            await engine.read(peer, [0], [0])

            deadline = 3.0
            transfer = await engine.start_read(peer, range(BLOCKS), range(BLOCKS), timeout=deadline)
            host.set_link(False)
            started = time.monotonic()
            try:
                # UCX over TCP does not notice a dead link for a long while: the slices in flight
                # stay unfinished, so past the grace the caller hears that the memory is fenced.
                with pytest.raises((TransferFailed, TransferTimeout, TransferFenced)):
                    await transfer
                assert time.monotonic() - started < deadline + engine.config.release_grace_s + 1.0
            finally:
                host.set_link(True)
            assert await transfer.wait_quiet(timeout=30), "the fence never cleared after the link came back"

            recovered_after = None
            t0 = time.monotonic()
            while time.monotonic() - t0 < 20 and recovered_after is None:
                try:
                    peer = await engine.connect(host.address, peer_proc.port)
                    region[:] = 1
                    await engine.read(peer, [1, 2], [7, 9], timeout=2)
                    recovered_after = time.monotonic() - t0
                except (TransferFailed, TransferTimeout, HandshakeError):
                    await asyncio.sleep(0.2)
            assert recovered_after is not None, "transfers did not recover after the link came back"
            assert verify_blocks([region], BLOCK, [1, 2], [7, 9], seed=4) == []
            print(f"\nlink cut: failed within {deadline}s deadline; recovered {recovered_after:.2f}s after link up")
        assert engine.live_handles() == {}


async def test_a_link_that_stays_down_is_noticed_and_the_memory_goes_quiet(net, monkeypatch):
    """UCX's defaults would keep the READ in flight (memory fenced) for minutes: the link timeout
    drops the connection, the transfer fails, and the caller may reuse the blocks at once."""
    host = net.hosts[0]
    spec = PeerSpec(engine_id="peer-beyond-a-dead-link", num_regions=1, num_blocks=BLOCKS, block_len=BLOCK,
                    host=host.address, seed=5)  # fmt: skip
    env = _tcp_between(monkeypatch, net)
    config = EngineConfig(engine_id="local-dead-link", handshake_timeout_s=2, link_timeout_s=2)
    async with PeerProcess(spec, env=env, command_prefix=host.prefix) as peer_proc:
        region = np.zeros(BLOCKS * BLOCK, np.uint8)
        async with TransferEngine(config) as engine:
            engine.register("kv", [region], block_len=BLOCK)
            peer = await engine.connect(host.address, peer_proc.port)
            await engine.read(peer, [0], [0])
            transfer = await engine.start_read(peer, range(BLOCKS), range(BLOCKS), timeout=20)
            await asyncio.sleep(0.05)
            host.set_link(False)
            cut = time.monotonic()
            try:
                with pytest.raises(TransferFailed):
                    await transfer
                noticed = time.monotonic() - cut
                assert transfer.quiet, "the caller was told before NIXL let go of the memory"
                assert noticed < 2 + 3, f"the dead link went unnoticed for {noticed:.1f}s"
                before = region.copy()
                await asyncio.sleep(0.5)
                assert np.array_equal(region, before), "bytes landed after the transfer failed"
            finally:
                host.set_link(True)

            t0 = time.monotonic()
            while True:
                try:
                    peer = await engine.connect(host.address, peer_proc.port)
                    await engine.read(peer, [1, 2], [7, 9], timeout=2)
                    break
                except (TransferFailed, TransferTimeout, HandshakeError):
                    assert time.monotonic() - t0 < 20, "transfers did not recover after the link came back"
                    await asyncio.sleep(0.2)
            assert verify_blocks([region], BLOCK, [1, 2], [7, 9], seed=5) == []
            print(f"\ndead link noticed after {noticed:.2f}s (link timeout 2 s); recovered after link up")
        assert engine.live_handles() == {}
