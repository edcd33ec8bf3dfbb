"""Decode gives up on a pushed request (vLLM finished it: its client went away).

Over real NIXL, both sides in this process as in `test_push_layouts`: decode runs `receive_pushed`
into zeroed caches and sets its withdrawal; prefill answers registrations and withdrawals as its
push worker does (a `PushBook` for registrations that wait, cancelling a push under way). What
must hold: decode's blocks go back (`PushWithdrawn`) as soon as no WRITE can land in them, and
never before: at once if prefill had written nothing or its stopped WRITEs (UCX over TCP) all
ended DONE, at the deadline if prefill cannot say (an earlier version).

Then prefill's worker's own answers (its bookkeeping only, no vLLM, no NIXL): a withdrawal racing
the vLLM thread that just matched the registration, a push submitted but not begun, one under way,
and one never registered.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

from nixl_async import EngineConfig, FinishedRequests, HandshakeError, TransferCancelled, TransferEngine
from nixl_async.testing import TCP_TLS
from nixl_async_vllm.progressive import ProgressiveFeed
from nixl_async_vllm.push_book import (
    NOT_HELD,
    PUSH_TOPIC,
    PUSH_WITHDRAW_TOPIC,
    STOPPING,
    WITHDRAWN,
    PushBook,
    PushGroup,
    PushRegistration,
    base_request_id,
    decode_registration,
    encode_registration,
)
from nixl_async_vllm.push_receive import PushWithdrawn, receive_pushed
from nixl_async_vllm.push_worker import PushConnectorWorker, push_or_tell
from nixl_async_vllm.send_book import SendBook

from .test_push_layouts import LAYERS, Case, Prefill, _geometry, _job, _prefill

SMALL = Case(1, 1, 1, blocks=2)
# 62 MiB in 8 WRITEs (4 heads x 2 layers): over TCP, in flight for tens of ms
LARGE = Case(1, 1, 4, blocks=62, head_dim=128, block_size=256, decode_cache_blocks=64)


@contextlib.asynccontextmanager
async def _decode(case: Case, name: str, **config: Any) -> AsyncIterator[tuple[TransferEngine, tuple[str, int], Any]]:
    async with TransferEngine(EngineConfig(engine_id=name, **config)) as decode:
        caches = [torch.zeros(case.shape(1, case.decode_block_size, case.decode_cache_blocks), dtype=torch.bfloat16)
                  for _ in range(LAYERS)]  # fmt: skip
        decode.register("kv", caches, num_blocks=case.decode_cache_blocks)
        yield decode, await decode.serve("127.0.0.1", 0), caches


async def _receive(case: Case, prefill: Prefill, decode: TransferEngine, address: tuple[str, int],
                   withdrawal: asyncio.Event, deadline_s: float) -> asyncio.Task[None]:  # fmt: skip
    job = _job(case, prefill.name, prefill.port, "req-d")
    return asyncio.create_task(receive_pushed(decode, _geometry(case, 1, 0, case.decode_block_size), job, address,
                                              deadline=time.time() + deadline_s, margin_s=2.0,
                                              withdrawal=withdrawal))  # fmt: skip


async def _until(condition: Callable[[], Any], timeout: float = 10.0) -> None:
    ends = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < ends, "timed out"
        await asyncio.sleep(0.001)


async def _given_up(receiving: asyncio.Task[None]) -> float:
    """Seconds until `receiving` raised `PushWithdrawn`."""
    began = time.monotonic()
    with pytest.raises(PushWithdrawn):
        await receiving
    return time.monotonic() - began


async def test_a_registration_prefill_holds_is_withdrawn_and_the_blocks_go_back_at_once():
    """Before, decode had no way to give up: it held the blocks until the push came or the deadline."""
    async with _prefill(SMALL) as prefill, _decode(SMALL, "push-withdraw-waiting") as (decode, address, _caches):
        book = PushBook()
        engine = prefill.engines[0]
        engine.handle_calls(PUSH_TOPIC, lambda _s, payload: book.register(decode_registration(payload), 0.0) or b"ok")
        engine.handle_calls(
            PUSH_WITHDRAW_TOPIC, lambda _s, payload: WITHDRAWN if book.withdraw(decode_registration(payload)) else b"?"
        )
        withdrawal = asyncio.Event()
        receiving = await _receive(SMALL, prefill, decode, address, withdrawal, deadline_s=60)
        await _until(lambda: book.waiting() == 1)
        withdrawal.set()
        assert await _given_up(receiving) < 1.0
        assert [r.write for r in book.finished("req-p-0badf00d", ([0, 1],))] == [False], "prefill writes nothing"


async def test_a_registration_prefill_refuses_fails_the_request_once_nothing_can_land_not_at_the_deadline():
    """Before session 37 a failed registration call held decode's blocks until its deadline (480 s by default)."""
    async with _prefill(SMALL) as prefill, _decode(SMALL, "push-refused") as (decode, address, _caches):
        engine = prefill.engines[0]

        def refuse(_sender: str, _payload: bytes) -> bytes:
            raise ValueError("not taking registrations")

        engine.handle_calls(PUSH_TOPIC, refuse)
        withdrawals: list[PushRegistration] = []
        engine.handle_calls(PUSH_WITHDRAW_TOPIC, lambda _s, payload: withdrawals.append(decode_registration(payload))
                            or NOT_HELD)  # fmt: skip
        began = time.monotonic()
        receiving = await _receive(SMALL, prefill, decode, address, asyncio.Event(), deadline_s=60)
        with pytest.raises(HandshakeError):
            await receiving
        # the refusal may come after prefill took it (a lost reply): withdrawn, then the margin for bytes in flight
        assert time.monotonic() - began < 10
        assert [r.write for r in withdrawals] == [False]


