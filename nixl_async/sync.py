"""The sync facade: an engine on its own loop thread, driven from plain threads.

This is what vLLM's worker needs: `start_load_kv` hands work over and returns at once,
`get_finished` collects finished request ids without waiting on the loop. The caller's thread
never touches the NIXL agent.

- The loop thread and its life come from anyio's `start_blocking_portal` (uvloop where
  available); blocking calls (`register`, `serve`, `connect`, `stats`, `close`) go through
  `BlockingPortal.call`, which re-raises the engine's typed exceptions in the caller.
- A submission is one `call_soon_threadsafe` that starts the task on the loop, and returns at
  once. (The portal's `start_task_soon` waits until the loop has picked the task up, which can
  be a whole slice post when the loop is busy; a vLLM step should not wait for that.
  `run_coroutine_threadsafe` returns at once too, but its concurrent future, which nobody here
  awaits, and the callbacks chaining it cost CPU on both threads: `bench small_reads --quick`,
  reader `facade`, 966-1,018 -> 844-901 us per read without them.)
- Each finished submission puts ``(request_id, outcome)`` on a `queue.SimpleQueue` from the
  loop thread; `get_finished` drains it without locks or waiting.
- A request is reported only once its memory is quiet: every transfer it submitted (child
  tasks included, see `TransferEngine.collect_transfers`) is settled first, whether it
  succeeded, failed or was cancelled. One that NIXL holds past the grace is reported as
  `fenced` at once and as `failed` once NIXL lets go. So a caller (vLLM) never reuses blocks
  NIXL may still write into.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import inspect
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from anyio.from_thread import BlockingPortal, start_blocking_portal

from .config import EngineConfig
from .engine import BlockIds, TransferEngine
from .exceptions import EngineClosedError, NotificationFailed, NotificationsLost, TransferFenced, WrongThreadError
from .layout import BlockLayout
from .notifications import Notification
from .stats import StatsSnapshot

log = logging.getLogger(__name__)

__all__ = ["FinishedRequests", "PeerInfo", "SyncEngine"]


@dataclass(frozen=True)
class PeerInfo:
    """What a thread learns about a connected peer (the `Peer` itself stays on the loop)."""

    engine_id: str
    agent_name: str
    address: tuple[str, int]
    layouts: dict[str, BlockLayout]
    extra: dict[str, str]


@dataclass
class FinishedRequests:
    """Request ids whose work ended since the last `get_finished()`.

    `done` and `failed` requests' memory is quiet: it may be reused. `fenced` requests ended but
    NIXL still holds some of their transfers: do not reuse their memory yet; they show up again
    in `failed` once it is quiet.
    """

    done: set[str] = field(default_factory=set)
    failed: dict[str, BaseException] = field(default_factory=dict)
    fenced: dict[str, BaseException] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.done or self.failed or self.fenced)


def _uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


LOOP_THREAD_NAME = "nixl-async"  # what `top -H`, py-spy and /proc/<pid>/task/*/comm show for the loop thread


def _lost_data(error: BaseException | None) -> bool:
    """Whether a transfer's outcome leaves its request without its data (a READ whose data arrived
    and whose completion notice alone failed does not: the request's coroutine chose to go on)."""
    return error is not None and not (isinstance(error, NotificationFailed) and error.result is not None)


_TRANSFER_OPTIONS = frozenset(
    {"expected_engine_id", "local", "remote", "notify", "timeout", "handshake_timeout", "lease_expires_at"}
)
_PART_KEYS = frozenset({"op", "host", "port", "local_blocks", "remote_blocks"}) | _TRANSFER_OPTIONS


def _copied_ids(ids: BlockIds, what: str) -> BlockIds:
    """`ids` as they are now: the caller's thread returns at once and may reuse its list or array
    before the loop reads it (the transfer would move blocks never named for its request)."""
    if isinstance(ids, np.ndarray):
        return ids.copy()
    if isinstance(ids, range | tuple):
        return ids
    if hasattr(ids, "__array__") and not isinstance(ids, list):  # (a torch tensor: list() keeps views of its storage)
        try:
            return np.asarray(ids).copy()
        except (TypeError, ValueError, RuntimeError) as exc:  # (a CUDA tensor, say)
            raise TypeError(f"{what} must be block ids numpy can read, got {type(ids).__name__}: {exc}") from None
    try:
        return list(cast(Iterable[int], ids))
    except TypeError:
        raise TypeError(f"{what} must be a sequence of block ids, got {type(ids).__name__}") from None


