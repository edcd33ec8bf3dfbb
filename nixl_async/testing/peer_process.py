"""A peer engine in its own process, for tests, the demo and benchmarks.

``python -m nixl_async.testing.peer_process SPEC_JSON`` starts an engine whose layout is filled
with a deterministic pattern (see `nixl_async.testing.patterns`), serves handshakes, and obeys
commands on a control socket (msgspec Structs over ZMQ): verify blocks, read, write, notify, wait
for notifications, report stats, reincarnate (close its engine and start a new one, with a new
agent and address, over the same memory). It prints one JSON line with its addresses when ready.
`PeerProcess` is the parent's handle: start, command, pause (SIGSTOP), kill (SIGKILL), reincarnate,
stop; each of start, stop and kill has an ``a``-prefixed coroutine twin that does not block the
event loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import weakref
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Self

import msgspec
import numpy as np
import zmq
import zmq.asyncio

from ..config import TCP_SEGMENT_BYTES, PollConfig
from ..layout import LayoutKind
from .patterns import fill_pattern, verify_blocks

if TYPE_CHECKING:
    from ..engine import TransferEngine

__all__ = [
    "Checksums",
    "Exit",
    "Fill",
    "Notify",
    "PeerCommandError",
    "PeerProcess",
    "PeerSpec",
    "Register",
    "Reincarnate",
    "Stats",
    "TransferCommand",
    "Verify",
    "WaitNotifications",
]

_MODULE = "nixl_async.testing.peer_process"  # what the child runs (``python -m``)
# Run beside a paused peer: kill it once the process that paused it is gone (argv: that process, the peer).
_KILL_IF_ORPHANED = """
import os, signal, sys, time
parent, peer = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == parent:
    time.sleep(0.2)
try:
    os.kill(peer, signal.SIGKILL)
except OSError:
    pass
"""
_READY = "NIXL_ASYNC_PEER_READY"
_ORPHAN_CHECK_S = 0.5
_PAUSED: weakref.WeakSet[PeerProcess] = weakref.WeakSet()  # stopped by `pause`, not resumed since
_READ_CHUNK = 1 << 16


# -- control protocol ---------------------------------------------------------------------
class PeerSpec(msgspec.Struct, kw_only=True):
    """What the peer process builds."""

    engine_id: str
    num_regions: int = 2
    num_blocks: int = 64
    block_len: int = 4096
    kind: LayoutKind = LayoutKind.REGIONS
    layout_name: str = "kv"
    seed: int | None = 1  # None: zero-filled
    host: str = "127.0.0.1"
    port: int = 0
    compat: dict[str, str] = {}
    extra: dict[str, str] = {}  # announced in the handshake (e.g. an adapter's block size)
    handshake_timeout_s: float = 5.0
    auth_secret: bytes | None = None
    etcd_endpoint: str | None = None  # publish the engine there (EngineConfig.etcd)
    etcd_namespace: str = "nixl_async"
    etcd_lease_ttl_s: int = 10
    tcp_segment_bytes: int | None = TCP_SEGMENT_BYTES  # EngineConfig's (None: UCX's default)
    idle_poll_s: float | None = None  # the poller's interval when idle (None: the engine's backoff, to 50 ms)


def _idle_every(seconds: float) -> PollConfig:
    """A poller that, idle, checks every `seconds` (and never backs off further)."""
    return PollConfig(idle_interval_s=seconds, backoff_start_s=min(PollConfig.backoff_start_s, seconds))


class Verify(msgspec.Struct, tag="verify", kw_only=True):
    blocks: list[int]
    source_blocks: list[int]
    seed: int


class Fill(msgspec.Struct, tag="fill", kw_only=True):
    seed: int | None


class Checksums(msgspec.Struct, tag="checksums", kw_only=True):
    blocks: list[int]


class TransferCommand(msgspec.Struct, tag="transfer", kw_only=True):
    """Make the peer read or write against another engine (named apart from `nixl_async.transfer.Transfer`)."""

    op: str
    host: str
    port: int
    local_blocks: list[int]
    remote_blocks: list[int]
    notify: bytes | None = None
    timeout: float | None = None
    lease_expires_at: float | None = None


class Notify(msgspec.Struct, tag="notify", kw_only=True):
    host: str
    port: int
    message: bytes


class WaitNotifications(msgspec.Struct, tag="wait_notifications", kw_only=True):
    message: bytes
    count: int = 1
    timeout: float | None = None


class Stats(msgspec.Struct, tag="stats"):
    pass


class Exit(msgspec.Struct, tag="exit"):
    pass


class Register(msgspec.Struct, tag="register", kw_only=True):
    """Register another layout of `num_regions` regions, filled with the pattern for `seed`."""

    layout_name: str
    num_regions: int = 1
    num_blocks: int = 16
    block_len: int = 4096
    seed: int = 7


class Reincarnate(msgspec.Struct, tag="reincarnate", kw_only=True):
    """Close the peer's engine and start a new one as `engine_id` (a new NIXL agent) on `port`.

    The same layout over the same memory (so the same fill), a new handshake address (port 0: a
    fresh one). The control socket stays. Answers ``{"engine_id", "host", "port"}``.
    """

    engine_id: str
    port: int = 0


Command = (
    Verify | Fill | Checksums | TransferCommand | Notify | WaitNotifications | Stats | Exit | Register | Reincarnate
)


class Ok(msgspec.Struct, tag="ok"):
    value: Any = None


class Err(msgspec.Struct, tag="err"):
    error_type: str
    message: str


Answer = Ok | Err
_command_decoder = msgspec.msgpack.Decoder(Command)
_answer_decoder = msgspec.msgpack.Decoder(Answer)
_encoder = msgspec.msgpack.Encoder()


class PeerCommandError(RuntimeError):
    """The peer ran a command and it raised; `type` names the peer-side exception class."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type = type_name