async def test_a_registration_too_large_to_send_fails_the_request_at_once():
    """(A prefill whose side channel takes 2 KiB, said in its handshake reply.) Before session 37 the call refused
    it unsent, yet decode held the blocks until its deadline; the adapter's engines now take calls of 1 MiB
    (`MAX_CALL_BYTES`)."""
    async with _prefill(SMALL, max_request_bytes=2048) as prefill, _decode(SMALL, "push-too-large") as (
        decode, address, _caches
    ):  # fmt: skip
        engine = prefill.engines[0]
        engine.handle_calls(PUSH_TOPIC, lambda _s, _p: b"ok")
        engine.handle_calls(PUSH_WITHDRAW_TOPIC, lambda _s, _p: NOT_HELD)
        job = _job(SMALL, prefill.name, prefill.port, "req-d")
        job = dataclasses.replace(job, request_id="r" * 3000)  # the registration outgrows the call
        began = time.monotonic()
        with pytest.raises(ValueError, match="max_request_bytes"):
            await receive_pushed(decode, _geometry(SMALL, 1, 0, SMALL.decode_block_size), job, address,
                                 deadline=time.time() + 60, margin_s=2.0)  # fmt: skip
        assert time.monotonic() - began < 1.0, "nothing was sent: nothing can land"


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_push_in_flight_is_stopped_and_the_blocks_go_back_once_nothing_can_land(monkeypatch, cancels):
    """With `cancels` 2 the push is cancelled again 2 ms after the withdrawal's cancel (prefill aborting the
    request as decode withdraws it): before, that cut the push's settling short, decode was never told and
    held its blocks to the deadline."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)  # read when the agents' UCX workers are created
    async with _prefill(LARGE) as prefill, _decode(LARGE, f"push-withdraw-in-flight-{cancels}") as (
        decode, address, caches,
    ):  # fmt: skip
        engine, geometry = prefill.engines[0], prefill.geometries[0]
        pushes: list[asyncio.Task[Any]] = []
        plain_start, never = engine.start_write, asyncio.Event()

        async def start_write(*args: Any, notify: bytes | None = None, **kwargs: Any) -> Any:
            if notify is not None:  # the part that would complete the push waits: it must be stopped
                await never.wait()
            return await plain_start(*args, notify=notify, **kwargs)

        monkeypatch.setattr(engine, "start_write", start_write)

        def register(_sender: str, payload: bytes) -> bytes:
            pushes.append(asyncio.get_running_loop().create_task(
                push_or_tell(engine, geometry, (LARGE.prefill_ids,), decode_registration(payload))))  # fmt: skip
            return b"ok"

        def withdraw(_sender: str, _payload: bytes) -> bytes:
            pushes[0].cancel()  # the push tells decode once NIXL let go of its WRITEs
            if cancels == 2:
                asyncio.get_running_loop().call_later(0.002, pushes[0].cancel)
            return STOPPING

        engine.handle_calls(PUSH_TOPIC, register)
        engine.handle_calls(PUSH_WITHDRAW_TOPIC, withdraw)
        withdrawal = asyncio.Event()
        receiving = await _receive(LARGE, prefill, decode, address, withdrawal, deadline_s=60)
        await _until(lambda: engine.live_handles().get("xfers"))
        withdrawal.set()
        took = await _given_up(receiving)
        with pytest.raises(asyncio.CancelledError):
            await pushes[0]
        # The stopped WRITEs ended DONE (their bytes in place): no margin to wait (before: WRITE_MARGIN_S).
        assert took < 1.0, f"gave the blocks back after {took:.1f}s"
        assert engine.live_handles().get("xfers", 0) == 0
        ended = [c.clone() for c in caches]
        await asyncio.sleep(0.5)  # decode's poller keeps progressing UCX meanwhile
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ended, caches, strict=True)), (
            "bytes landed after decode gave up"
        )  # (bytes: bf16 NaNs compare unequal)


async def test_a_prefill_that_cannot_withdraw_keeps_the_blocks_held_until_the_deadline():
    """A prefill of an earlier version answers no withdrawal: its registration may still be written."""
    async with _prefill(SMALL) as prefill, _decode(SMALL, "push-withdraw-old") as (decode, address, _caches):
        got: list[bytes] = []
        prefill.engines[0].handle_calls(PUSH_TOPIC, lambda _s, payload: got.append(payload) or b"ok")
        withdrawal = asyncio.Event()
        receiving = await _receive(SMALL, prefill, decode, address, withdrawal, deadline_s=3)
        await _until(lambda: got)
        withdrawal.set()
        assert await _given_up(receiving) > 2.5, "handed back while the registration could still be written"


async def test_a_withdrawal_before_anything_was_registered_registers_nothing_and_tells_prefill():
    """Prefill learns the request has no reader here (else it holds the request for a lease)."""
    async with _prefill(SMALL) as prefill, _decode(SMALL, "push-withdraw-early") as (decode, address, _caches):
        got: list[bytes] = []
        withdrawn: list[PushRegistration] = []
        prefill.engines[0].handle_calls(PUSH_TOPIC, lambda _s, payload: got.append(payload) or b"ok")
        prefill.engines[0].handle_calls(
            PUSH_WITHDRAW_TOPIC, lambda _s, payload: withdrawn.append(decode_registration(payload)) or NOT_HELD
        )
        withdrawal = asyncio.Event()
        withdrawal.set()
        receiving = await _receive(SMALL, prefill, decode, address, withdrawal, deadline_s=60)
        assert await _given_up(receiving) < 1.0, "nothing was registered: nothing to wait for"
        assert got == [] and [r.write for r in withdrawn] == [False]


# -- prefill's worker: its answers, racing vLLM's thread -------------------------------------------
REQUEST = "cmpl-r-0-0badf00d"  # prefill's id: the proxy's, with vLLM's suffix


class _Prefill:
    """A prefill `PushConnectorWorker` with only its push bookkeeping (a stand-in for the facade records calls)."""

    def __init__(self) -> None:
        self.submitted: list[tuple[str, Any]] = []
        self.cancelled: list[str] = []
        worker = object.__new__(PushConnectorWorker)
        worker._book, worker._sends, worker._push_ids = PushBook(), SendBook(base_id=base_request_id), {}
        worker._push_lock, worker._pushing, worker._withdrawn_pushes, worker._cancelled = (
            threading.Lock(),
            set(),
            set(),
            set(),
        )
        worker.tp_size = 1
        worker._held_after_abort = set()
        worker.sync = SimpleNamespace(submit=lambda push_id, *args: self.submitted.append((push_id, args[-1])),
                                      cancel=self.cancelled.append)  # fmt: skip
        self.worker = worker
        worker._sends.in_batch({REQUEST})
        worker._sends.hold(REQUEST, time.perf_counter() + 60)

    def withdraw(self, registration: PushRegistration) -> bytes:
        payload = encode_registration(msgspec.structs.replace(registration, write=False))
        return self.worker._answer_withdrawal("decode", payload)

    def freed(self) -> bool:
        read, _expired = self.worker._sends.collect(time.perf_counter())
        return REQUEST in read


def _registration(decode_request_id: str = "cmpl-d-0-12345678") -> PushRegistration:
    return PushRegistration(
        request_id="cmpl-r-0", decode_request_id=decode_request_id, decode_engine_id="d/tp0", decode_host="h",
        decode_port=1, decode_tp=1, decode_pages=1, groups=[PushGroup("full", [7])], write=True,
        write_by=time.time() + 300,
    )  # fmt: skip


def test_a_withdrawal_between_the_match_and_the_push_s_start_leaves_nothing_to_write():
    """vLLM's thread took the registration from the book, then the loop answered the withdrawal, then the
    thread went on to start the push. Before, the answer saw no push ("not held": decode freed its blocks
    after the margin) and the push started after it, free to write until write_by."""
    prefill, registration = _Prefill(), _registration()
    assert prefill.worker._book.register(registration, time.time()) is None
    taken = prefill.worker._book.finished(REQUEST, ([1],))  # vLLM's thread
    assert prefill.withdraw(registration) == NOT_HELD  # the loop
    for matched in taken:  # vLLM's thread again
        prefill.worker._start_push(REQUEST, ([1],), matched)
    assert prefill.submitted == [], "a push started after decode withdrew"
    assert prefill.freed(), "the withdrawn reader counts as served"


def test_a_push_withdrawn_before_it_began_writes_nothing_and_says_so():
    """Before, it was cancelled before it ran: nothing told decode, which held its blocks to the deadline."""
    prefill, registration = _Prefill(), _registration()
    prefill.worker._book.finished(REQUEST, ([1],))
    prefill.worker._start_push(*prefill.worker._book.register(registration, time.time()))
    ((push_id, _),) = prefill.submitted
    assert prefill.withdraw(registration) == WITHDRAWN and prefill.cancelled == []
    assert not prefill.worker._begin(push_id), "the push's coroutine returns at once"


@pytest.mark.parametrize("began", [False, True])
def test_a_push_cancelled_before_its_coroutine_ran_tells_decode(began):
    """(A lease ending, or prefill aborting, right as the push was submitted.) Before session 37 nothing told
    decode, which held its blocks to the deadline; a push that began tells decode itself (`push_or_tell`)."""
    prefill, registration = _Prefill(), _registration()
    worker = prefill.worker
    spawned: list[tuple[Any, ...]] = []
    worker.sync.spawn = lambda *args: spawned.append(args)
    worker._withdrawals, worker._withdrawn_requests, worker._record = {}, set(), lambda *args: None
    worker._book.finished(REQUEST, ([1],))
    worker._start_push(*worker._book.register(registration, time.time()))
    ((push_id, _),) = prefill.submitted
    if began:
        assert worker._begin(push_id)
    finished = worker._own_finished(FinishedRequests(failed={push_id: TransferCancelled("cancelled")}))
    assert not finished, "a push is the worker's own"
    assert spawned == ([] if began else [(worker._tell_failed, registration)])
    assert prefill.freed(), "its decode rank counts as served"


def test_a_push_under_way_is_cancelled():
    prefill, registration = _Prefill(), _registration()
    prefill.worker._book.finished(REQUEST, ([1],))
    prefill.worker._start_push(*prefill.worker._book.register(registration, time.time()))
    ((push_id, _),) = prefill.submitted
    assert prefill.worker._begin(push_id)
    assert prefill.withdraw(registration) == STOPPING and prefill.cancelled == [push_id]


def test_a_withdrawal_of_a_registration_never_seen_stands_a_reader_in_for_it():
    """Decode gave up before its registration went out (or it is still on its way): prefill frees the request
    once computed, and the registration, should it come, writes nothing and counts no second reader."""
    prefill, registration = _Prefill(), _registration()
    assert prefill.withdraw(registration) == NOT_HELD
    assert prefill.worker._book.register(registration, time.time()) is None, "the late registration is dropped"
    for matched in prefill.worker._book.finished(REQUEST, ([1],)):
        prefill.worker._start_push(REQUEST, ([1],), matched)
    assert prefill.submitted == [] and prefill.freed()


def test_a_push_stopped_by_its_lease_is_not_cancelled_again_by_a_withdrawal():
    prefill, registration = _Prefill(), _registration()
    worker = prefill.worker
    worker.sync.poke = worker.sync.call_soon = worker.sync.spawn = lambda *args: None
    worker._notifications, worker._record = queue.SimpleQueue(), lambda *args: None
    worker._book.finished(REQUEST, ([1],))
    worker._start_push(*worker._book.register(registration, time.time()))
    ((push_id, _),) = prefill.submitted
    assert worker._begin(push_id)
    worker._sends.hold(REQUEST, time.perf_counter() - 1)  # its lease ran out
    worker._finished_sending()  # closing: a push still reads the blocks
    worker._finished_sending()  # ... so it is stopped
    assert prefill.cancelled == [push_id]
    assert prefill.withdraw(registration) == STOPPING
    assert prefill.cancelled == [push_id], "cancelled again"


def test_a_progressive_push_stopped_by_an_abort_is_not_cancelled_again():
    prefill, registration = _Prefill(), _registration()
    worker = prefill.worker
    worker.sync.poke = worker.sync.call_soon = worker.sync.spawn = lambda *args: None
    worker._notifications, worker._record = queue.SimpleQueue(), lambda *args: None
    worker._book.register(registration, time.time())
    (claimed,) = worker._book.claim(REQUEST)
    push_id = worker._claim_push_id(REQUEST, claimed)
    worker._feeds = {REQUEST: [ProgressiveFeed(push_id, 1)]}
    assert worker._begin(push_id)
    worker._abandon(REQUEST)  # start_load_kv: vLLM aborted it
    worker._finished_sending()  # the same step's results: the request closing, its push running
    assert prefill.withdraw(registration) == STOPPING
    assert prefill.cancelled == [push_id], "cancelled again"


def test_a_request_aborted_under_its_progressive_push_is_reported_sent_once_the_push_ended():
    """The scheduler holds an aborted request's blocks while it was followed (`push_held_after_abort`):
    the worker reports it sent (vLLM frees the blocks) only once its push no longer reads them, and once."""
    prefill, registration = _Prefill(), _registration()
    worker = prefill.worker
    worker.sync.poke = worker.sync.call_soon = worker.sync.spawn = lambda *args: None
    worker._notifications, worker._record, worker._withdrawals = queue.SimpleQueue(), lambda *args: None, {}
    worker._sends = SendBook(base_id=base_request_id)  # aborted: vLLM handed no lease to hold it by
    worker._book.register(registration, time.time())
    (claimed,) = worker._book.claim(REQUEST)
    push_id = worker._claim_push_id(REQUEST, claimed)
    worker._feeds = {REQUEST: [ProgressiveFeed(push_id, 1)]}
    assert worker._begin(push_id)
    worker._abandon(REQUEST)
    worker._held_after_abort.add(REQUEST)
    assert REQUEST not in worker._finished_sending(), "freed while its push may still read the blocks"
    stopped = TransferCancelled("cancelled", peer="d/tp0")
    worker._own_finished(FinishedRequests(done=set(), failed={push_id: stopped}, fenced={}))
    assert REQUEST in worker._finished_sending()
    assert REQUEST not in worker._finished_sending()


def test_an_abort_after_the_progressive_push_ended_cancels_and_keeps_nothing():
    """Before, the ended push's id was cancelled and remembered as cancelled for good (one id per such abort)."""
    prefill, registration = _Prefill(), _registration()
    worker = prefill.worker
    worker.sync.poke = worker.sync.call_soon = worker.sync.spawn = lambda *args: None
    worker._notifications, worker._record, worker._withdrawals = queue.SimpleQueue(), lambda *args: None, {}
    worker._book.register(registration, time.time())
    (claimed,) = worker._book.claim(REQUEST)
    push_id = worker._claim_push_id(REQUEST, claimed)
    worker._feeds = {REQUEST: [ProgressiveFeed(push_id, 1)]}
    assert worker._begin(push_id)
    worker._own_finished(FinishedRequests(done={push_id}, failed={}, fenced={}))  # it ended, reported
    worker._abandon(REQUEST)  # then vLLM aborted the request
    assert prefill.cancelled == [] and worker._cancelled == set()


