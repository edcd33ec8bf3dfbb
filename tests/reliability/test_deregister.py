"""Memory deregistered while a peer still uses it, over UCX/TCP (where UCX checks no memory keys).

A peer reading our memory when we deregister it keeps being served from that address, and a peer
holding our older metadata can reach it later too. The engine therefore keeps the objects it was
given referenced until it closes; before, deregistering dropped them, the array was freed in the
middle of the peer's read, and our process crashed (a segfault while draining notifications).
"""

import asyncio
import gc
import weakref

import numpy as np
import pytest

from nixl_async import EngineConfig, TransferEngine
from nixl_async.testing import TransferCommand

BLOCK = 1 << 20
BLOCKS = 192


@pytest.fixture
async def served_engine(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")  # read when the agent's UCX worker is created
    engine = TransferEngine(EngineConfig(engine_id="deregistering"))
    await engine.start()
    await engine.serve()
    yield engine
    await engine.close()


@pytest.mark.parametrize("op", ["READ", "WRITE"])
async def test_memory_deregistered_under_a_peers_transfer_stays_alive(served_engine, nixl_peer_factory, op):
    peer = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, seed=3, tcp=True)
    memory = np.full(BLOCKS * BLOCK, 0x11, np.uint8)
    alive = weakref.ref(memory)
    served_engine.register("kv", [memory], block_len=BLOCK)
    del memory  # the engine holds the only reference
    host, port = served_engine.address
    ids = list(range(BLOCKS))
    await peer.request(TransferCommand(op=op, host=host, port=port, local_blocks=[0], remote_blocks=[0], timeout=10))
    moving = asyncio.ensure_future(peer.request(TransferCommand(op=op, host=host, port=port, local_blocks=ids,
                                                                remote_blocks=ids, timeout=20)))  # fmt: skip
    await asyncio.sleep(0.05)
    served_engine.deregister("kv")
    gc.collect()
    assert alive() is not None, "deregistered memory a peer may still reach was freed"
    await asyncio.gather(moving, return_exceptions=True)  # served to the end, or a typed failure on its side
    await asyncio.sleep(0.5)  # our poller keeps progressing UCX meanwhile
    assert alive() is not None