def _transfer_args(
    op: str, host: str, port: int, local_blocks: BlockIds, remote_blocks: BlockIds, options: dict[str, Any]
) -> tuple[str, str, int, BlockIds, BlockIds, dict[str, Any]]:
    """One transfer's arguments, checked and copied on the submitting thread (nothing is submitted if they are bad)."""
    if op not in ("READ", "WRITE"):
        raise ValueError(f"op must be 'READ' or 'WRITE', got {op!r}")
    unknown = sorted(set(options) - _TRANSFER_OPTIONS)
    if unknown:
        raise TypeError(f"unknown transfer option(s) {unknown}; known: {sorted(_TRANSFER_OPTIONS)}")
    local = _copied_ids(local_blocks, "local_blocks")
    remote = _copied_ids(remote_blocks, "remote_blocks")
    return op, host, port, local, remote, dict(options)


def _part_args(part: dict[str, Any]) -> tuple[str, str, int, BlockIds, BlockIds, dict[str, Any]]:
    """A `submit_transfers` part's arguments, checked and copied."""
    if not isinstance(part, dict):
        raise TypeError(f"each part must be a dict, got {type(part).__name__}")
    missing = sorted({"host", "port", "local_blocks", "remote_blocks"} - set(part))
    if missing:
        raise ValueError(f"a part lacks {missing}")
    unknown = sorted(set(part) - _PART_KEYS)
    if unknown:
        raise TypeError(f"unknown part key(s) {unknown}; known: {sorted(_PART_KEYS)}")
    options = {key: value for key, value in part.items() if key in _TRANSFER_OPTIONS}
    return _transfer_args(part.get("op", "READ"), part["host"], part["port"], part["local_blocks"],
                          part["remote_blocks"], options)  # fmt: skip


