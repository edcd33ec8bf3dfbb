"""The sync facade, driven from plain threads against a real peer process."""

import asyncio
import contextlib
import queue
import socket
import sys
import threading
import time

import numpy as np
import pytest

from nixl_async import (
    EngineClosedError,
    EngineConfig,
    HandshakeTimeout,
    LayoutError,
    NotificationFailed,
    PollConfig,
    SyncEngine,
    TransferCancelled,
    WrongThreadError,
)
from nixl_async._agent import NIXL_ERRORS
from nixl_async._notify_transport import NotificationTransport
from nixl_async.testing import Notify, WaitNotifications, verify_blocks

BLOCK = 4096


@pytest.fixture
def sync_engine():
    engine = SyncEngine(EngineConfig(engine_id="sync-local"))
    yield engine
    engine.close()
    assert engine.engine.live_handles() == {}


def _wait_finished(engine, want, timeout=30.0):
    done, failed = set(), {}
    deadline = time.monotonic() + timeout
    while len(done) + len(failed) < want and time.monotonic() < deadline:
        got = engine.get_finished()
        done |= got.done
        failed.update(got.failed)
        time.sleep(0.002)
    return done, failed


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_reads_from_many_threads(sync_engine, nixl_peer):
    regions = [np.zeros(64 * BLOCK, np.uint8) for _ in range(2)]
    sync_engine.register("kv", regions, block_len=BLOCK)
    host, port = nixl_peer.address

    def worker(k):
        for j in range(4):
            local = [k * 8 + j * 2, k * 8 + j * 2 + 1]
            sync_engine.submit_read(f"req-{k}-{j}", host, port, local, [63 - x for x in local], notify=b"n")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done, failed = _wait_finished(sync_engine, 16)
    assert failed == {} and done == {f"req-{k}-{j}" for k in range(4) for j in range(4)}
    assert verify_blocks(regions, BLOCK, range(32), [63 - x for x in range(32)], seed=1) == []
    assert nixl_peer.request_sync(WaitNotifications(message=b"n", count=16, timeout=10)) is not None
    assert sync_engine.stats().counters["handshakes"] == 1


def test_failures_arrive_typed(sync_engine, nixl_peer):
    sync_engine.register("kv", [np.zeros(64 * BLOCK, np.uint8) for _ in range(2)], block_len=BLOCK)
    sync_engine.submit_read("dead", "127.0.0.1", _free_port(), [0], [0], handshake_timeout=0.3)
    sync_engine.submit_read("bad-ids", *nixl_peer.address, [0], [64])
    done, failed = _wait_finished(sync_engine, 2)
    assert done == set()
    assert isinstance(failed["dead"], HandshakeTimeout)
    assert isinstance(failed["bad-ids"], LayoutError)
    with pytest.raises(HandshakeTimeout):  # blocking calls re-raise in the caller's thread
        sync_engine.connect("127.0.0.1", _free_port(), timeout=0.2)


def test_a_read_whose_notice_alone_failed_leaves_its_request_done(sync_engine, nixl_peer, monkeypatch):
    """The data arrived and the request's coroutine went on past the failed notice (vLLM's adapter
    does: the producer frees its blocks at its lease's end): the request is done, not failed."""
    regions = [np.zeros(64 * BLOCK, np.uint8) for _ in range(2)]
    sync_engine.register("kv", regions, block_len=BLOCK)
    info = sync_engine.connect(*nixl_peer.address)

    def refuse(self, peer, message):
        raise NIXL_ERRORS[0]("NIXL_ERR_NOT_FOUND")

    monkeypatch.setattr(NotificationTransport, "send", refuse)

    async def read_past_the_notice(engine):
        transfer = await engine.start_read(engine.peer(info.engine_id), [0, 1], [5, 6], notify=b"req-p:1")
        with pytest.raises(NotificationFailed):
            await transfer

    sync_engine.submit("req", read_past_the_notice)
    done, failed = _wait_finished(sync_engine, 1)
    assert (done, failed) == ({"req"}, {})
    assert verify_blocks(regions, BLOCK, [0, 1], [5, 6], seed=1) == []