def test_a_registration_whose_write_by_is_not_a_finite_time_is_refused():
    """NaN or infinite, it was held for ever: never written by, never expired."""
    for write_by in (float("nan"), float("inf")):
        fields = msgspec.structs.asdict(_registration()) | {"write_by": write_by}  # (as another process sends it)
        payload = msgspec.msgpack.encode(fields)
        with pytest.raises(ValueError, match="write_by"):
            decode_registration(payload)


def _two_attempts_pushing() -> tuple[_Prefill, str, str]:
    """(prefill, the first attempt's push, the retry's): two decode requests of one decode rank registered for one
    prefill request (a retry reusing the X-Request-Id), both pushes begun."""
    prefill = _Prefill()
    worker = prefill.worker
    worker.sync.poke = worker.sync.call_soon = worker.sync.spawn = lambda *args: None
    worker._notifications, worker._record, worker._withdrawals = queue.SimpleQueue(), lambda *args: None, {}
    worker._book.finished(REQUEST, ([1],))
    for attempt in ("cmpl-d-0-11111111", "cmpl-d-0-22222222"):
        worker._start_push(*worker._book.register(_registration(attempt), time.time()))
    (first, _), (retry, _) = prefill.submitted
    assert worker._begin(first) and worker._begin(retry)
    return prefill, first, retry