def _name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the kernel too (Python 3.11 names threads only for Python).

    In a vLLM worker every other thread is called ``VLLM::Worker``: without this, the loop's CPU
    cannot be told from the model thread's. Best effort (Linux only; at most 15 bytes).
    """
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass


class SyncEngine:
    """A `TransferEngine` running on a dedicated loop thread, with thread-safe calls."""

    def __init__(self, config: EngineConfig | None = None, *, use_uvloop: bool | None = None) -> None:
        if use_uvloop is None:
            use_uvloop = _uvloop_available()
        portal_cm = start_blocking_portal("asyncio", {"use_uvloop": use_uvloop}, name="nixl-async-loop")
        self._portal: BlockingPortal = portal_cm.__enter__()
        try:
            self._loop: asyncio.AbstractEventLoop = self._portal.call(asyncio.get_running_loop)
            self._loop_thread: int = self._portal.call(threading.get_ident)
            self._portal.call(_name_os_thread, LOOP_THREAD_NAME)
            self.engine = TransferEngine(config)
            self._portal.call(self.engine.start)
        except BaseException:
            portal_cm.__exit__(None, None, None)
            raise
        self._stopper = _LoopStopper(portal_cm, self._portal, self.engine, self, self._loop)
        self._forked = False  # set in a forked child, which has no loop thread
        self._finished: queue.SimpleQueue[tuple[str, str, BaseException | None]] = queue.SimpleQueue()
        self._held_back: collections.deque[tuple[str, str, BaseException | None]] = collections.deque()  # get_finished
        self._inflight: dict[str, object] = {}  # request -> its submission, until reported
        self._running: dict[str, asyncio.Task[Any]] = {}  # loop thread only
        self._cancel_asked: set[str] = set()  # loop thread only: cancelled before it started
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()  # spawn(): cancelled at close
        self._closed = False
        self._shut = threading.Event()  # set once close() is done
        self._poke_pending = False  # set by the caller's thread, cleared on the loop
        self._activity = threading.Event()  # set when a request ends or a fed notification arrives
        _ENGINES.add(self)

    def _gone(self) -> bool:
        """Closed, or its loop ended without `close()`: a `SystemExit` raised in a task of the loop's own ends
        asyncio's loop (the engine's poller then closes the engine). Every call then raises `EngineClosedError`."""
        return self._closed or self._loop.is_closed()

    def _on_loop(self, callback: Callable[..., object], *args: Any) -> None:
        """`callback(*args)` on the loop thread soon; `EngineClosedError` if its loop has ended meanwhile."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # (the loop ended since it was checked)
            raise self._closed_error() from None

    def _closed_error(self) -> EngineClosedError:
        if not self._closed and self._loop.is_closed():
            return EngineClosedError("the sync engine's loop thread ended without close() (logged there: a "
                                     "SystemExit raised in a task?); its engine closed")  # fmt: skip
        if self._forked:
            return EngineClosedError(
                "this sync engine belongs to the process that created it: its loop thread and "
                "NIXL agent did not come along into this forked child; make a new one here"
            )
        return EngineClosedError("the sync engine is closed")

    def _left_behind_by_fork(self) -> None:
        """In a forked child: the loop thread stayed in the parent, so every call would wait for ever.
        Calls raise `EngineClosedError` instead, `close()` returns at once and the child's exit leaves
        the parent's engine alone. (The locks are new: the parent's may have been held at the fork.)"""
        self._forked = self._closed = True
        self._lock = threading.Lock()
        self._inflight.clear()  # (the parent's requests: nothing here reports them)
        self._finished = queue.SimpleQueue()
        self._held_back.clear()
        self._shut = threading.Event()
        self._shut.set()
        self._activity = threading.Event()
        self._activity.set()
        self._stopper.left_behind()

    # -- blocking calls -------------------------------------------------------------------
    def call(self, func: Any, *args: Any) -> Any:
        """Run `func(*args)` (sync or async) on the loop thread and return its result.

        If this thread is interrupted meanwhile (Ctrl-C), the work on the loop is cancelled too:
        left running, a `wait_notifications` would take the notification the next caller waits for.
        """
        if self._gone():
            raise self._closed_error()
        self._off_the_loop("call()")
        try:
            future = self._portal.start_task_soon(_outcome_of, func, args)
        except RuntimeError:  # (the loop stopped since `_closed` was read: the exit hook, say)
            raise self._closed_error() from None
        try:
            failed, value = future.result()
        except concurrent.futures.CancelledError:
            if self._closed:  # cancelled by close(): the caller did not cancel anything
                raise EngineClosedError(f"the sync engine closed during {func!r}") from None
            raise
        except BaseException:
            future.cancel()  # (the interrupted caller: its coroutine on the loop is cancelled)
            raise
        if failed:
            raise value
        return value

    def _off_the_loop(self, what: str) -> None:
        """Blocking calls wait for the loop thread: from that very thread they could never return."""
        if threading.get_ident() == self._loop_thread:
            raise WrongThreadError(f"{what} blocks until the loop thread answers: on that thread use the "
                                   "TransferEngine (`.engine`) instead")  # fmt: skip

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id

    def register(self, name: str, memory: Any, **kwargs: Any) -> BlockLayout:
        """Register tensors/arrays as layout `name` (see `TransferEngine.register`)."""
        return self.call(lambda: self.engine.register(name, memory, **kwargs))

    def register_layout(self, layout: BlockLayout, *, keepalive: list[Any] | None = None) -> BlockLayout:
        """Register raw memory described by `layout` (see `TransferEngine.register_layout`)."""
        return self.call(lambda: self.engine.register_layout(layout, keepalive=keepalive))

    def deregister(self, name: str) -> None:
        """Deregister layout `name` (see `TransferEngine.deregister`: refused while transfers use it)."""
        self.call(self.engine.deregister, name)

    def set_extra(self, **extra: str) -> None:
        self.call(lambda: self.engine.set_extra(**extra))

    def handle_calls(self, topic: str, handler: Callable[[str, bytes], bytes]) -> None:
        """Answer peers' calls on `topic` (see `TransferEngine.handle_calls`; `handler` runs on the loop)."""

        def guarded(sender: str, payload: bytes) -> bytes:
            try:
                return handler(sender, payload)
            except (Exception, asyncio.CancelledError):
                raise
            except BaseException as exc:  # (SystemExit too: raised on the loop, it would end the loop thread)
                raise RuntimeError(f"the call handler raised {exc!r}") from exc

        self.call(lambda: self.engine.handle_calls(topic, guarded))

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        return self.call(self.engine.serve, host, port)

    def publish(self) -> None:
        """Publish this engine in etcd (see `TransferEngine.publish`)."""
        self.call(self.engine.publish)

    def connect(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        engine_id: str | None = None,
        expected_engine_id: str | None = None,
        timeout: float | None = None,
    ) -> PeerInfo:
        """Handshake now (blocking), or find `engine_id` in etcd, and describe the peer."""

        async def run() -> PeerInfo:
            peer = await self.engine.connect(
                host, port, engine_id=engine_id, expected_engine_id=expected_engine_id, timeout=timeout
            )
            return PeerInfo(peer.engine_id, peer.agent_name, peer.address, dict(peer.layouts), dict(peer.extra))

        return self.call(run)

    def stats(self) -> StatsSnapshot:
        return self.call(self.engine.snapshot)

    def live_handles(self) -> dict[str, int]:
        return self.call(self.engine.live_handles)

    def wait_notifications(self, message: bytes, count: int = 1, *, timeout: float | None = None) -> list[str]:
        return self.call(lambda: self.engine.wait_notifications(message, count, timeout=timeout))

    # -- non-blocking submissions ----------------------------------------------------------
    def _submit(self, request_id: str, coro: Coroutine[Any, Any, Any]) -> None:
        if self._gone():
            coro.close()
            raise self._closed_error()
        run = object()  # this submission (`cancel` must not reach a later one under the same id)
        with self._lock:
            if request_id in self._inflight:
                coro.close()
                raise ValueError(f"request {request_id!r} already has work in flight")
            self._inflight[request_id] = run
        try:
            self._loop.call_soon_threadsafe(self._start_run, request_id, coro)
        except RuntimeError:  # the loop closed since `_closed` was read
            with self._lock:
                self._inflight.pop(request_id, None)
            coro.close()
            raise self._closed_error() from None

    def _start_run(self, request_id: str, coro: Coroutine[Any, Any, Any]) -> None:
        self._loop.create_task(self._run(request_id, coro))  # (referenced by the loop until it starts)

    async def _run(self, request_id: str, coro: Coroutine[Any, Any, Any]) -> None:
        """Run one request on the loop; report it once none of its transfers is in NIXL any more."""
        self._running[request_id] = asyncio.current_task()  # type: ignore[assignment]
        error: BaseException | None = None
        with self.engine.collect_transfers() as started:
            try:
                if request_id in self._cancel_asked:
                    raise asyncio.CancelledError(f"request {request_id} was cancelled")
                await coro
            except asyncio.CancelledError:
                error = asyncio.CancelledError(f"request {request_id} was cancelled")
            except BaseException as exc:  # (SystemExit too: raised on the loop, it would end the loop thread)
                error = exc
            finally:
                coro.close()
        outcome: tuple[str, BaseException | None] | None = None
        try:
            # Not quiet: the engine closed with NIXL holding some; reported fenced, and so it stays.
            if await self._quiesce(request_id, started, error):
                if error is None:  # a transfer it started but never awaited may have failed, or been settled
                    error = next((e for t in started if t.done() and _lost_data(e := t.exception())), None)
                outcome = ("done" if error is None else "failed", error)
        finally:
            self._running.pop(request_id, None)
            self._cancel_asked.discard(request_id)
            with self._lock:  # its id is free only once its outcome is there to be read
                self._inflight.pop(request_id, None)
                if outcome is not None:
                    self._finished.put((request_id, *outcome))
            if outcome is not None:
                self._activity.set()

    async def _quiesce(self, request_id: str, started: list[Any], error: BaseException | None) -> bool:
        """Settle the request's transfers; if NIXL holds one past the grace, say fenced and keep waiting.

        False if the engine closed before NIXL let go (the memory stays fenced for good).
        """
        pending = [t for t in started if not t.quiet]
        if not pending:
            return True
        engine = self.engine
        # Each already told it is fenced (its grace spent): said at once, not after another grace of settling.
        told = all(t.done() and isinstance(t.exception(), TransferFenced) for t in pending)
        settled: bool | None = False if told else None
        while settled is None:
            with contextlib.suppress(asyncio.CancelledError):  # cancelled again meanwhile: changes nothing here
                settled = await engine.settle(pending, timeout=engine.config.release_grace_s + 0.5)
        if settled:
            return True
        # (a transfer not told yet, the poller late past the grace, has no exception to look at)
        fenced = next((t.exception() for t in pending if t.done() and isinstance(t.exception(), TransferFenced)),
                      None)  # fmt: skip
        self._report(request_id, "fenced", fenced or error)
        while not all(t.quiet for t in pending):
            with contextlib.suppress(asyncio.CancelledError):
                if not all(await asyncio.gather(*(t.wait_quiet() for t in pending))):
                    return False
        return True

    def _report(self, request_id: str, outcome: str, error: BaseException | None) -> None:
        self._finished.put((request_id, outcome, error))
        self._activity.set()

    def submit(self, request_id: str, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run ``await func(engine, *args)`` on the loop as `request_id`; returns at once.

        For work that must look at a peer before deciding what to move (an adapter planning
        reads from the peer's layout). The outcome shows in `get_finished()`: done only if the
        coroutine returned and every transfer it started succeeded (one it caught, or left
        unawaited and the facade settled, makes the request failed; a READ whose data arrived
        and whose notice alone failed, `NotificationFailed` with a result, counts as succeeded).
        """
        coro = func(self.engine, *args)
        if not asyncio.iscoroutine(coro):
            with contextlib.suppress(Exception):
                coro.close()  # (a generator, say)
            raise TypeError(f"submit() runs a coroutine function: {func!r} returned {type(coro).__name__}")
        self._submit(request_id, coro)

    def spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run ``func(engine, *args)`` on the loop in the background, outside any request.

        Returns at once. For work whose outcome the coroutine handles itself (heartbeats,
        housekeeping): nothing is reported by `get_finished`, an exception is only logged,
        and `close()` cancels what is still running.
        """
        if self._gone():
            raise self._closed_error()

        async def run() -> None:
            try:
                await func(self.engine, *args)
            except asyncio.CancelledError:
                raise
            except BaseException:  # (SystemExit too: raised on the loop, it would end the loop thread)
                log.exception("background task %s failed", getattr(func, "__name__", func))

        def start() -> None:
            if not self._closed:
                self._background.add(task := asyncio.get_running_loop().create_task(run()))
                task.add_done_callback(self._background.discard)

        self._on_loop(start)

    def call_soon(self, func: Callable[..., object], *args: Any) -> None:
        """Run the plain callable ``func(*args)`` on the loop thread soon; returns at once.

        For handing small facts to coroutines already running there (e.g. put on their queue)
        from a thread that must not wait: no task, no future, one wake-up of the loop.
        """
        if self._gone():
            raise self._closed_error()
        self._on_loop(_logged_if_raising, func, args)

    def poke(self) -> None:
        """Have the loop progress NIXL and drain notifications soon (`TransferEngine.poll_soon`).

        Returns at once; cheap enough to call once per inference-engine step. A poke the loop has
        not taken yet absorbs the next ones: each would wake the loop thread again, and in a vLLM
        producer (stepped back to back while readers may read) take the GIL from the model thread.
        """
        if self._closed or self._poke_pending:
            return
        self._poke_pending = True
        try:
            self._on_loop(self._poked)
        except EngineClosedError:  # closed meanwhile (as documented, nothing said), or its loop ended without close()
            self._poke_pending = False
            if not self._closed:
                raise

    def _poked(self) -> None:
        self._poke_pending = False
        self.engine.poll_soon()

    def feed_notifications(self) -> queue.SimpleQueue[Notification]:
        """A queue that receives every notification from now on (claimed: not kept elsewhere).

        A thread drains it with ``get_nowait()``, never waiting on the loop. The feed stops
        when the engine closes.
        """
        feed: queue.SimpleQueue[Notification] = queue.SimpleQueue()

        async def pump(notifications: AsyncIterator[Notification]) -> None:
            while True:
                try:
                    async for item in notifications:
                        feed.put(item)
                        self._activity.set()
                    return  # (the engine closed)
                except NotificationsLost:  # more arrived in one drain than the limits: go on with what comes
                    log.error("the notification feed fell behind and lost notifications (over "
                              "max_unclaimed_notifications in one go); it goes on")  # fmt: skip
                    try:
                        notifications = self.engine.notifications(claim=True)
                    except EngineClosedError:
                        return

        def start() -> None:  # subscribed here: nothing delivered before the pump first runs is missed
            pumping = pump(self.engine.notifications(claim=True))
            self._tasks.add(task := asyncio.get_running_loop().create_task(pumping))
            task.add_done_callback(self._tasks.discard)

        self.call(start)
        return feed

    def submit_read(self, request_id: str, host: str, port: int, local_blocks: BlockIds, remote_blocks: BlockIds,
                    **options: Any) -> None:  # fmt: skip
        """Connect (if needed) and read; returns at once. The outcome shows in `get_finished()`.

        Options: `expected_engine_id`, `local`, `remote` (layout names or `ViewSpec`s), `notify`,
        `timeout`, `handshake_timeout`, `lease_expires_at` (see `TransferEngine.start_read`).
        """
        self._submit(request_id, self._transfer(*_transfer_args("READ", host, port, local_blocks, remote_blocks,
                                                                options)))  # fmt: skip

    def submit_write(self, request_id: str, host: str, port: int, local_blocks: BlockIds, remote_blocks: BlockIds,
                     **options: Any) -> None:  # fmt: skip
        """Connect (if needed) and write; returns at once (options as for `submit_read`)."""
        self._submit(request_id, self._transfer(*_transfer_args("WRITE", host, port, local_blocks, remote_blocks,
                                                                options)))  # fmt: skip

    def submit_transfers(
        self, request_id: str, parts: Sequence[dict[str, Any]], *, timeout: float | None = None
    ) -> None:
        """Several reads/writes (e.g. one per remote TP rank) finishing as one request.

        Each part is a dict with ``host``, ``port``, ``local_blocks``, ``remote_blocks``, optionally
        ``op`` ("READ" or "WRITE") and any `submit_read` option. The request fails if any part
        fails; the other parts are then cancelled. The parts are checked and copied here: a bad one
        raises (`ValueError`, `TypeError`) with nothing submitted.
        """
        checked = [_part_args({"timeout": timeout, **part}) for part in parts]

        async def run() -> None:
            async with asyncio.TaskGroup() as group:
                for args in checked:
                    group.create_task(self._transfer(*args))

        self._submit(request_id, _unwrap_group(run()))

    def submit_wait_notifications(
        self, request_id: str, message: bytes, count: int = 1, *, timeout: float | None = None
    ) -> None:
        """Finish `request_id` once `count` notifications `message` arrived (or fail on timeout)."""
        self._submit(request_id, self.engine.wait_notifications(message, count, timeout=timeout))

    def submit_notify(self, request_id: str, host: str, port: int, message: bytes) -> None:
        """Connect (if needed) and send a notification; returns at once."""

        async def run() -> None:
            peer = await self.engine.connect(host, port)
            await self.engine.notify(peer, message)

        self._submit(request_id, run())

    async def _transfer(
        self, op: str, host: str, port: int, local_blocks: BlockIds, remote_blocks: BlockIds, options: dict[str, Any]
    ) -> None:
        engine = self.engine
        connect = {key: options.pop(key) for key in ("expected_engine_id", "handshake_timeout") if key in options}
        peer = await engine.connect(host, port, expected_engine_id=connect.get("expected_engine_id"),
                                    timeout=connect.get("handshake_timeout"))  # fmt: skip
        start = engine.start_read if op == "READ" else engine.start_write
        transfer = await start(peer, local_blocks, remote_blocks, **options)
        await transfer

    def cancel(self, request_id: str) -> bool:
        """Cancel a request's work; it then shows as failed in `get_finished()` once its memory is quiet."""
        if self._forked:
            raise self._closed_error()
        with self._lock:
            run = self._inflight.get(request_id)
        if run is None:
            return False
        try:
            self._on_loop(self._cancel_on_loop, request_id, run)
        except EngineClosedError:  # nothing runs there any more
            return False
        return True

    def _cancel_on_loop(self, request_id: str, run: Any) -> None:
        with self._lock:
            # It ended since `cancel()` looked (a new request may have its id now): the cancel lapses.
            # (Kept, it would cancel the next request with this id, such as a push to the same rank.)
            if self._inflight.get(request_id) is not run:
                return
        task = self._running.get(request_id)
        if task is not None:
            task.cancel()
        else:
            self._cancel_asked.add(request_id)  # its task has not started yet

    def wait_activity(self, timeout: float, *, poke_every: float | None = None) -> bool:
        """Block this thread until a request ends or a fed notification arrives, or `timeout` passes.

        For a caller with nothing to do until then (an inference engine's step with nothing
        scheduled, which would otherwise return and be called again at once). Counts what
        happened since the previous call, so nothing is missed between a drain and a wait.
        `poke_every`: meanwhile have the loop progress NIXL that often (`poke`), e.g. so a peer's
        TCP operation on our memory keeps moving. True if something happened.
        """
        if self._gone():  # (first: once closed, a new thread may have the dead loop thread's ident)
            raise self._closed_error()
        self._off_the_loop("wait_activity()")
        if not timeout >= 0:  # (NaN too: it would never pass)
            raise ValueError(f"wait_activity(): timeout must be >= 0 seconds, not {timeout!r}")
        if poke_every is not None and not poke_every > 0:
            raise ValueError(f"wait_activity(): poke_every must be > 0 seconds, not {poke_every!r}")
        deadline = time.monotonic() + timeout
        happened = bool(self._held_back)  # an outcome the last get_finished() left for the next one
        while not happened:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            happened = self._activity.wait(remaining if poke_every is None else min(poke_every, remaining))
            if self._gone():  # close() wakes us: nothing more will happen
                raise self._closed_error()
            if not happened and poke_every is not None:
                self.poke()
        self._activity.clear()
        return happened

    def get_finished(self) -> FinishedRequests:
        """Requests finished since the last call. Never waits on the loop; one thread calls it.

        An id reports one outcome per call: if the id was submitted again and ended again before
        this call, the later outcome waits for the next call (merged, a failure could hide behind
        a success, or one of two failures be lost).
        """
        out = FinishedRequests()
        while True:
            if self._held_back:
                request_id, outcome, error = self._held_back.popleft()
            else:
                try:
                    request_id, outcome, error = self._finished.get_nowait()
                except queue.Empty:
                    return out
            if request_id in out.done or request_id in out.failed:
                self._held_back.appendleft((request_id, outcome, error))
                return out
            if outcome == "done":
                out.fenced.pop(request_id, None)
                out.done.add(request_id)
            elif outcome == "fenced":
                out.fenced[request_id] = error if error is not None else RuntimeError("fenced")
            else:
                out.fenced.pop(request_id, None)
                out.failed[request_id] = error if error is not None else RuntimeError("failed")

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._inflight)

    # -- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        """Cancel outstanding work (`call`s still running too), close the engine (releasing every
        handle), stop the thread. A close while another thread closes returns once that one is done."""
        if not self._gone():
            self._off_the_loop("close()")
        with self._lock:  # one close runs; the others wait for it
            first, self._closed = not self._closed, True
        self._activity.set()  # a thread in wait_activity() hears of it at once
        if not first:
            if threading.get_ident() != self._loop_thread:
                self._shut.wait()
            return
        try:
            with self._lock:
                pending = list(self._inflight.items())
            try:
                for request_id, run in pending:
                    self._loop.call_soon_threadsafe(self._cancel_on_loop, request_id, run)
                self._portal.call(self._stop_background)
            except RuntimeError:
                if not _closes(self._loop):
                    raise  # (else its loop ended without close(): nothing runs there to cancel)
            finally:
                self._stopper.stop()
        finally:
            self._shut.set()

    async def _stop_background(self) -> None:
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _LoopStopper:
    """Closes the engine and stops the loop thread: at `SyncEngine.close()`, or as the interpreter
    exits if nobody closed it (an uncaught error, a forgotten or dropped engine), which otherwise
    waits for ever on the loop's thread. Hooks registered with `threading._register_atexit` run
    before the interpreter joins threads; a forked child inherits them and skips ours."""

    def __init__(self, portal_cm: Any, portal: BlockingPortal, engine: TransferEngine, owner: SyncEngine,
                 loop: asyncio.AbstractEventLoop) -> None:  # fmt: skip
        self._parts: tuple[Any, BlockingPortal, TransferEngine] | None = (portal_cm, portal, engine)
        self._loop = loop
        self._owner = weakref.ref(owner)  # (weak: the hook must not keep a dropped engine's facade alive)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        with contextlib.suppress(RuntimeError):  # (the interpreter is already shutting down)
            threading._register_atexit(self._at_exit)  # type: ignore[attr-defined]

    def _take_parts(self) -> tuple[Any, BlockingPortal, TransferEngine] | None:
        with self._lock:  # (close() and the exit hook may race: one stops the loop)
            parts, self._parts = self._parts, None  # (dropped: a closed engine is not kept until exit)
        return parts

    def stop(self) -> None:
        parts = self._take_parts()
        if parts is None:
            return
        portal_cm, portal, engine = parts
        try:
            try:  # (the close's own errors come back as values: a RuntimeError here is the portal's refusal)
                failed, error = portal.call(_outcome_of, engine.close, ())
            except RuntimeError:
                if not _closes(self._loop):
                    raise  # (else the loop ended without close(): its poller closed the engine as the loop went)
            else:
                if failed:
                    raise error
        finally:
            with contextlib.suppress(Exception):
                portal.call(portal.stop, True)  # `call`s still running (a caller's coroutine) are cancelled
            with contextlib.suppress(Exception):
                portal_cm.__exit__(None, None, None)

    def _at_exit(self) -> None:
        if os.getpid() != self._pid or self._parts is None:
            return
        owner = self._owner()
        try:  # an error here would skip the interpreter's other exit hooks
            if owner is not None:  # through close(): threads still running get `EngineClosedError` from now on
                owner.close()
            else:
                self.stop()
        except BaseException:
            log.exception("closing an engine nobody closed, at exit, failed")

    def left_behind(self) -> None:
        """In a forked child: forget the parent's loop without calling it (it would never answer).
        Marked not running (anyio's own mark), the portal's context can end here at once; left to the
        child's exit, it would wait for the loop or fail noisily as the interpreter shuts down."""
        self._lock = threading.Lock()
        parts = self._take_parts()
        if parts is None:
            return
        portal_cm, portal, _ = parts
        portal._event_loop_thread_id = None  # type: ignore[attr-defined]
        try:
            portal._check_running()  # type: ignore[attr-defined]
        except RuntimeError:  # (it took the mark: ending the context no longer calls the loop)
            with contextlib.suppress(Exception):
                portal_cm.__exit__(None, None, None)
            return
        except Exception:  # (an anyio without that mark: keep the context, never end it here)
            pass
        _LEFT_BEHIND.append(portal_cm)


_ENGINES: weakref.WeakSet[SyncEngine] = weakref.WeakSet()  # this process's, for a fork
_LEFT_BEHIND: list[Any] = []  # portal contexts a forked child inherited and could not end


def _after_fork_in_child() -> None:
    for engine in list(_ENGINES):
        engine._left_behind_by_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _logged_if_raising(func: Callable[..., object], args: tuple[Any, ...]) -> None:
    """Run a `call_soon` callable on the loop; what it raises is logged (a base exception such as
    `SystemExit` raised out of a callback would end the loop thread)."""
    try:
        func(*args)
    except BaseException:
        log.exception("a call_soon callable %s raised", getattr(func, "__name__", func))


def _closes(loop: asyncio.AbstractEventLoop, within: float = 5.0) -> bool:
    """Whether `loop`, whose portal refused a call, is ending: closed now or within `within` s (asyncio's runner
    cancels what is left first, during which the portal is already stopped and the loop not yet closed). Only for a
    `RuntimeError` from the portal or the loop themselves, never one the called code raised."""
    deadline = time.monotonic() + within
    while not loop.is_closed():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


async def _outcome_of(func: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bool, Any]:
    """``(failed, value)`` of `func(*args)` (sync or async) on the loop: an exception comes back as a value.
    (anyio re-raises on the loop a base exception such as `SystemExit`, which would end the loop thread.)"""
    try:
        value = func(*args)
        if inspect.isawaitable(value):
            value = await value
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        return True, exc
    return False, value


async def _unwrap_group(coro: Coroutine[Any, Any, None]) -> None:
    """Re-raise the first error of a TaskGroup instead of an ExceptionGroup."""
    try:
        await coro
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None
