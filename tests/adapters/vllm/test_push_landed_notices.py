"""Prefill never tells decode a push failed after its notifying WRITE landed (decode heard it arrived).

The failure notice goes over the side channel and the WRITE's notification rides the WRITE: nothing
orders the two at decode, which on the failure first fails a request whose KV is all there. Decode
is a peer process over UCX/TCP, stopped (SIGSTOP) so the notifying WRITE is in flight when the push
is stopped: by a cancel (a withdrawal, an abort) or by its lease (`write_by`) running out.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np
import pytest

from nixl_async import EngineConfig, LeaseExpired, TransferEngine
from nixl_async.testing import TCP_TLS, PeerCommandError, WaitNotifications, fill_pattern
from nixl_async_vllm.progressive import ProgressiveFeed, RequestDone
from nixl_async_vllm.push_book import PushGroup, PushRegistration, push_failure_notification, push_notification
from nixl_async_vllm.push_worker import push_or_tell, push_progressively
from nixl_async_vllm.worker import KVGeometry

BLOCK = 64 << 10
BLOCKS = 8
REGIONS = 2
GEOMETRY = KVGeometry(tp_size=1, tp_rank=0, block_size=16, part_len=BLOCK, run_len=None, mla=False, kv_heads=1)


@pytest.fixture
def decode(monkeypatch, nixl_peer_factory):
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    return nixl_peer_factory(num_regions=REGIONS, num_blocks=BLOCKS, block_len=BLOCK, seed=None, tcp=True)


async def _prefill(decode, notify_via: str) -> tuple[TransferEngine, PushRegistration]:
    """A prefill engine wired up to `decode` (one WRITE done, so UCX's set-up is behind it)."""
    engine = await TransferEngine(EngineConfig(engine_id=f"prefill-{notify_via}", min_post_bytes=64 << 20,
                                               notify_via=notify_via)).start()  # fmt: skip
    regions = [np.zeros(BLOCKS * BLOCK, np.uint8) for _ in range(REGIONS)]
    fill_pattern(regions, 7)
    engine.register("kv", regions, block_len=BLOCK)
    host, port = decode.address
    await engine.write(await engine.connect(host, port, expected_engine_id=decode.engine_id), [0], [0])
    reg = PushRegistration(request_id="req", decode_request_id="req-d", decode_engine_id=decode.engine_id,
                           decode_host=host, decode_port=port, decode_tp=1, decode_pages=1,
                           groups=[PushGroup("full", list(range(BLOCKS)))], write=True, write_by=time.time() + 30,
                           landed_notice=True)  # fmt: skip
    return engine, reg


async def _assert_told_landed_only(decode, reg: PushRegistration) -> None:
    await decode.request(WaitNotifications(message=push_notification("req-d", 0), count=1, timeout=5))
    failed = push_failure_notification("req-d", 0, reg.write_by, landed=True)
    with pytest.raises(PeerCommandError, match="NotificationTimeout"):
        await decode.request(WaitNotifications(message=failed, count=1, timeout=1.5))


async def _until_in_flight(engine: TransferEngine) -> None:
    for _ in range(2000):
        if engine.live_handles().get("xfers"):
            return
        await asyncio.sleep(0.001)
    pytest.fail("the notifying WRITE was never posted")


@pytest.mark.parametrize("notify_via", ["nixl", "side_channel"])
async def test_a_progressive_push_cancelled_after_its_notifying_write_went_out(decode, notify_via):
    """Before, `push_progressively` sent the failure notice whenever its WRITEs had settled."""
    engine, reg = await _prefill(decode, notify_via)
    try:
        feed = ProgressiveFeed("push>req>decode", BLOCKS)
        push = asyncio.create_task(push_progressively(engine, GEOMETRY, reg, feed, REGIONS))
        await asyncio.sleep(0.2)  # connected, waiting for layers
        decode.pause()
        try:  # no layer reported: at its end the whole request is written, its notification on the one slice
            feed.give(RequestDone((list(reversed(range(BLOCKS))),)))
            await _until_in_flight(engine)
            push.cancel()  # a withdrawal, or an abort, just after the notifying slice went out
            await asyncio.sleep(0.3)
        finally:
            decode.resume()
        with pytest.raises(asyncio.CancelledError):
            await push
        await _assert_told_landed_only(decode, reg)
    finally:
        await engine.close()


async def test_a_whole_push_whose_notifying_write_lands_just_past_write_by(decode):
    """The lease ends the WRITE (`LeaseExpired`) while its one slice is out; it then lands within the grace.
    Before, `push_or_tell` took the error for a failure and told decode, which had the landed notice too."""
    engine, reg = await _prefill(decode, "side_channel")
    reg = msgspec.structs.replace(reg, write_by=time.time() + 0.25)
    try:
        decode.pause()
        try:
            pushing = asyncio.create_task(push_or_tell(engine, GEOMETRY, (list(range(BLOCKS)),), reg))
            await asyncio.sleep(0.5)  # write_by passes with the notifying slice in flight
            assert engine.live_handles().get("xfers"), "the WRITE is not in flight"
        finally:
            decode.resume()  # within the 1 s grace: the slice ends DONE
        with pytest.raises(LeaseExpired):
            await pushing
        await _assert_told_landed_only(decode, reg)
    finally:
        await engine.close()


async def test_a_notification_alone_that_failed_is_not_taken_for_a_landed_push(monkeypatch):
    """A push with nothing to write (a full prefix hit) is its notification alone. Before, that notification
    failing was taken for a WRITE that landed (no slice errored, quiet): decode was told nothing at all."""
    import zmq

    from nixl_async import NotificationFailed
    from nixl_async_vllm.push_worker import _notified

    async with TransferEngine(EngineConfig(engine_id="prefill-alone")) as prefill, \
            TransferEngine(EngineConfig(engine_id="decode-alone")) as decode:  # fmt: skip
        for engine in (prefill, decode):
            engine.register("kv", [np.zeros(4 * BLOCK, np.uint8)], block_len=BLOCK)
        peer = await prefill.connect(*await decode.serve())

        def unreachable(*_args, **_kwargs):
            raise zmq.ZMQError(zmq.EHOSTUNREACH, "injected")

        monkeypatch.setattr(prefill._driver._notify, "send", unreachable)
        notice = await prefill.start_write(peer, [], [], notify=b"push:req-d:0")
        with pytest.raises(NotificationFailed):
            await notice
        assert not _notified([notice])


@pytest.mark.parametrize(("nbytes", "counted"), [(0, 0), (BLOCK, 1)])
async def test_a_push_with_nothing_to_write_is_no_transfer_in_vllms_stats(monkeypatch, nbytes, counted):
    """An audit of session 39: decode's whole prompt hit its own cache, so the push only notified; its result
    (0 bytes, 0 s) was counted as a successful transfer: averages pulled to 0, an interval of such pushes gave
    vLLM's throughput NaN. vLLM counts nothing for a notification alone (and neither does the pull path)."""
    import queue

    from nixl_async import TransferResult
    from nixl_async_vllm import push_worker

    result = TransferResult(transfer_id=1, op="WRITE", peer="decode", nbytes=nbytes, descriptors=nbytes // BLOCK,
                            slices=1, seconds=0.001, notified=True)  # fmt: skip

    async def pushed(engine, geometry, blocks, reg):
        return result

    monkeypatch.setattr(push_worker, "push_or_tell", pushed)
    worker = push_worker.PushConnectorWorker.__new__(push_worker.PushConnectorWorker)
    worker.geometry = GEOMETRY
    worker._results = queue.SimpleQueue()
    monkeypatch.setattr(worker, "_begin", lambda push_id: True, raising=False)
    reg = PushRegistration(request_id="req", decode_request_id="req-d", decode_engine_id="decode", decode_host="h",
                           decode_port=1, decode_tp=1, decode_pages=1, groups=[PushGroup("full", [])], write=True,
                           write_by=time.time() + 30)  # fmt: skip
    await worker._push(None, "push-1", ([],), reg)
    assert worker._results.qsize() == counted
