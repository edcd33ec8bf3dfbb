"""A pytest plugin for asyncio integration tests against real NIXL peers.

Registered through the ``pytest11`` entry point, so installing nixl-async gives a test suite:

- ``nixl_engine``: a started `TransferEngine` on the test's running loop, serving handshakes
  on 127.0.0.1; at teardown it is closed and the test fails if any NIXL handle stayed live;
- ``nixl_peer_factory``: ``spawn(engine_id=..., num_blocks=..., block_len=..., seed=..., tcp=...)``
  starts a peer engine in another process (see `nixl_async.testing.peer_process`), filled with a
  deterministic pattern; ``tcp=True`` makes its transfers go over UCX's TCP transport so they are
  genuinely in flight. Peers are stopped at teardown (killed if they do not exit);
- ``nixl_peer``: one default peer from that factory;
- `PeerProcess` fault knobs (``kill()``/``akill()``, ``pause()``, ``resume()``, ``reincarnate()``), its control commands
  (`Verify`, `TransferCommand`, `WaitNotifications`, `Stats`, ...), the pattern helpers (`fill_pattern`,
  `pattern_block`, `verify_blocks`) re-exported here, `transfers_settled` (await it after
  cancelling transfers, before asserting that no handle is live) and `until_in_flight`.

Example::

    async def test_read(nixl_engine, nixl_peer):
        regions = [np.zeros(64 * 4096, np.uint8) for _ in range(2)]
        nixl_engine.register("kv", regions, block_len=4096)
        peer = await nixl_engine.connect(*nixl_peer.address)
        await nixl_engine.read(peer, [0, 1], [5, 6])
        assert verify_blocks(regions, 4096, [0, 1], [5, 6], seed=nixl_peer.spec.seed) == []

The peer harness is imported on first use. Loading the plugin imports `nixl_async` itself, and with
it NIXL (~0.3 s per pytest run where nixl-async is installed; `-p no:nixl_async` turns it off).
The package also works without pytest: the CLI demo and the benchmarks import
`nixl_async.testing.peer_process` where only the runtime dependencies are.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._host import nvidia_gpus, tcp_only_tls
from .patterns import fill_pattern, pattern_block, verify_blocks

try:
    import pytest
except ImportError:  # pragma: no cover - the demo and benchmarks run where only runtime dependencies are
    pytest = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from ..engine import TransferEngine
    from ..transfer import Transfer
    from .peer_process import (
        Checksums,
        Exit,
        Fill,
        Notify,
        PeerCommandError,
        PeerProcess,
        PeerSpec,
        Register,
        Reincarnate,
        Stats,
        TransferCommand,
        Verify,
        WaitNotifications,
    )

__all__ = [
    "TCP_ENV",
    "TCP_TLS",
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
    "assert_no_live_handles",
    "fill_pattern",
    "free_port_base",
    "pattern_block",
    "transfers_settled",
    "until_in_flight",
    "verify_blocks",
]


def __getattr__(name: str) -> Any:
    # Exported names not defined here come from the peer harness, loaded on first access, not at import:
    # ``python -m nixl_async.testing.peer_process`` imports this package first, and runpy warns (and runs a
    # second copy) if the module it is about to run is already imported.
    if name in __all__:
        from . import peer_process

        return getattr(peer_process, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# UCX over TCP alone, as NIXL takes it on this host: it refuses plain "tcp" where there are NVIDIA GPUs.
TCP_TLS = tcp_only_tls(nvidia_gpus())
TCP_ENV = {"UCX_TLS": TCP_TLS}
_names = itertools.count()


def assert_no_live_handles(engine: TransferEngine) -> None:
    """Fail the test if the (closed) engine still holds NIXL handles."""
    live = engine.live_handles()
    if live:
        pytest.fail(f"NIXL handles still live after close: {live}")


def free_port_base(span: int) -> int:
    """A base port with base .. base + span - 1 free on 127.0.0.1 (servers that listen at base + rank)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + span > 65535:
            continue
        try:
            for k in range(1, span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + k))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {span} free consecutive ports")


async def transfers_settled(engine: TransferEngine, timeout: float = 3.0) -> int:
    """Wait until the engine holds no NIXL transfer handle; return how many remain after `timeout`.

    A handle NIXL could not cancel at once (a read in flight over TCP) is released by the poller
    once the transfer settles, so right after a cancellation a few may still be live.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (live := engine.live_handles().get("xfers", 0)) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return live


async def until_in_flight(transfer: Transfer, timeout: float = 1.0) -> None:
    """Return once `transfer` has a slice in flight in NIXL; fail the test if none is by `timeout`
    (over UCX's CMA a READ is a copy inside the post, never in flight: use UCX over TCP)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not transfer.core.has_running:
        if loop.time() >= deadline:
            pytest.fail("the read never had a slice in flight: is UCX really using TCP?")
        await asyncio.sleep(0.0005)


if pytest is not None:  # the plugin proper
    try:
        import pytest_asyncio

        _async_fixture: Any = pytest_asyncio.fixture
    except ImportError:  # pragma: no cover - without pytest-asyncio only the sync fixtures exist
        _async_fixture = None

    @pytest.fixture
    def nixl_peer_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., PeerProcess]]:
        """``spawn(**PeerSpec fields, tcp=False, env=None)`` -> a started `PeerProcess`."""
        from .peer_process import PeerProcess, PeerSpec

        spawned: list[PeerProcess] = []

        def spawn(*, tcp: bool = False, env: dict[str, str] | None = None, **spec: Any) -> PeerProcess:
            spec.setdefault("engine_id", f"peer-{request.node.name[:40]}-{next(_names)}")
            merged = {**(TCP_ENV if tcp else {}), **(env or {})}
            peer = PeerProcess(PeerSpec(**spec), env=merged)
            spawned.append(peer)
            return peer.start()

        yield spawn
        failures: list[BaseException] = []
        for peer in spawned:  # every one, even if stopping another failed
            try:
                peer.stop(timeout=5.0)
            except Exception as exc:
                peer.kill()
                failures.append(exc)
        if failures:
            raise failures[0]

    @pytest.fixture
    def nixl_peer(nixl_peer_factory: Callable[..., PeerProcess]) -> PeerProcess:
        """A peer process with 2 regions x 64 blocks x 4 KiB, pattern seed 1."""
        return nixl_peer_factory()

    if _async_fixture is not None:

        @_async_fixture
        async def nixl_engine(request: pytest.FixtureRequest) -> AsyncIterator[TransferEngine]:
            """A started engine serving on 127.0.0.1; closed and leak-checked at teardown."""
            from ..config import EngineConfig
            from ..engine import TransferEngine

            marker = request.node.get_closest_marker("nixl_engine_config")
            overrides = dict(marker.kwargs) if marker else {}
            overrides.setdefault("engine_id", f"local-{request.node.name[:40]}-{next(_names)}")
            engine = TransferEngine(EngineConfig(**overrides))
            try:
                await engine.start()
                await engine.serve("127.0.0.1", 0)  # (inside: a serve that fails still closes the engine)
                yield engine
            finally:
                from .peer_process import PeerProcess

                # (a test that failed with a peer paused mid-read: its engine would close against a
                # stopped peer, fencing the read and adding a leak error to the test's own)
                PeerProcess.resume_all()
                await engine.close()
            assert_no_live_handles(engine)

    def pytest_configure(config: pytest.Config) -> None:
        config.addinivalue_line(
            "markers", "nixl_engine_config(**fields): EngineConfig fields for the nixl_engine fixture"
        )
