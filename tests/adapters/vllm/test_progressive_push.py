"""Progressive push at worker level (`push_worker.push_progressively`) over real NIXL, UCX over TCP.

Decode is a peer process holding zeroed blocks; this process is prefill, fed layer by layer as
vLLM's forward pass would feed it. What progressive push must guarantee: each layer's blocks
land as handed over, decode hears of the request only once all of it has landed (never a
partial request), a push that missed a layer writes the whole request before committing, and
nothing lands after decode's `write_by`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from nixl_async import EngineConfig, LeaseExpired, TransferEngine
from nixl_async.testing import (
    TCP_TLS,
    Checksums,
    PeerCommandError,
    Verify,
    WaitNotifications,
    fill_pattern,
    transfers_settled,
)
from nixl_async_vllm.progressive import LayerCoverage, LayerReady, PrefillStep, ProgressiveFeed, RequestDone
from nixl_async_vllm.push_book import PushGroup, PushRegistration, push_failure_notification, push_notification
from nixl_async_vllm.push_worker import push_progressively
from nixl_async_vllm.worker import KVGeometry

BLOCK = 1 << 20
BLOCKS = 48
REGIONS = 2
SEED = 7
PREFILL_BLOCKS = list(reversed(range(BLOCKS)))  # the request's blocks on prefill, by position
DECODE_BLOCKS = [(7 * i) % BLOCKS for i in range(BLOCKS)]  # ... and on decode
GEOMETRY = KVGeometry(tp_size=1, tp_rank=0, block_size=16, part_len=BLOCK, run_len=None, mla=False, kv_heads=1)
COMMIT = push_notification("req-d", 0)


@pytest.fixture
async def prefill(monkeypatch):
    monkeypatch.setenv("UCX_TLS", TCP_TLS)  # read when the agent's UCX worker is created: WRITEs really in flight
    engine = TransferEngine(EngineConfig(engine_id="layered-prefill"))
    await engine.start()
    regions = [np.zeros(BLOCKS * BLOCK, np.uint8) for _ in range(REGIONS)]
    fill_pattern(regions, SEED)
    engine.register("kv", regions, block_len=BLOCK)
    yield engine
    await engine.close()


@pytest.fixture
def decode(nixl_peer_factory):
    return nixl_peer_factory(num_regions=REGIONS, num_blocks=BLOCKS, block_len=BLOCK, seed=None, tcp=True)


def _start(prefill, decode, write_by: float, landed_notice: bool = False) -> tuple[ProgressiveFeed, asyncio.Task]:
    host, port = decode.address
    reg = PushRegistration(
        request_id="req", decode_request_id="req-d", decode_engine_id=decode.engine_id, decode_host=host,
        decode_port=port, decode_tp=1, decode_pages=1, groups=[PushGroup("full", DECODE_BLOCKS)], write=True,
        write_by=write_by, landed_notice=landed_notice,
    )  # fmt: skip
    feed = ProgressiveFeed("push>req>decode", BLOCKS)
    return feed, asyncio.create_task(push_progressively(prefill, GEOMETRY, reg, feed, REGIONS))


def _layer(region: int, lo: int, hi: int) -> LayerReady:
    return LayerReady(region, lo, hi, PREFILL_BLOCKS)


async def _landed(decode) -> bool:
    """Every decode block holds its prefill block's bytes, in every region."""
    return await decode.request(Verify(blocks=DECODE_BLOCKS, source_blocks=PREFILL_BLOCKS, seed=SEED)) == []


async def _not_committed(decode, within: float) -> bool:
    with pytest.raises(PeerCommandError) as refused:
        await decode.request(WaitNotifications(message=COMMIT, count=1, timeout=within))
    return refused.value.type == "NotificationTimeout"


async def test_layers_land_as_computed_and_the_request_is_committed_once_whole(prefill, decode):
    feed, push = _start(prefill, decode, time.time() + 30)
    for lo, hi in [(0, 20), (20, BLOCKS)]:  # two steps (chunks), two layers each
        for region in range(REGIONS):
            feed.give(_layer(region, lo, hi))
    deadline = time.monotonic() + 10
    while not await _landed(decode):
        assert time.monotonic() < deadline, "the layers handed over did not land"
        await asyncio.sleep(0.05)
    assert await _not_committed(decode, 0.3), "decode heard of the request before prefill finished it"
    feed.give(RequestDone((PREFILL_BLOCKS,)))
    results = await push
    assert len(results) == 2 * REGIONS, "one WRITE per layer and step, and no whole-request rewrite"
    assert sum(r.nbytes for r in results) == REGIONS * BLOCKS * BLOCK
    assert await decode.request(WaitNotifications(message=COMMIT, count=1, timeout=5))