# -- the child ----------------------------------------------------------------------------
class _PeerServer:
    def __init__(self, spec: PeerSpec, ready_fd: int) -> None:
        self.spec = spec
        self.ready_fd = ready_fd  # the parent's pipe, for the ready line alone
        self.engine: TransferEngine  # the current incarnation, from `open_engine`
        region_len = spec.num_blocks * spec.block_len
        self.regions = [np.zeros(region_len, dtype=np.uint8) for _ in range(spec.num_regions)]
        self.extra_regions: list[np.ndarray] = []  # layouts added by `Register`
        self.done = asyncio.Event()
        self.parent = os.getppid()  # (at start: a parent gone before we serve is noticed too)

    async def open_engine(self, spec: PeerSpec) -> tuple[TransferEngine, str, int]:
        """A started engine as `spec` says, with our regions registered, serving on spec.port."""
        from ..config import EngineConfig, EtcdConfig
        from ..engine import TransferEngine

        etcd = None
        if spec.etcd_endpoint is not None:
            etcd = EtcdConfig(spec.etcd_endpoint, namespace=spec.etcd_namespace, lease_ttl_s=spec.etcd_lease_ttl_s)
        engine = TransferEngine(
            EngineConfig(
                engine_id=spec.engine_id,
                compat=spec.compat,
                handshake_timeout_s=spec.handshake_timeout_s,
                auth_secret=spec.auth_secret,
                etcd=etcd,
                tcp_segment_bytes=spec.tcp_segment_bytes,
                poll=PollConfig() if spec.idle_poll_s is None else _idle_every(spec.idle_poll_s),
            )
        )
        await engine.start()
        try:
            engine.register(spec.layout_name, self.regions, block_len=spec.block_len, kind=spec.kind)
            if spec.extra:
                engine.set_extra(**spec.extra)
            host, port = await engine.serve(spec.host, spec.port)
            if etcd is not None:
                await engine.publish()
        except BaseException:
            await engine.close()
            raise
        return engine, host, port

    async def reincarnate(self, engine_id: str, port: int) -> dict[str, Any]:
        """Close the engine, then serve the same memory from a new one (a new agent and address)."""
        await self.engine.close()
        self.spec = msgspec.structs.replace(self.spec, engine_id=engine_id, port=port)
        self.engine, host, port = await self.open_engine(self.spec)
        return {"engine_id": engine_id, "host": host, "port": port}

    async def run(self) -> None:
        spec = self.spec
        self.fill(spec.seed)
        self.engine, host, port = await self.open_engine(spec)
        try:
            ctx = zmq.asyncio.Context()
            control = ctx.socket(zmq.ROUTER)
            control.setsockopt(zmq.LINGER, 0)
            control_port = control.bind_to_random_port(f"tcp://{spec.host}")
            ready = {"engine_id": spec.engine_id, "host": host, "port": port, "control_port": control_port}
            os.write(self.ready_fd, f"{_READY} {json.dumps(ready)}\n".encode())
            os.close(self.ready_fd)
            orphaned = asyncio.ensure_future(self._exit_when_orphaned(self.parent))
            tasks: set[asyncio.Task[None]] = set()
            receiver = asyncio.ensure_future(control.recv_multipart())
            stopper = asyncio.ensure_future(self.done.wait())
            while not self.done.is_set():
                await asyncio.wait({receiver, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if receiver.done():
                    identity, payload = receiver.result()
                    task = asyncio.create_task(self.answer(control, identity, payload))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    receiver = asyncio.ensure_future(control.recv_multipart())
            receiver.cancel()
            orphaned.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            control.close(0)
            ctx.destroy(0)
        finally:
            await self.engine.close()

    async def _exit_when_orphaned(self, parent: int) -> None:
        """Exit once the parent is gone (a test run killed from outside): nothing else would stop us."""
        while os.getppid() == parent:
            await asyncio.sleep(_ORPHAN_CHECK_S)
        self.done.set()

    def fill(self, seed: int | None) -> None:
        if seed is None:
            for region in self.regions:
                region[:] = 0
        else:
            fill_pattern(self.regions, seed)

    async def answer(self, sock: zmq.asyncio.Socket, identity: bytes, payload: bytes) -> None:
        try:
            answer: Answer = Ok(await self.execute(_command_decoder.decode(payload)))
        except Exception as exc:
            answer = Err(type(exc).__name__, str(exc))
        await sock.send_multipart([identity, _encoder.encode(answer)])

    async def execute(self, cmd: Any) -> Any:
        engine, spec = self.engine, self.spec
        match cmd:
            case Verify(blocks=blocks, source_blocks=sources, seed=seed):
                return verify_blocks(self.regions, spec.block_len, blocks, sources, seed)
            case Fill(seed=seed):
                self.fill(seed)
                return None
            case Checksums(blocks=blocks):
                bl = spec.block_len
                return [[zlib.crc32(r[b * bl : (b + 1) * bl].data) for b in blocks] for r in self.regions]
            case TransferCommand(
                op=op, host=host, port=port, local_blocks=lb, remote_blocks=rb, notify=notify, timeout=t
            ):
                peer = await engine.connect(host, port)
                start = engine.start_read if op == "READ" else engine.start_write
                result = await (
                    await start(peer, lb, rb, notify=notify, timeout=t, lease_expires_at=cmd.lease_expires_at)
                )
                return msgspec.to_builtins(result)
            case Notify(host=host, port=port, message=message):
                await engine.notify(await engine.connect(host, port), message)
                return None
            case WaitNotifications(message=message, count=count, timeout=timeout):
                return await engine.wait_notifications(message, count, timeout=timeout)
            case Stats():
                return msgspec.to_builtins(engine.snapshot())
            case Exit():
                self.done.set()
                return None
            case Register(layout_name=name, num_regions=n, num_blocks=blocks, block_len=bl, seed=seed):
                regions = [np.zeros(blocks * bl, dtype=np.uint8) for _ in range(n)]
                fill_pattern(regions, seed)
                self.extra_regions.extend(regions)
                engine.register(name, regions, block_len=bl)
                return None
            case Reincarnate(engine_id=engine_id, port=port):
                return await self.reincarnate(engine_id, port)
        raise TypeError(f"unknown command {cmd!r}")  # pragma: no cover


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    spec = msgspec.json.decode(argv[0], type=PeerSpec)
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    # The parent reads its pipe only up to the ready line; UCX logs to stdout (C's buffered stdio, whose
    # partial lines could split the ready line, and which would block this process in a log call once
    # the pipe filled). So the pipe carries the ready line alone, and stdout goes to the stderr file.
    ready_fd = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    runner(_PeerServer(spec, ready_fd).run())


# -- the parent's handle ------------------------------------------------------------------
class PeerProcess:
    """Start and command a peer process.

    Sync code uses `start` / `stop` / `kill` (or ``with``); coroutines use `astart` / `astop` / `akill`
    (or ``async with``), which wait on the child without blocking the event loop.
    """

    def __init__(
        self,
        spec: PeerSpec,
        *,
        env: dict[str, str] | None = None,
        startup_timeout: float = 60.0,
        command_prefix: list[str] | None = None,
    ) -> None:
        """`command_prefix` wraps the child, e.g. ``["ip", "netns", "exec", "ns1"]``."""
        self.spec = spec
        self.command_prefix = list(command_prefix or [])
        self.env = dict(env or {})
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self._pause_watch: subprocess.Popen[bytes] | None = None  # while paused: see `pause`
        self.host = ""
        self.port = 0
        self.control_port = 0
        self._stdout = b""  # what the child printed before its ready line, up to an incomplete line
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the peer

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def engine_id(self) -> str:
        return self.spec.engine_id

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    # -- starting -------------------------------------------------------------------------
    def _spawn(self) -> int:
        """Start the child; return its stdout's file descriptor, on which the ready line will come."""
        env = {**os.environ, **self.env}
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._stdout = b""
        self.proc = subprocess.Popen(
            [*self.command_prefix, sys.executable, "-m", _MODULE, msgspec.json.encode(self.spec).decode()],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def _scan(self, chunk: bytes) -> bool:
        """Take stdout bytes; True once the ready line has come (NIXL may log to stdout before it)."""
        *lines, self._stdout = (self._stdout + chunk).split(b"\n")
        for raw in lines:
            line = raw.decode(errors="replace")
            if line.startswith(_READY):
                ready = json.loads(line[len(_READY) :])
                self.host, self.port, self.control_port = ready["host"], ready["port"], ready["control_port"]
                self._stdout = b""
                return True
        return False

    def _timed_out(self) -> RuntimeError:
        return RuntimeError(f"peer {self.engine_id} did not start in {self.startup_timeout}s: {self.stderr()}")

    def _exited(self) -> RuntimeError:
        assert self.proc is not None
        return RuntimeError(f"peer {self.engine_id} exited ({self.proc.returncode}): {self.stderr()}")

    def start(self) -> Self:
        """Start the peer and block until it serves (sync code; coroutines use `astart`)."""
        fd = self._spawn()
        deadline = time.monotonic() + self.startup_timeout
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(fd, selectors.EVENT_READ)
                while True:
                    if not sel.select(max(0.0, deadline - time.monotonic())):
                        self.kill()
                        raise self._timed_out()
                    chunk = os.read(fd, _READ_CHUNK)
                    if not chunk:
                        self._wait_sync()
                        raise self._exited()
                    if self._scan(chunk):
                        return self
        except BaseException:  # Ctrl-C while it starts: no one else will reap the child (as `astart`)
            self.kill()
            raise

    async def astart(self) -> Self:
        """`start` for coroutines: the child's stdout is read as the loop sees it readable."""
        fd = self._spawn()
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        os.set_blocking(fd, False)
        loop.add_reader(fd, readable.set)
        try:
            async with asyncio.timeout(self.startup_timeout):
                while True:
                    await readable.wait()
                    readable.clear()
                    try:
                        chunk = os.read(fd, _READ_CHUNK)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        break
                    if self._scan(chunk):
                        return self
        except TimeoutError:
            await self.akill()
            raise self._timed_out() from None
        except BaseException:  # cancelled: no one else will reap the child (SIGKILL makes the wait short)
            self.kill()
            raise
        finally:
            loop.remove_reader(fd)
            os.set_blocking(fd, True)
        await self._wait()
        raise self._exited()

    def stderr(self) -> str:
        # (pread: the child writes through the same open file; moving its offset would make it write over the log)
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        return os.pread(fd, 16000, max(0, size - 16000)).decode(errors="replace")[-4000:]

    # -- commands -------------------------------------------------------------------------
    async def request(self, cmd: Any, timeout: float = 60.0) -> Any:
        """Send a command and await its answer (raises `PeerCommandError`, `TimeoutError`)."""
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{self.host}:{self.control_port}")
            async with asyncio.timeout(timeout):
                await sock.send(_encoder.encode(cmd))
                payload = await sock.recv()
        finally:
            sock.close(0)
        return self._unwrap(payload)

    def request_sync(self, cmd: Any, timeout: float = 60.0) -> Any:
        """`request` for threads without a loop."""
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{self.host}:{self.control_port}")
            sock.send(_encoder.encode(cmd))
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError(f"peer {self.engine_id} did not answer {type(cmd).__name__} in {timeout}s")
            payload = sock.recv()
        finally:
            sock.close(0)
        return self._unwrap(payload)

    async def reincarnate(self, engine_id: str, *, port: int = 0, timeout: float = 60.0) -> tuple[str, int]:
        """Make the peer close its engine and serve the same memory as a new engine `engine_id`.

        The old incarnation vanishes (its agent and handshake address close); the new one has a
        new NIXL agent and listens on `port` (0: a fresh one), with the same layout and contents.
        Updates `address` and `engine_id` and returns the new address. Raises `PeerCommandError`.
        """
        value = await self.request(Reincarnate(engine_id=engine_id, port=port), timeout=timeout)
        self.spec = msgspec.structs.replace(self.spec, engine_id=value["engine_id"])
        self.host, self.port = value["host"], value["port"]
        return self.address

    @staticmethod
    def _unwrap(payload: bytes) -> Any:
        answer = _answer_decoder.decode(payload)
        if isinstance(answer, Err):
            raise PeerCommandError(answer.error_type, answer.message)
        return answer.value

    # -- waiting for the exit -------------------------------------------------------------
    def _wait_sync(self, timeout: float | None = None) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    async def _wait(self, timeout: float | None = None) -> int:
        """`proc.wait` for coroutines: polls, since the child is a plain `Popen`, not an asyncio subprocess."""
        assert self.proc is not None
        delay = 0.001
        async with asyncio.timeout(timeout):
            while (code := self.proc.poll()) is None:
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.05)
        return code

    # -- fault knobs ----------------------------------------------------------------------
    def kill(self) -> None:
        """SIGKILL: the peer dies without any goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self._wait_sync()
        self._end_pause_watch()

    async def akill(self) -> None:
        """`kill` for coroutines."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            await self._wait()
        self._end_pause_watch()

    def pause(self) -> None:
        """SIGSTOP: the peer stops answering but its sockets stay open.

        A stopped peer cannot notice that this process died (its own check is what stopped), so a
        small watcher does meanwhile: if this process goes, it kills the peer (SIGKILL reaches a
        stopped process)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        _PAUSED.add(self)
        if self._pause_watch is None:
            self._pause_watch = subprocess.Popen(
                [sys.executable, "-S", "-c", _KILL_IF_ORPHANED, str(os.getpid()), str(self.proc.pid)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        _PAUSED.discard(self)
        self._end_pause_watch()

    def _end_pause_watch(self) -> None:
        watch, self._pause_watch = self._pause_watch, None
        if watch is not None:
            watch.kill()
            watch.wait()

    @staticmethod
    def resume_all() -> None:
        """Resume every peer still paused (before an engine that may be reading from one closes)."""
        for peer in list(_PAUSED):
            if peer.proc is not None and peer.proc.poll() is None:
                peer.resume()
        _PAUSED.clear()

    # -- stopping -------------------------------------------------------------------------
    def stop(self, timeout: float = 10.0) -> int | None:
        """Ask the peer to exit; kill it if it does not. Returns its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.resume()
            try:
                self.request_sync(Exit(), timeout=timeout)
                self._wait_sync(timeout)
            except (TimeoutError, subprocess.TimeoutExpired, PeerCommandError, zmq.ZMQError):
                self.kill()
        self._close()
        return self.proc.returncode

    async def astop(self, timeout: float = 10.0) -> int | None:
        """`stop` for coroutines."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.resume()
            try:
                await self.request(Exit(), timeout=timeout)
                await self._wait(timeout)
            except (TimeoutError, PeerCommandError, zmq.ZMQError):
                await self.akill()
        self._close()
        return self.proc.returncode

    def _close(self) -> None:
        assert self.proc is not None
        self._end_pause_watch()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await self.astart()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.astop()


if __name__ == "__main__":
    main()
