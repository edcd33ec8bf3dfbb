"""Link cut: a peer in its own network namespace, joined by a veth pair, UCX over TCP.

The test creates the namespace and the veth pair itself and removes them afterwards; where
that is not permitted it skips, saying why. Taking the link down mid-transfer must fail the
transfer within its deadline; bringing it back must let new transfers succeed.
"""

import asyncio
import os
import subprocess
import time

import numpy as np
import pytest

from nixl_async import EngineConfig, HandshakeError, TransferEngine, TransferFailed, TransferFenced, TransferTimeout
from nixl_async.testing import PeerProcess, PeerSpec, verify_blocks

SUFFIX = f"{os.getpid() % 100000}"
NS, VETH_HOST, VETH_NS = f"nxa{SUFFIX}", f"nxh{SUFFIX}", f"nxn{SUFFIX}"
HOST_IP, NS_IP = "10.211.7.1", "10.211.7.2"  # addresses inside our own test namespace pair
BLOCK, BLOCKS = 1 << 20, 64


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def namespace():
    try:
        _ip("netns", "add", NS)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        pytest.skip(f"cannot create a network namespace here: {exc} {detail.decode().strip()}")
    try:
        _ip("link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS)
        _ip("link", "set", VETH_NS, "netns", NS)
        _ip("addr", "add", f"{HOST_IP}/24", "dev", VETH_HOST)
        _ip("link", "set", VETH_HOST, "up")
        _ip("netns", "exec", NS, "ip", "addr", "add", f"{NS_IP}/24", "dev", VETH_NS)
        _ip("netns", "exec", NS, "ip", "link", "set", VETH_NS, "up")
        _ip("netns", "exec", NS, "ip", "link", "set", "lo", "up")
        yield NS
    finally:
        subprocess.run(["ip", "netns", "del", NS], capture_output=True, timeout=10)
        subprocess.run(["ip", "link", "del", VETH_HOST], capture_output=True, timeout=10)


async def test_link_down_fails_in_time_and_link_up_recovers(namespace, monkeypatch):
    spec = PeerSpec(engine_id="peer-across-veth", num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, host=NS_IP, seed=4)
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": VETH_NS}
    async with PeerProcess(spec, env=env, command_prefix=["ip", "netns", "exec", namespace]) as peer_proc:
        monkeypatch.setenv("UCX_TLS", "tcp")
        monkeypatch.setenv("UCX_NET_DEVICES", VETH_HOST)
        region = np.zeros(BLOCKS * BLOCK, np.uint8) + 1
        async with TransferEngine(EngineConfig(engine_id="local-across-veth", handshake_timeout_s=2)) as engine:
            engine.register("kv", [region], block_len=BLOCK)
            peer = await engine.connect(NS_IP, peer_proc.port)
            await engine.read(peer, [0], [0])

            deadline = 3.0
            transfer = await engine.start_read(peer, range(BLOCKS), range(BLOCKS), timeout=deadline)
            _ip("link", "set", VETH_HOST, "down")
            started = time.monotonic()
            try:
                # UCX over TCP does not notice a dead link for a long while: the slices in flight
                # stay unfinished, so past the grace the caller hears that the memory is fenced.
                with pytest.raises((TransferFailed, TransferTimeout, TransferFenced)):
                    await transfer
                assert time.monotonic() - started < deadline + engine.config.release_grace_s + 1.0
            finally:
                _ip("link", "set", VETH_HOST, "up")
            assert await transfer.wait_quiet(timeout=30), "the fence never cleared after the link came back"

            recovered_after = None
            t0 = time.monotonic()
            while time.monotonic() - t0 < 20 and recovered_after is None:
                try:
                    peer = await engine.connect(NS_IP, peer_proc.port)
                    region[:] = 1
                    await engine.read(peer, [1, 2], [7, 9], timeout=2)
                    recovered_after = time.monotonic() - t0
                except (TransferFailed, TransferTimeout, HandshakeError):
                    await asyncio.sleep(0.2)
            assert recovered_after is not None, "transfers did not recover after the link came back"
            assert verify_blocks([region], BLOCK, [1, 2], [7, 9], seed=4) == []
            print(f"\nlink cut: failed within {deadline}s deadline; recovered {recovered_after:.2f}s after link up")
        assert engine.live_handles() == {}
