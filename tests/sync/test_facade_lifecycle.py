"""The sync facade at the edges of a process's life: its exit, a fork, Ctrl-C, and base exceptions."""

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from nixl_async import EngineClosedError, EngineConfig, SyncEngine


def _run(script: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)


_ATEXIT_CLOSE = """
import atexit
from nixl_async import EngineConfig, SyncEngine
engine = SyncEngine(EngineConfig(engine_id="atexit-close"))
atexit.register(engine.close)
print("main done", flush=True)
"""


def test_closing_from_an_atexit_hook_is_quiet():
    """`atexit.register(engine.close)`: our own exit hook ran first (before, it stopped the loop and
    left the engine open, so this close raised "This portal is not running" at every exit)."""
    done = _run(_ATEXIT_CLOSE)
    assert done.returncode == 0 and "main done" in done.stdout, done.stderr[-2000:]
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


_MAIN_EXITS = """
import asyncio, threading, time
from nixl_async import EngineClosedError, EngineConfig, SyncEngine

engine = SyncEngine(EngineConfig(engine_id="main-exits"))

async def long(engine):
    await asyncio.sleep(30)

def worker():
    engine.submit("long", long)
    time.sleep(1.0)  # the main thread has returned meanwhile: the exit hook ran
    for name, call in [("stats", engine.stats), ("call", lambda: engine.call(lambda: 1)),
                       ("call_soon", lambda: engine.call_soon(print)), ("submit", lambda: engine.submit("x", long)),
                       ("wait_activity", lambda: engine.wait_activity(0.5))]:
        try:
            call()
            print(name, "returned")
        except EngineClosedError:
            print(name, "closed")
        except BaseException as exc:
            print(name, "raised", type(exc).__name__, exc)
    engine.close()
    print("close returned; finished:", sorted(engine.get_finished().failed))

threading.Thread(target=worker).start()
"""


def test_a_thread_still_running_at_exit_finds_the_engine_closed():
    """The main thread returns while another still uses the facade: the exit hook closes the engine as
    `close()` does, so that thread's calls raise `EngineClosedError` and its request is reported
    (before: the loop was stopped under an engine still marked open; calls raised anyio's and asyncio's
    RuntimeErrors)."""
    done = _run(_MAIN_EXITS)
    lines = done.stdout.splitlines()
    for name in ("stats", "call", "call_soon", "submit", "wait_activity"):
        assert f"{name} closed" in lines, done.stdout + done.stderr[-2000:]
    assert "close returned; finished: ['long']" in lines, done.stdout + done.stderr[-2000:]
    assert done.returncode == 0


_FORKED = """
import os, signal, sys
from nixl_async import EngineClosedError, EngineConfig, SyncEngine

engine = SyncEngine(EngineConfig(engine_id="forked"))
pid = os.fork()
if pid == 0:
    signal.alarm(10)  # a hang shows as SIGALRM
    for name, call in [("stats", engine.stats), ("submit", lambda: engine.submit_read("r", "127.0.0.1", 1, [0], [0])),
                       ("wait_activity", lambda: engine.wait_activity(0.1)), ("cancel", lambda: engine.cancel("r"))]:
        try:
            call()
        except EngineClosedError as exc:
            print(name, "closed:", "forked child" in str(exc), flush=True)
    with engine:
        pass  # the context's close() returns
    print("child done", flush=True)
    sys.exit(0)  # the interpreter's own exit in the child
_, status = os.waitpid(pid, 0)
print("child status", status, flush=True)
print("parent still works:", engine.stats() is not None, flush=True)
engine.close()
"""


def test_a_forked_child_gets_engine_closed_instead_of_hanging():
    """A forked child inherits the facade but not its loop thread: its calls raise `EngineClosedError`
    naming the fork, `close()` returns, the child exits quietly, and the parent's engine works on
    (before: the child's calls waited for ever, and its exit printed anyio's traceback)."""
    done = _run(_FORKED)
    lines = done.stdout.splitlines()
    for name in ("stats", "submit", "wait_activity", "cancel"):
        assert f"{name} closed: True" in lines, done.stdout + done.stderr[-2000:]
    assert "child done" in lines and "child status 0" in lines, done.stdout + done.stderr[-2000:]
    assert "parent still works: True" in lines and done.returncode == 0
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr[-2000:]


_CTRL_C = """
import os, signal, threading, time
import numpy as np
from nixl_async import EngineConfig, NotificationTimeout, SyncEngine

a = SyncEngine(EngineConfig(engine_id="ctrl-c-a"))
b = SyncEngine(EngineConfig(engine_id="ctrl-c-b"))
host, port = a.serve("127.0.0.1", 0)
b.connect(host, port)
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # the user presses Ctrl-C
try:
    a.wait_notifications(b"ready", timeout=None)
except KeyboardInterrupt:
    print("interrupted", flush=True)
time.sleep(0.2)
b.submit_notify("n", host, port, b"ready")
try:
    print("second wait:", a.wait_notifications(b"ready", timeout=5.0), flush=True)
except NotificationTimeout:
    print("second wait timed out", flush=True)
b.close()
a.close()
"""