def test_duplicate_request_ids_are_refused(sync_engine, nixl_peer_factory):
    peer = nixl_peer_factory(num_regions=1, num_blocks=32, block_len=1 << 20, tcp=True)
    sync_engine.register("kv", [np.zeros(32 << 20, np.uint8)], block_len=1 << 20)
    sync_engine.submit_read("r", *peer.address, range(32), range(32))
    with pytest.raises(ValueError, match="already has work"):
        sync_engine.submit_read("r", *peer.address, [0], [0])
    _wait_finished(sync_engine, 1)


def test_reads_in_flight_on_uvloop_with_sub_millisecond_sleeps(nixl_peer_factory):
    """uvloop hands back a bare `Handle` (no `when()`) for a timer under 0.5 ms: a submit that re-arms the poller's
    sleep must not rely on it (it raised AttributeError out of the submit, the read posted and lost)."""
    fast = PollConfig(spin=False, linger_s=0.0, busy_interval_s=0.0002, backoff_start_s=0.0002, idle_interval_s=0.0002)
    peer = nixl_peer_factory(num_regions=1, num_blocks=8, block_len=256 << 10, tcp=True)  # in flight after the post
    engine = SyncEngine(EngineConfig(engine_id="sync-fast-poll", poll=fast), use_uvloop=True)
    try:
        engine.register("kv", [np.zeros(8 << 18, np.uint8)], block_len=256 << 10)
        for i in range(20):
            engine.submit_read(f"r{i}", *peer.address, [i % 8], [i % 8])
            done, failed = _wait_finished(engine, 1)
            assert done == {f"r{i}"}, failed
    finally:
        engine.close()
    assert engine.engine.live_handles() == {}


def test_cancel_from_a_thread(sync_engine, nixl_peer_factory):
    peer = nixl_peer_factory(num_regions=1, num_blocks=64, block_len=1 << 20, tcp=True)
    sync_engine.register("kv", [np.zeros(64 << 20, np.uint8)], block_len=1 << 20)
    sync_engine.connect(*peer.address)
    sync_engine.submit_read("big", *peer.address, range(64), range(64))
    time.sleep(0.01)
    assert sync_engine.cancel("big")
    _done, failed = _wait_finished(sync_engine, 1)
    assert "big" in failed and isinstance(failed["big"], (asyncio.CancelledError, TransferCancelled))
    deadline = time.monotonic() + 5
    while sync_engine.live_handles().get("xfers") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sync_engine.live_handles().get("xfers")


@pytest.mark.parametrize("resubmitted", ["after_the_cancel_ran", "before_the_cancel_ran"])
def test_a_cancel_that_comes_after_its_request_ended_lapses(sync_engine, resubmitted):
    """cancel() saw the request in flight, but by the time the loop ran it the request had ended: the
    cancel lapses. It must not wait for the next request with the id (a push's id comes back), nor fall
    on one that took the id meanwhile (the loop kept busy until that one was submitted)."""
    gate = sync_engine.call(asyncio.Event)

    async def held(_engine):
        await gate.wait()

    sync_engine.submit("req", held)
    time.sleep(0.05)
    busy_after = 0.3 if resubmitted == "before_the_cancel_ran" else 0.0

    def end_then_hold_the_loop():
        gate.set()  # the request ends on the loop's next turns, before cancel's callback runs
        if busy_after:
            asyncio.get_running_loop().call_soon(time.sleep, busy_after)  # ...and the loop stays busy after
        time.sleep(0.05)  # (cancel() below looks meanwhile: the request is still in flight)

    sync_engine.call_soon(end_then_hold_the_loop)
    time.sleep(0.01)
    assert sync_engine.cancel("req")
    done, failed = _wait_finished(sync_engine, 1)
    assert done == {"req"} and not failed

    async def quick(_engine):
        await asyncio.sleep(0.01)

    if not busy_after:
        time.sleep(0.05)  # the cancel's callback has run by now
    sync_engine.submit("req", quick)
    done, failed = _wait_finished(sync_engine, 1)
    assert done == {"req"}, f"a new request with the id was reported {failed}"


def test_notifications_finish_a_request(sync_engine, nixl_peer_factory):
    host, port = sync_engine.serve()
    sync_engine.register("kv", [np.zeros(BLOCK, np.uint8)], block_len=BLOCK)
    peers = [nixl_peer_factory(), nixl_peer_factory()]
    sync_engine.submit_wait_notifications("send-1", b"req-1:2", count=2, timeout=20)
    for p in peers:
        p.request_sync(Notify(host=host, port=port, message=b"req-1:2"))
    done, failed = _wait_finished(sync_engine, 1)
    assert done == {"send-1"} and failed == {}