async def test_a_layer_never_handed_over_makes_the_push_write_the_whole_request(prefill, decode):
    feed, push = _start(prefill, decode, time.time() + 30)
    feed.give(_layer(0, 0, BLOCKS))  # region 1 is never reported computed
    feed.give(RequestDone((PREFILL_BLOCKS,)))
    results = await push
    assert [r.nbytes for r in results] == [BLOCKS * BLOCK, REGIONS * BLOCKS * BLOCK]
    assert await decode.request(WaitNotifications(message=COMMIT, count=1, timeout=5))
    assert await _landed(decode)


async def test_a_request_that_moved_blocks_is_written_whole_from_where_it_ends(prefill, decode):
    """Preempted and resumed elsewhere: what went earlier may come from reused blocks; the end rewrites all."""
    feed, push = _start(prefill, decode, time.time() + 30)
    for region in range(REGIONS):
        feed.give(LayerReady(region, 0, BLOCKS, list(range(BLOCKS))))  # the blocks it held before
    feed.give(RequestDone((PREFILL_BLOCKS,)))
    results = await push
    assert len(results) == REGIONS + 1
    assert await decode.request(WaitNotifications(message=COMMIT, count=1, timeout=5))
    assert await _landed(decode)


async def test_nothing_lands_and_nothing_commits_after_write_by(prefill, decode):
    """Decode reuses its blocks once write_by has passed: prefill, still computing, must be quiet by then."""
    feed, push = _start(prefill, decode, time.time() + 0.04)  # 96 MiB over TCP take longer: cut in flight
    for region in range(REGIONS):
        feed.give(_layer(region, 0, BLOCKS))
    with pytest.raises(LeaseExpired):  # prefill never finished the request in time
        await push
    counters = prefill.snapshot().counters
    assert counters.get("transfers_done", 0) < counters["transfers_submitted"], f"no WRITE was cut: {counters}"
    assert await transfers_settled(prefill) == 0, "a WRITE cut at write_by is still held by NIXL"
    ended = await decode.request(Checksums(blocks=list(range(BLOCKS))))
    feed.give(RequestDone((PREFILL_BLOCKS,)))  # too late: the push is over
    assert await _not_committed(decode, 1.0)
    assert await decode.request(Checksums(blocks=list(range(BLOCKS)))) == ended, "bytes landed after write_by"


@pytest.mark.parametrize("landed_notice", [False, True], ids=["older-decode", "decode-told-landed"])
async def test_a_push_cancelled_midway_tells_decode_once_no_write_is_held(prefill, decode, landed_notice):
    """Prefill aborted the request while its layers were being written (vLLM: `reqs_not_processed`, the
    facade cancels the push). Before, decode heard nothing and held its blocks until its watchdog.
    The WRITEs in flight end DONE (cancelled, not failed): a decode that asks hears that they all
    landed (it need not wait a margin); an older decode hears the notice it waits for."""
    write_by = time.time() + 30
    feed, push = _start(prefill, decode, write_by, landed_notice)
    for region in range(REGIONS):
        feed.give(_layer(region, 0, BLOCKS))  # 96 MiB over TCP: in flight when cancelled
    while not prefill.snapshot().counters.get("transfers_submitted"):
        await asyncio.sleep(0.001)
    push.cancel()
    with pytest.raises(asyncio.CancelledError):
        await push
    assert await transfers_settled(prefill) == 0, "told before NIXL let go of every WRITE"
    told = push_failure_notification("req-d", 0, write_by, landed=landed_notice)
    assert await decode.request(WaitNotifications(message=told, count=1, timeout=5)) == [prefill.engine_id]
    assert await _not_committed(decode, 0.3)


def test_a_resumed_step_that_hands_over_no_new_block_still_breaks_the_coverage():
    """Preempted after blocks 0-3 went, resumed, and recomputing only blocks already handed over: before,
    that step handed nothing, its `resumed` flag was lost, and the push committed layers that WRITEs in
    flight at the preemption may have read from blocks another request reused."""
    feed = ProgressiveFeed("push>r>d", prompt_blocks=6)
    blocks = ([10, 11, 12, 13, 14, 15],)
    first = feed.hand_over(PrefillStep(blocks, 0, 64, 96), block_size=16)
    assert first == LayerReady(-1, 0, 4, blocks[0], False)
    assert feed.hand_over(PrefillStep(blocks, 64, 64, 96), block_size=16) is None, "no new block: nothing"
    resumed = feed.hand_over(PrefillStep(blocks, 16, 48, 96, resumed=True), block_size=16)
    assert resumed is not None and resumed.resumed and resumed.lo == resumed.hi == 4
    last = feed.hand_over(PrefillStep(blocks, 48, 96, 96), block_size=16)
    assert last == LayerReady(-1, 4, 6, blocks[0], False)
    coverage = LayerCoverage(regions=1)
    for item in (first, resumed, last):
        item = dataclasses.replace(item, region=0)
        if coverage.accepts(item):
            coverage.wrote(item)
    assert not coverage.whole(blocks[0]), "a preemption in between: the whole request is written again"