def test_an_interrupted_call_cancels_its_work_on_the_loop():
    """Ctrl-C in a thread blocked in `wait_notifications`: the wait on the loop ends too, so the next
    wait gets the notification (before: the abandoned waiter took it, and the next one timed out)."""
    done = _run(_CTRL_C)
    lines = done.stdout.splitlines()
    assert "interrupted" in lines and "second wait: ['ctrl-c-b']" in lines, done.stdout + done.stderr[-2000:]


@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt()], ids=["SystemExit", "KeyboardInterrupt"])
def test_a_base_exception_on_the_loop_fails_its_request_and_keeps_the_loop(raised):
    """A submitted coroutine, a `call`, or a `spawn`ed task raising a base exception: the request fails
    with it and the call re-raises it, and the loop thread runs on (before: it ended, so the request was
    never reported and every later call hung or raised RuntimeError)."""

    async def boom(engine):
        raise raised

    def plain() -> None:
        raise raised

    engine = SyncEngine(EngineConfig(engine_id="base-exceptions"))
    try:
        engine.spawn(boom)
        engine.call_soon(plain)
        engine.submit("r", boom)
        deadline = time.monotonic() + 10
        failed: dict = {}
        while not failed and time.monotonic() < deadline:
            engine.wait_activity(0.5)
            failed = engine.get_finished().failed
        assert failed == {"r": raised}
        with pytest.raises(type(raised)):
            engine.call(lambda: boom(None))
        assert engine.call(lambda: 7) == 7 and engine.in_flight == 0
    finally:
        engine.close()
    assert engine.engine.live_handles() == {}


def test_a_loop_ended_by_a_child_task_s_system_exit_makes_the_facade_closed(caplog):
    """A task a submitted coroutine started raises `SystemExit`: asyncio lets it end the loop, and the engine's
    poller closes the engine as it goes. Before session 40 the facade never noticed: `poke`, `call_soon` and
    `spawn` raised `RuntimeError`, `close()` raised "portal is not running", `wait_activity` only timed out."""

    async def child() -> None:
        raise SystemExit(3)

    async def starts_a_child(engine) -> None:
        asyncio.get_running_loop().create_task(child())
        await asyncio.sleep(5)

    engine = SyncEngine(EngineConfig(engine_id="loop-ended"))
    engine.submit("r", starts_a_child)
    deadline = time.monotonic() + 10
    while not engine._loop.is_closed() and time.monotonic() < deadline:
        time.sleep(0.05)
    calls = [engine.poke, lambda: engine.call_soon(print), lambda: engine.spawn(starts_a_child), engine.stats,
             lambda: engine.submit("s", starts_a_child), lambda: engine.wait_activity(0.1)]  # fmt: skip
    for call in calls:
        with pytest.raises(EngineClosedError, match="ended without close"):
            call()
    assert engine.get_finished().failed.keys() == {"r"}, "the request under way is reported"
    engine.close()
    engine.close()
    assert engine.engine.live_handles() == {}


def test_after_close_every_thread_gets_engine_closed():
    """After close() a new thread may get the dead loop thread's ident: `wait_activity` raised
    `WrongThreadError` there (the adapter only expects `EngineClosedError`)."""
    engine = SyncEngine(EngineConfig(engine_id="closed-threads"))
    engine.close()
    seen: set[str] = set()

    def probe() -> None:
        for call in (lambda: engine.wait_activity(0.0), engine.stats):
            try:
                call()
            except Exception as exc:
                seen.add(type(exc).__name__)

    for _ in range(20):  # (Linux hands a finished thread's ident to the next one: some get the loop's)
        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
    assert seen == {EngineClosedError.__name__}


def test_a_call_handler_raising_a_base_exception_answers_an_error_and_keeps_the_loop():
    """A `handle_calls` handler raising `SystemExit` on the loop: the caller hears an error, the loop runs on."""
    from nixl_async import HandshakeRejected

    def handler(sender: str, payload: bytes) -> bytes:
        raise SystemExit(1)

    server = SyncEngine(EngineConfig(engine_id="calls-server"))
    client = SyncEngine(EngineConfig(engine_id="calls-client"))
    try:
        server.handle_calls("t", handler)
        host, port = server.serve("127.0.0.1", 0)

        async def ask(engine):
            peer = await engine.connect(host, port)
            return await engine.call(peer, "t", b"x")

        with pytest.raises(HandshakeRejected):
            client.call(lambda: ask(client.engine))
        assert server.call(lambda: 1) == 1
    finally:
        client.close()
        server.close()