def test_submit_and_get_finished_do_not_wait_for_a_busy_loop(sync_engine, nixl_peer):
    sync_engine.register("kv", [np.zeros(64 * BLOCK, np.uint8) for _ in range(2)], block_len=BLOCK)
    sync_engine.connect(*nixl_peer.address)
    blocker = threading.Thread(target=sync_engine.call, args=(lambda: time.sleep(0.5),))
    blocker.start()
    time.sleep(0.05)  # the loop thread is now stuck in time.sleep for ~0.45 s
    started = time.monotonic()
    sync_engine.submit_read("r1", *nixl_peer.address, [0], [1])
    sync_engine.get_finished()
    assert time.monotonic() - started < 0.2
    blocker.join()
    done, _ = _wait_finished(sync_engine, 1)
    assert done == {"r1"}


def test_pokes_the_loop_has_not_taken_yet_are_one_wake_up(sync_engine):
    """vLLM steps a producer back to back; every step pokes. Pokes pending on a busy loop are one."""
    woken = []
    sync_engine.call(lambda: setattr(sync_engine.engine, "poll_soon", lambda: woken.append(time.monotonic())))
    blocker = threading.Thread(target=sync_engine.call, args=(lambda: time.sleep(0.3),))
    blocker.start()
    time.sleep(0.05)  # the loop thread is stuck in time.sleep
    for _ in range(100):
        sync_engine.poke()
    blocker.join()
    sync_engine.call(lambda: None)  # the loop has run what was queued
    assert len(woken) == 1
    sync_engine.poke()  # taken: the next poke wakes it again
    sync_engine.call(lambda: None)
    assert len(woken) == 2


def test_call_soon_runs_on_the_loop_thread_in_order_without_waiting(sync_engine):
    seen: list[tuple[int, str]] = []
    blocker = threading.Thread(target=sync_engine.call, args=(lambda: time.sleep(0.3),))
    blocker.start()
    time.sleep(0.05)  # the loop is busy: call_soon must not wait for it
    started = time.monotonic()
    for i in range(3):
        sync_engine.call_soon(lambda i: seen.append((i, threading.current_thread().name)), i)
    assert time.monotonic() - started < 0.05 and seen == []
    blocker.join()
    sync_engine.call(lambda: None)
    assert [i for i, _ in seen] == [0, 1, 2]
    assert {name for _, name in seen} == {sync_engine.call(lambda: threading.current_thread().name)}


def test_wait_activity_returns_when_a_request_ends_and_not_before(sync_engine):
    """An idle vLLM step waits here for its transfers instead of spinning: woken by the end, never late."""

    async def ends_later(engine, delay):
        await asyncio.sleep(delay)

    started = time.monotonic()
    assert not sync_engine.wait_activity(0.05), "nothing happened"
    assert 0.05 <= time.monotonic() - started < 0.5
    sync_engine.submit("r", ends_later, 0.1)
    started = time.monotonic()
    assert sync_engine.wait_activity(5.0)
    assert 0.09 <= time.monotonic() - started < 1.0, "woken when the request ended"
    assert sync_engine.get_finished().done == {"r"}
    sync_engine.submit("s", ends_later, 0.0)
    time.sleep(0.2)  # it ended while nobody waited: the next wait returns at once
    started = time.monotonic()
    assert sync_engine.wait_activity(5.0) and time.monotonic() - started < 0.05


def test_wait_activity_pokes_the_loop_while_it_waits(sync_engine):
    woken = []
    sync_engine.call(lambda: setattr(sync_engine.engine, "poll_soon", lambda: woken.append(time.monotonic())))
    sync_engine.wait_activity(0.05, poke_every=0.005)
    sync_engine.call(lambda: None)
    assert 4 <= len(woken) <= 11


