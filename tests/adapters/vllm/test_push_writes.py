"""Prefill's side of push mode (`push_worker.push`) over real NIXL, without vLLM, UCX over TCP.

Decode is a peer process holding zeroed blocks; this process is prefill and WRITEs into them.
What push must guarantee: nothing is written after the registration's ``write_by`` (decode
reuses its blocks once it has passed, plus a margin), whether the request finished on prefill
after it, or a WRITE was still in flight at it.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np
import pytest

from nixl_async import EngineConfig, LeaseExpired, TransferEngine, TransferError
from nixl_async.testing import TCP_TLS, Checksums, WaitNotifications
from nixl_async_vllm.push_book import PushGroup, PushRegistration, push_notification
from nixl_async_vllm.push_worker import DecodeRestarted, push, push_or_tell
from nixl_async_vllm.worker import KVGeometry

BLOCK = 1 << 20
BLOCKS = 96
PREFILL_BLOCKS = [list(range(BLOCKS))]
DECODE_BLOCKS = list(reversed(range(BLOCKS)))
GEOMETRY = KVGeometry(tp_size=1, tp_rank=0, block_size=16, part_len=BLOCK, run_len=None, mla=False, kv_heads=1)


@pytest.fixture
async def prefill(monkeypatch):
    monkeypatch.setenv("UCX_TLS", TCP_TLS)  # read when the agent's UCX worker is created
    engine = TransferEngine(EngineConfig(engine_id="push-prefill"))
    await engine.start()
    regions = [np.full(BLOCKS * BLOCK, 0x5A, np.uint8) for _ in range(2)]
    engine.register("kv", regions, block_len=BLOCK)
    yield engine
    await engine.close()


@pytest.fixture
def decode(nixl_peer_factory):
    return nixl_peer_factory(num_regions=2, num_blocks=BLOCKS, block_len=BLOCK, seed=None, tcp=True)


def _registration(decode, write_by: float, blocks: list[int] = DECODE_BLOCKS) -> PushRegistration:
    host, port = decode.address
    return PushRegistration(
        request_id="req", decode_request_id="req-d", decode_engine_id=decode.engine_id, decode_host=host,
        decode_port=port, decode_tp=1, decode_pages=1, groups=[PushGroup("full", blocks)], write=True,
        write_by=write_by,
    )  # fmt: skip


async def _sums(decode) -> list[int]:
    return list(await decode.request(Checksums(blocks=list(range(BLOCKS)))))


async def test_a_push_lands_whole_with_its_notification(prefill, decode):
    zero = await _sums(decode)
    result = await push(prefill, GEOMETRY, PREFILL_BLOCKS, _registration(decode, time.time() + 30))
    assert result.nbytes == 2 * BLOCKS * BLOCK
    await decode.request(WaitNotifications(message=push_notification("req-d", 0), count=1, timeout=5))
    assert all(a != b for a, b in zip(await _sums(decode), zero, strict=True)), "every block written"


async def test_prefill_finishing_after_write_by_writes_nothing(prefill, decode):
    zero = await _sums(decode)
    with pytest.raises(LeaseExpired):
        await push(prefill, GEOMETRY, PREFILL_BLOCKS, _registration(decode, time.time() - 0.01))
    assert await _sums(decode) == zero


async def test_a_write_in_flight_at_write_by_is_stopped_and_nothing_lands_after(prefill, decode):
    """Decode reuses its blocks once write_by has passed: prefill's WRITE must be over by then."""
    with pytest.raises(TransferError):  # cut at write_by (not finished: 192 MiB over TCP take longer)
        await push(prefill, GEOMETRY, PREFILL_BLOCKS, _registration(decode, time.time() + 0.05))
    ended = await _sums(decode)
    await asyncio.sleep(1.0)  # our loop keeps progressing UCX meanwhile
    assert await _sums(decode) == ended, "bytes landed in decode's blocks after the push was over"


async def test_a_registration_from_before_decode_restarted_writes_nothing_into_the_new_decode(prefill, decode):
    """Decode restarted under the same engine id and address: the block ids of a request its previous agent
    registered belong to other requests now. Before, the push's next handshake found the new agent and wrote."""
    first = await prefill.connect(*decode.address, expected_engine_id=decode.engine_id)
    reg = msgspec.structs.replace(_registration(decode, time.time() + 30, [4, 5]), decode_agent=first.agent_name)
    await push(prefill, GEOMETRY, ([0, 1],), msgspec.structs.replace(reg, decode_request_id="earlier"))
    await decode.reincarnate(decode.engine_id, port=decode.port)
    zero = await _sums(decode)
    outcomes = []
    for _ in range(2):  # the first may still reach the old agent's peer (a failed WRITE marks it stale)
        with pytest.raises(TransferError) as refused:
            await push_or_tell(prefill, GEOMETRY, ([2, 3],), reg)
        outcomes.append(refused.value)
    assert isinstance(outcomes[-1], DecodeRestarted), outcomes
    assert await _sums(decode) == zero, "bytes of a void registration landed in the restarted decode"
    fresh = msgspec.structs.replace(reg, decode_agent=prefill.peer(decode.engine_id).agent_name)
    assert (await push(prefill, GEOMETRY, ([2, 3],), fresh)).nbytes == 2 * 2 * BLOCK  # its own registrations go