def test_a_retry_s_push_runs_on_when_the_first_attempt_s_push_ends():
    """The first push ends: every reader the request expected is served, but the retry's push still reads the
    blocks. Before session 40 the request closing made the next step cancel that push (decode told it failed);
    now it runs to its end and the blocks go back after it, unless the lease runs out first (that stops it, as it
    stops pushes of a request no reader was served for)."""
    prefill, first, retry = _two_attempts_pushing()
    worker = prefill.worker
    assert not worker._own_finished(FinishedRequests(done={first}, failed={}, fenced={}))
    for _ in range(2):
        assert REQUEST not in worker._finished_sending(), "freed while the retry's push reads the blocks"
    assert prefill.cancelled == [], "the retry's push was stopped"
    worker._sends.hold(REQUEST, time.perf_counter() - 1)  # ... until its lease runs out: then it is stopped
    worker._finished_sending()
    worker._finished_sending()
    assert prefill.cancelled == [retry], "the retry's push outlived the lease"
    worker._own_finished(FinishedRequests(done={retry}, failed={}, fenced={}))
    assert REQUEST in worker._finished_sending()


def test_a_lease_run_out_stops_both_attempts_pushes():
    prefill, first, retry = _two_attempts_pushing()
    prefill.worker._sends.hold(REQUEST, time.perf_counter() - 1)
    prefill.worker._finished_sending()
    prefill.worker._finished_sending()
    assert sorted(prefill.cancelled) == sorted([first, retry])