def test_caller_thread_never_touches_the_agent(sync_engine):
    with pytest.raises(WrongThreadError):
        sync_engine.engine.register("kv", [np.zeros(BLOCK, np.uint8)], block_len=BLOCK)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_loop_thread_has_its_own_name_in_the_kernel(sync_engine):
    """In a vLLM worker every thread is 'VLLM::Worker': the loop's CPU must be attributable."""
    tid = sync_engine.call(threading.get_native_id)
    with open(f"/proc/self/task/{tid}/comm") as comm:
        assert comm.read().strip() == "nixl-async"
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as comm:
        assert comm.read().strip() != "nixl-async"  # the caller's thread keeps its own name


def test_an_engine_nobody_closed_lets_the_interpreter_exit():
    """An uncaught error before close() (or a forgotten one): the process still exits."""
    script = (
        "import numpy as np\n"
        "from nixl_async import EngineConfig, SyncEngine\n"
        "engine = SyncEngine(EngineConfig(engine_id='forgotten'))\n"
        "engine.register('kv', [np.zeros(1000, np.uint8)], num_blocks=1024)\n"  # raises: 1000 bytes, 1024 blocks
    )
    import subprocess

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "LayoutError" in done.stderr and done.returncode == 1


_DROPPED_AND_FORKED = """
import multiprocessing
from nixl_async import EngineConfig, SyncEngine

def make_and_drop():
    SyncEngine(EngineConfig(engine_id="dropped"))  # never closed, no reference kept

make_and_drop()
kept = SyncEngine(EngineConfig(engine_id="kept"))
child = multiprocessing.get_context("fork").Process(target=print, args=("child",))
child.start()
child.join(20)
print("child exit code", child.exitcode)
"""


def test_a_dropped_engine_and_a_forked_child_let_their_processes_exit():
    """An engine dropped without close() still stops at exit; a forked child (torch's DataLoader workers)
    inherits the exit hooks but leaves the parent's engines alone."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _DROPPED_AND_FORKED], capture_output=True, text=True, timeout=90)
    assert "child exit code 0" in done.stdout and done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_close_from_the_loop_thread_is_refused(sync_engine):
    with pytest.raises(WrongThreadError, match="loop thread"):
        sync_engine.call(sync_engine.close)
    sync_engine.call(lambda: None)  # still running


def test_blocking_calls_from_the_loop_thread_are_refused_at_once(sync_engine):
    """A callback on the loop (`call_soon`, a submitted coroutine) calling the facade's blocking methods
    gets `WrongThreadError` at once; before, anyio's plain RuntimeError, and `wait_activity` blocked
    the loop itself for its whole timeout."""
    seen: queue.SimpleQueue = queue.SimpleQueue()

    def on_loop(name, blocking):
        started = time.monotonic()
        try:
            blocking()
        except Exception as exc:
            seen.put((name, type(exc), time.monotonic() - started))

    for name, blocking in [("stats", sync_engine.stats), ("wait_activity", lambda: sync_engine.wait_activity(2.0)),
                           ("connect", lambda: sync_engine.connect("127.0.0.1", 1))]:  # fmt: skip
        sync_engine.call_soon(on_loop, name, blocking)
        got, error, took = seen.get(timeout=10)
        assert (got, error) == (name, WrongThreadError) and took < 0.5, (got, error, took)


def test_closed_engine_refuses_work():
    engine = SyncEngine(EngineConfig(engine_id="closing"))
    engine.register("kv", [np.zeros(BLOCK, np.uint8)], block_len=BLOCK)
    engine.close()
    assert engine.engine.live_handles() == {}
    with pytest.raises(EngineClosedError):
        engine.submit_read("x", "127.0.0.1", 1, [0], [0])
    engine.close()  # idempotent


def test_bad_arguments_are_refused_at_once_and_lose_nothing(sync_engine):
    """A plain function given to `submit` (before: accepted, never reported, its id blocked for good),
    and a NaN or negative wait or poke period (before: a wait that never ended, or spun a core)."""

    def not_a_coroutine(engine):
        return None

    async def ends(engine):
        return None

    with pytest.raises(TypeError, match="coroutine function"):
        sync_engine.submit("r", not_a_coroutine)
    assert sync_engine.in_flight == 0
    sync_engine.submit("r", ends)  # the id is free
    assert _wait_finished(sync_engine, 1) == ({"r"}, {})
    for bad in ({"timeout": float("nan")}, {"timeout": -1.0}, {"timeout": 1.0, "poke_every": 0.0},
                {"timeout": 1.0, "poke_every": float("nan")}):  # fmt: skip
        started = time.monotonic()
        with pytest.raises(ValueError):
            sync_engine.wait_activity(**bad)
        assert time.monotonic() - started < 0.5


def test_a_request_id_is_free_only_once_its_outcome_can_be_read(sync_engine):
    """Before, the id was freed (`in_flight` 0, the id taken again) before the outcome was queued: a
    caller that saw nothing in flight and nothing finished could resubmit the id, then read the old
    request's outcome as the new one's. The queueing is slowed here to widen that window."""

    class SlowQueue(queue.SimpleQueue):
        def put(self, item, block=True, timeout=None):
            time.sleep(0.2)
            super().put(item)

    sync_engine._finished = SlowQueue()

    async def ends(engine):
        return None

    sync_engine.submit("r", ends)
    seen: set[str] = set()
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        idle = sync_engine.in_flight == 0
        seen = sync_engine.get_finished().done
        assert seen or not idle, "no work in flight and no outcome to read"
    assert seen == {"r"}


def test_close_cancels_a_call_still_running_and_a_second_close_waits_for_it():
    """A `call()` of a coroutine that would run 30 s held `close()` for all of it (and the interpreter's
    exit); a `close()` from another thread meanwhile returned at once, before the engine had closed."""
    engine = SyncEngine(EngineConfig(engine_id="closing-calls"))
    engine.register("kv", [np.zeros(BLOCK, np.uint8)], block_len=BLOCK)  # a handle until the engine closes
    outcome: dict[str, object] = {}

    def long_call():
        try:
            engine.call(asyncio.sleep, 30)
        except BaseException as exc:  # what the caller sees
            outcome["call"] = exc

    caller = threading.Thread(target=long_call)
    caller.start()
    time.sleep(0.2)
    returned: list[bool] = []  # for each close(), whether the engine had closed when it returned

    def close():
        engine.close()
        returned.append(engine.engine.live_handles() == {})

    closers = [threading.Thread(target=close) for _ in range(2)]
    started = time.monotonic()
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(10)
    assert time.monotonic() - started < 5, "close() waited for the running call"
    assert returned == [True, True], "a close() returned before the engine had closed"
    caller.join(10)
    assert isinstance(outcome.get("call"), EngineClosedError)


def test_the_notification_feed_goes_on_after_more_arrived_at_once_than_it_may_hold():
    """More notifications in one drain than `max_unclaimed_notifications`: those over are lost (logged),
    and the feed goes on with what comes next (its subscription would otherwise have ended for good)."""
    with SyncEngine(EngineConfig(engine_id="sync-flooded", max_unclaimed_notifications=8)) as engine:
        feed = engine.feed_notifications()

        def flood() -> None:  # one drain's worth, as the poller delivers it
            for i in range(20):
                engine.engine._notifications.deliver("p", b"n%d" % i)

        engine.call(flood)
        engine.call(lambda: engine.engine._notifications.deliver("p", b"after"))
        got = []
        deadline = time.monotonic() + 5
        while b"after" not in got and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                got.append(feed.get(timeout=0.1).message)
        assert got[:8] == [b"n%d" % i for i in range(8)] and got[-1] == b"after"


def test_a_transfer_is_checked_and_copied_on_the_submitting_thread(sync_engine, nixl_peer):
    """Before: an `op` other than "READ" ran as a WRITE into the peer (reported done), a bad part or
    option failed later, untyped, and the block ids were read on the loop after submit returned,
    so a caller reusing its list moved blocks it never named for that request."""
    regions = [np.zeros(64 * BLOCK, np.uint8) for _ in range(2)]
    sync_engine.register("kv", regions, block_len=BLOCK)
    host, port = nixl_peer.address
    part = {"host": host, "port": port, "local_blocks": [0], "remote_blocks": [0]}
    with pytest.raises(ValueError, match="op must be"):
        sync_engine.submit_transfers("t", [{**part, "op": "read"}])
    with pytest.raises(ValueError, match="lacks \\['port'\\]"):
        sync_engine.submit_transfers("t", [{k: v for k, v in part.items() if k != "port"}])
    with pytest.raises(TypeError, match="timout"):
        sync_engine.submit_transfers("t", [{**part, "timout": 1}])
    with pytest.raises(TypeError, match="timout"):
        sync_engine.submit_read("t", host, port, [0], [0], timout=1)
    assert sync_engine.in_flight == 0  # nothing was submitted: the id is free

    local, remote = [0, 1], [62, 63]
    unblock = threading.Event()
    sync_engine.call_soon(unblock.wait, 5)  # the loop takes the request only once the lists changed
    sync_engine.submit_read("a", host, port, local, remote)
    local[:], remote[:] = [5, 6], [10, 11]
    unblock.set()
    assert _wait_finished(sync_engine, 1) == ({"a"}, {})
    assert verify_blocks(regions, BLOCK, [0, 1], [62, 63], seed=1) == []
    assert not any(r[5 * BLOCK : 7 * BLOCK].any() for r in regions)

    # Torch tensors of ids (a block table): before, list() of one kept views of its storage, so a refill moved
    # the blocks written after submit returned.
    import torch

    local_t, remote_t = torch.tensor([2, 3]), torch.tensor([60, 61])
    unblock = threading.Event()
    sync_engine.call_soon(unblock.wait, 5)
    sync_engine.submit_read("b", host, port, local_t, remote_t)
    local_t[:], remote_t[:] = torch.tensor([7, 8]), torch.tensor([12, 13])
    unblock.set()
    assert _wait_finished(sync_engine, 1) == ({"b"}, {})
    assert verify_blocks(regions, BLOCK, [2, 3], [60, 61], seed=1) == []
    assert not any(r[7 * BLOCK : 9 * BLOCK].any() for r in regions)


def test_one_id_reports_one_outcome_per_drain(sync_engine):
    """An id submitted again after it ended, both runs ending before one `get_finished`: before, the
    drain showed it done and failed at once (or one of two failures vanished)."""
    outcomes = iter([None, RuntimeError("second"), RuntimeError("third")])

    async def ends(engine):
        error = next(outcomes)
        if error is not None:
            raise error

    for _ in range(3):
        sync_engine.submit("r", ends)
        deadline = time.monotonic() + 5
        while sync_engine.in_flight and time.monotonic() < deadline:
            time.sleep(0.002)
    drains = [sync_engine.get_finished() for _ in range(4)]
    assert drains[0].done == {"r"} and not drains[0].failed
    assert str(drains[1].failed["r"]) == "second" and not drains[1].done
    assert str(drains[2].failed["r"]) == "third"
    assert not drains[3]


def test_wait_activity_hears_close(sync_engine):
    """Before: a thread waiting slept its whole timeout through `close()`, and a wait after it did too."""
    heard: queue.SimpleQueue = queue.SimpleQueue()

    def wait() -> None:
        started = time.monotonic()
        try:
            sync_engine.wait_activity(10)
        except EngineClosedError:
            heard.put(time.monotonic() - started)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)
    sync_engine.close()
    waiter.join(5)
    assert heard.get(timeout=1) < 3
    with pytest.raises(EngineClosedError):
        sync_engine.wait_activity(10)


def test_layouts_are_deregistered_and_raw_layouts_kept_alive_through_the_facade(sync_engine):
    """The facade had no `deregister` (only `sync.call(sync.engine.deregister, ...)`), and its `register_layout`
    dropped the engine's `keepalive`: memory the caller let go could be freed while registered."""
    import weakref

    from nixl_async import BlockLayout, LayoutError, MemType

    sync_engine.register("kv", [np.zeros(4 * BLOCK, np.uint8)], block_len=BLOCK)
    sync_engine.deregister("kv")
    with pytest.raises(LayoutError):
        sync_engine.deregister("kv")
    sync_engine.register("kv", [np.zeros(4 * BLOCK, np.uint8)], block_len=BLOCK)  # the name is free again

    class Owner:  # holds the raw memory, as a caller's allocator object would
        def __init__(self):
            self.array = np.zeros(4 * BLOCK, np.uint8)

    owner = Owner()
    layout = BlockLayout(name="raw", region_addrs=(owner.array.ctypes.data,), num_blocks=4, block_len=BLOCK,
                         mem_type=MemType.DRAM)  # fmt: skip
    sync_engine.register_layout(layout, keepalive=[owner])
    gone = weakref.ref(owner)
    del owner
    assert gone() is not None, "the engine keeps what it was given alive while the memory is registered"
