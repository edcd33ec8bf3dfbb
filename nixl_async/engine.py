"""The asyncio transfer engine: sole owner of one NIXL agent, on one event loop.

Everything that touches NIXL runs on the loop that started the engine: registration, the
handshake server and client, posting, the poller that checks transfers and drains
notifications. There is no thread pool. Other threads use `nixl_async.sync.SyncEngine`.

Life cycle::

    async with TransferEngine(EngineConfig(engine_id="decode-0")) as engine:
        layout = engine.register("kv", kv_tensors, num_blocks=1024)
        await engine.serve("127.0.0.1", 5600)          # let peers handshake with us
        peer = await engine.connect("10.0.0.2", 5600)  # handshake with a peer
        await engine.read(peer, local_blocks=[0, 1], remote_blocks=[7, 9], notify=b"req-1")

This class is the thin owner of the loop, the agent and the poller; the work is done by:

- `_driver.py`: carries each transfer from submit to quiet (the state machine in `_state.py`
  meets NIXL there), posting large transfers slice by slice so no coroutine stalls for more
  than one slice's copy;
- `_dialer.py`: reaching peers, by a handshake at their address or through etcd;
- `_connections.py`: what NIXL holds per peer, on top of the pure registry in `_peers.py`;
- `_memory.py`: our registrations and prepared descriptor lists;
- `_notify_transport.py`: notifications out (NIXL or side channel) and in;
- `_admission.py`: backpressure, a FIFO over `max_inflight_transfers` and `max_inflight_bytes`;
- `_poller.py`: when the poller sweeps (its pacing).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from numbers import Integral
from typing import Any, Self

import msgspec
import numpy as np
import numpy.typing as npt
import zmq.asyncio

from . import messages
from ._admission import Admission
from ._agent import NIXL_ERRORS, OwnedAgent
from ._connections import Connections
from ._dialer import Dialer, handshake_limit, segment_mismatch
from ._driver import COLLECTOR, TransferCollection, TransferDriver, earliest
from ._memory import MemoryRegistry, ViewLike, layout_of_memory
from ._notify_guard import REFUSAL_REASONS
from ._notify_transport import WIREUP_BRISK_S, NotificationTransport
from ._peers import Peer, PeerTable, pick_layout, reply_fingerprint
from ._poller import AdaptivePacer, ErrorThrottle
from ._state import TransferState
from ._zmq_tcp import bare_host
from .config import UCX_TCP_DEFAULT_SEGMENT, EngineConfig, SendBufferLimits, tcp_segment_in_use
from .exceptions import (
    CallTooLarge,
    CollectionClosedError,
    EngineClosedError,
    EngineIdMismatch,
    HandshakeRejected,
    LayoutError,
    LeaseExpired,
    PeerUnknownError,
    TransferCancelled,
    TransferFailed,
    TransferTimeout,
    WrongThreadError,
)
from .handshake import HandshakeServer, Refusal, call_peer
from .layout import (
    BlockLayout,
    BlockView,
    DescIds,
    LayoutKind,
    as_block_id_rows,
    as_block_ids,
    pair_descriptor_id_rows,
    pair_descriptor_ids,
    pair_short_ids,
)
from .notifications import Lease, Notification, NotificationBox
from .stats import EngineStats, StatsSnapshot
from .transfer import Transfer, TransferBatch, TransferResult

__all__ = ["Peer", "TransferEngine"]

log = logging.getLogger(__name__)

BlockIds = Sequence[int] | npt.ArrayLike
BlockIdRows = Sequence[Sequence[int]] | npt.ArrayLike  # one row of block ids per transfer
_CLOSE_GRACE_S = 0.2  # progress this long at close when a notification went out recently
# Agents (and the memory their handles use) that closed with handles NIXL never let go of: never
# destroyed, so no byte can land in freed memory. Empty unless a close ran into a fenced transfer.
_KEPT_ALIVE: list[tuple[Any, list[Any], list[Transfer]]] = []


_CALL_ENVELOPE = 512  # a call's msgpack fields beside its topic, engine id and payload (nonces, MAC, limits)


def _unreachable_host(host: str) -> bool:
    """A bind address no peer can dial (all interfaces): published, readers would dial their own host."""
    return bare_host(host) in ("", "0.0.0.0", "::", "*")


class TransferEngine:
    """The engine. Create it, then `start()` it (or use ``async with``) on the loop that owns it."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self.stats = EngineStats()
        self._agent: OwnedAgent | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._server: HandshakeServer | None = None
        self._poller: asyncio.Task[None] | None = None
        self._closing = False
        self._closer: asyncio.Future[None] | None = None  # close()'s work, which a cancelled caller leaves running
        self._housekeeping_errors = ErrorThrottle(log, "NIXL error draining notifications")
        self._compat_hash = messages.compat_hash(self.config.compat)
        self._reply_cache: messages.MetadataReply | None = None
        # The largest UCX/TCP segment our agent sends and receives (set by start; None: no UCX backend).
        self._tcp_segment: int | None = None
        self.extra: dict[str, str] = {}
        self._call_handlers: dict[str, Callable[[str, bytes], bytes]] = {}
        self._closed = False
        self._final_live: dict[str, int] = {}
        self._wake: asyncio.Future[None] | None = None  # resolved to end the poller's sleep
        self._wake_timer: asyncio.Handle | None = None  # ends it when due
        self._wake_due = 0.0  # loop time it is due (uvloop hands back a bare Handle for sub-ms delays)
        self._backing_off = False  # the poller waits after an error: only new work may cut that short
        self._memory = MemoryRegistry()
        self._admission = Admission(self.config.max_inflight_transfers, self.config.max_inflight_bytes)
        self._notifications = NotificationBox(
            self.config.max_unclaimed_notifications, self.config.max_unclaimed_notification_bytes
        )
        self._pacer = AdaptivePacer(self.config.poll)
        self._notify = NotificationTransport(self.config, self.stats, self._notifications, self._pacer, self._wakeup)
        table = PeerTable()
        self._driver = TransferDriver(
            self.config, self.stats, self._admission, table, self._notify, self._pacer, self._wakeup, self._check_by
        )
        self._peers = Connections(
            self.config, self.stats, table, self._memory, self._driver, self._notify, self.poll_soon
        )
        self._dialer = Dialer(self.config, self.stats, self._peers, self._compat_hash)

    # -- life cycle -----------------------------------------------------------------------
    @property
    def engine_id(self) -> str:
        return self.config.engine_id

    @property
    def agent_name(self) -> str:
        if self._agent is None:
            raise EngineClosedError("the engine is not running: start() it first")
        return self._agent.name

    @property
    def running(self) -> bool:
        return self._agent is not None and not self._closing

    @property
    def address(self) -> tuple[str, int] | None:
        """Where our handshake server listens, once `serve()` was called (None if it failed for good)."""
        if self._server is None or self._server.failed is not None:
            return None
        return self._server.host, self._server.port

    async def start(self) -> Self:
        """Create the NIXL agent (progress thread off) and the poller on the running loop."""
        if self._closed:
            raise EngineClosedError("engine was closed: make a new one")
        if self._agent is not None:
            raise RuntimeError("engine already started")
        self._loop = asyncio.get_running_loop()
        self._dialer.open_directory()  # first: if it cannot be made, nothing else was
        agent_name = f"{self.engine_id}/{time.time_ns():x}"
        if "UCX" in self.config.backends:  # before the agent: an unreadable UCX size in the environment stops here
            self._tcp_segment = tcp_segment_in_use(self.config.tcp_segment_bytes, os.environ)
        limits = SendBufferLimits.of_host()
        settings = {name: self.config.backend_settings(name, os.environ, limits) for name in self.config.backends}
        self._agent = OwnedAgent(agent_name, self.config.backends, settings)
        self._zmq = zmq.asyncio.Context()
        self._notify.open(self._agent, self._zmq)
        self._dialer.open(self._loop, self._zmq, agent_name, self._tcp_segment)
        self._driver.agent = self._peers.agent = self._agent
        self._driver.loop = self._loop
        self._poller = self._loop.create_task(self._poll_forever(), name=f"nixl-poller:{self.engine_id}")
        return self

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop serving, end what is in flight, release every handle, deregister memory, drop the agent.

        Transfers in flight end with `TransferCancelled` once their memory is quiet (or
        `TransferFenced` after the grace). If NIXL still holds a handle then, that memory is never
        deregistered or freed: the agent and the memory are kept alive (and logged) instead.
        """
        if self._agent is None:
            return
        if asyncio.get_running_loop() is not self._loop:  # (its poller and closer would run on the wrong loop)
            raise WrongThreadError("close() this engine on the event loop that started it")
        if self._closer is None:
            self._closing = True
            self._dialer.stop()  # no follower adopts peers, none starts, from here on
            self._admission.close()  # waiters wake and fail with EngineClosedError
            self._notifications.close(EngineClosedError("the engine was closed"))
            self._driver.end_all(lambda t: TransferCancelled("the engine was closed", transfer_id=t.id, peer=t.peer))
            self._closer = asyncio.ensure_future(self._close(self._agent))
        # A caller cancelled meanwhile (`asyncio.timeout`, a TaskGroup) stops waiting, not closing:
        # stopped halfway the engine would refuse work yet hold its agent, memory and poller for good.
        await asyncio.shield(self._closer)

    async def _close(self, agent: OwnedAgent) -> None:
        try:
            await self._wind_down()
        finally:  # also when cancelled midway: `asyncio.run`'s shutdown cancels every task left, this one too
            self._release(agent)

    async def _wind_down(self) -> None:
        """Stop serving and connecting, end every transfer, and give NIXL the grace to let go of them."""
        assert self._loop is not None
        if self._server is not None:
            await self._server.close()
        await self._dialer.close()  # our etcd record goes (lease revoked) before our memory does
        driver = self._driver
        # The poller carries ended transfers to quiet (or fenced, after the grace). Notifications
        # sent moments ago leave only as the worker is progressed: give them a moment too.
        recent = self._loop.time() - self._notify.last_sent_at < WIREUP_BRISK_S
        deadline = time.monotonic() + self.config.release_grace_s + 0.5
        brisk_until = time.monotonic() + (_CLOSE_GRACE_S if recent else 0.0)
        while (driver.active or driver.fenced or time.monotonic() < brisk_until) and time.monotonic() < deadline:
            self.poll_soon()  # (a poke: an error back-off keeps its pace)
            await asyncio.sleep(0.001)
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller

    def _release(self, agent: OwnedAgent) -> None:
        """Release what NIXL no longer holds and drop the agent; keep both alive where it still holds some."""
        if self._poller is not None:
            self._poller.cancel()
        driver = self._driver
        driver.fence_releasing()  # cut short, or past the grace: a caller not told yet hears now
        self._notify.close()  # first: forgetting the peers below would close their sockets lingering
        fenced = [t for t in driver.live() if not t.quiet]
        if fenced:
            # NIXL may still write into (or read from) that memory: never deregister or free it.
            log.error("closing with %d transfers NIXL still holds (%s): keeping the agent and its memory alive",
                      len(fenced), ", ".join(f"#{t.id}" for t in fenced))  # fmt: skip
            _KEPT_ALIVE.append((agent, self._memory.keepalives(), fenced))
            self._memory.forget()
            for transfer in fenced:  # nothing checks them any more: their quiet-waiters hear so
                transfer.abandon()
        else:
            self._peers.release_all()  # (logs what NIXL refuses to unload)
            try:
                self._memory.release_all(agent)
                self.stats.counters["registered_bytes"] = 0  # (kept where NIXL still holds it: it is)
            except NIXL_ERRORS as exc:  # the close goes on; what NIXL may still hold is never freed
                log.error("closing: NIXL refused to release our memory (%s): keeping the agent and its memory alive",
                          exc)  # fmt: skip
                _KEPT_ALIVE.append((agent, self._memory.keepalives(), []))
                self._memory.forget()
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
        self._final_live = agent.live_handles()
        # Drop the agent here, on the loop thread: its destructor tears down the UCX worker.
        self._agent = self._driver.agent = self._peers.agent = None
        self._closed = True
        del agent

    def _require_agent(self) -> OwnedAgent:
        if self._agent is None or self._closing:
            raise EngineClosedError("the engine is not running: start() it first (and do not use it after close())")
        running = asyncio._get_running_loop()
        if running is not None and running is not self._loop:
            # Its poller, futures and notifications live on the loop that started it: from another
            # loop a transfer would be posted with nobody to complete it, a wait would never end.
            raise WrongThreadError("this engine runs on the event loop that started it, not this one")
        return self._agent

    def live_handles(self) -> dict[str, int]:
        """Live NIXL handles by kind; all zero (empty) after `close()` unless memory stayed fenced."""
        return self._agent.live_handles() if self._agent is not None else dict(self._final_live)

    def snapshot(self) -> StatsSnapshot:
        """Counters, latency histograms and live handles, as a plain value."""
        admission = self._admission
        extra = {
            "notifications_dropped": self._notifications.dropped,
            "subscriptions_lost": self._notifications.lost_subscriptions,
            "backpressure_waits": admission.waits,
            "backpressure_timeouts": admission.timeouts,
            "inflight_transfers": admission.count,
            "inflight_bytes": admission.bytes,
        }
        if self._server is not None:
            extra.update(
                handshakes_answered=self._server.served,
                handshakes_rejected=self._server.rejected,
                handshake_auth_failures=self._server.auth_failures,
                handshake_server_restarts=self._server.restarts,
                handshake_server_failed=int(self._server.failed is not None),
            )
            extra.update({f"notifications_refused_{r}": self._server.notifications_refused[r] for r in REFUSAL_REASONS})
        return self.stats.snapshot(self.live_handles(), extra)

    # -- memory ---------------------------------------------------------------------------
    def register(
        self,
        name: str,
        memory: Any,
        *,
        num_blocks: int | None = None,
        block_len: int | None = None,
        kind: LayoutKind = LayoutKind.REGIONS,
        block_size: int = 0,
    ) -> BlockLayout:
        """Register tensors or arrays (one region each, equal sizes) as layout `name`.

        Give `num_blocks` or `block_len`; the other is derived from the region size. Memory on a
        CUDA device registers as VRAM. The engine keeps the objects alive until it closes.
        """
        layout, keepalive = layout_of_memory(
            name, memory, num_blocks=num_blocks, block_len=block_len, kind=kind, block_size=block_size
        )
        return self.register_layout(layout, keepalive=keepalive)

    def register_layout(self, layout: BlockLayout, *, keepalive: list[Any] | None = None) -> BlockLayout:
        """Register raw memory described by `layout` (the caller keeps that memory alive)."""
        self._memory.register(self._require_agent(), layout, keepalive or [])
        self._changed()
        self.stats.counters["registered_bytes"] += layout.total_bytes
        return layout

    def deregister(self, name: str) -> None:
        """Deregister a layout. Transfers using it must have finished.

        Its objects stay referenced until the engine closes: a peer that still holds our older
        metadata (until it connects again) may reach that memory over transports that check no
        keys (UCX over TCP), so it must not be freed, nor given other data while such peers run.
        """
        agent = self._require_agent()
        handles = self._memory.local_dlists_of(name)
        busy = [t for t in self._driver.live() if any(t.local_dlist is h for h in handles)]
        if busy:
            fenced = sum(t.state is TransferState.FENCED for t in busy)
            raise LayoutError(f"layout {name!r} has {len(busy)} transfers in flight ({fenced} fenced): kept registered")
        layout = self._memory.layouts.get(name)
        self._memory.deregister(agent, name)
        if layout is not None:  # (what is registered now, as the counter's name says)
            self.stats.counters["registered_bytes"] -= layout.total_bytes
        self._changed()

    def layout(self, name: str | None = None) -> BlockLayout:
        """Our registered layout called `name` (or our only one)."""
        return pick_layout(self._memory.layouts, name, "this engine")

    # -- handshake ------------------------------------------------------------------------
    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Answer handshakes on host:port (port 0 picks a free one); returns the address."""
        self._require_agent()
        if self._server is not None and self._server.failed is None:
            raise RuntimeError(f"already serving on {self._server.host}:{self._server.port}")
        if _unreachable_host(host) and self._dialer.directory is not None and self._dialer.directory.published:
            raise ValueError(f"serve({host!r}): this engine is published in etcd, and peers cannot dial {host!r}; "
                             "serve on an address they reach")  # fmt: skip
        assert self._zmq is not None
        server = HandshakeServer(
            self._zmq,
            self._reply_for,
            max_request_bytes=self.config.max_request_bytes,
            max_frame_bytes=self.config.max_frame_bytes,
            on_request=self._on_handshake_request,
            on_notify=self._notify.deliver,
            on_busy_hint=self._on_busy_hint,
            on_call=self._answer_call,
            secret=self.config.auth_secret,
            on_failed=self._changed,  # (our etcd record then names no address: readers stop dialling it)
        )
        if self._server is not None:  # sessions the failed one issued stay good here (peers notify in them)
            server.guard = self._server.guard
        address = await server.start(host, port)
        if self._server is not None:  # one that failed for good: this one serves instead
            await self._server.close()
        self._server = server
        self._changed()  # a published record now names our side channel
        return address

    def _on_handshake_request(self) -> None:
        self.stats.counters["handshakes_served"] += 1
        self._stay_brisk(WIREUP_BRISK_S)

    def _on_busy_hint(self, seconds: float) -> None:
        """A peer has transfers with us in flight: over TCP they move only while our worker is progressed."""
        self.stats.counters["busy_hints_received"] += 1
        if self.config.poll.follow_busy_hints:
            self._stay_brisk(seconds)

    def _stay_brisk(self, seconds: float) -> None:
        assert self._loop is not None
        self._pacer.stay_brisk(self._loop.time() + seconds)
        self._wakeup()

    def _reply_for(self, request: messages.MetadataRequest) -> messages.MetadataReply:
        self._refuse_if_not(request.expected_engine_id)
        if self._tcp_segment is not None and request.tcp_segment_bytes < self._tcp_segment:
            raise Refusal("incompatible_peer", segment_mismatch(request.tcp_segment_bytes, self._tcp_segment))
        self._memory.mark_exposed()  # a peer gets the keys to what is registered now
        return msgspec.structs.replace(self._metadata(), wall_clock=time.time())

    def _metadata(self) -> messages.MetadataReply:
        """What a handshake answers (and a published record holds), built once per change."""
        if self._reply_cache is None:
            agent = self._require_agent()
            self._reply_cache = messages.MetadataReply(
                version=messages.PROTOCOL_VERSION,
                engine_id=self.engine_id,
                agent_name=agent.name,
                agent_metadata=agent.metadata(),
                compat_hash=self._compat_hash,
                layouts=list(self._memory.layouts.values()),
                extra=dict(self.extra),
                tcp_segment_bytes=self._dialer.announced_segment,
                max_request_bytes=min(self.config.max_request_bytes, self.config.max_frame_bytes),
            )
        return self._reply_cache

    # -- calls: small acknowledged exchanges over the side channel ----------------------------
    def handle_calls(self, topic: str, handler: Callable[[str, bytes], bytes]) -> None:
        """Answer peers' `call(peer, topic, payload)`: ``handler(sender_engine_id, payload)`` -> reply.

        The handler runs on the loop thread and must not block (a coroutine function is refused:
        it would never be awaited). Raising `ValueError` refuses the call with its message (the
        caller gets `HandshakeRejected`); anything else, or a reply that is not bytes, is refused
        as an internal error. Calls are authenticated like handshakes.
        """
        if inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(type(handler).__call__):
            raise TypeError(f"handle_calls({topic!r}): the handler must be a plain function returning bytes")
        self._call_handlers[topic] = handler

    def _refuse_if_not(self, expected: str | None) -> None:
        """Refuse a request meant for another engine (one that served this address before; None or "": any)."""
        if expected and expected != self.engine_id:
            raise Refusal("engine_id_mismatch", f"this is engine {self.engine_id!r}, not {expected!r}")

    def _answer_call(self, request: messages.CallRequest) -> messages.CallReply:
        self._refuse_if_not(request.to_engine_id)
        handler = self._call_handlers.get(request.topic)
        if handler is None:
            raise Refusal("unknown_topic", f"engine {self.engine_id!r} answers no calls on {request.topic!r}")
        try:
            payload = handler(request.engine_id, request.payload)
        except ValueError as exc:
            raise Refusal("refused", str(exc)) from None
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError(f"the handler of {request.topic!r} returned a {type(payload).__name__}, not bytes")
        payload = bytes(payload)
        self.stats.counters["calls_answered"] += 1
        return messages.CallReply(engine_id=self.engine_id, payload=payload)

    async def call(self, peer: Peer, topic: str, payload: bytes, *, timeout: float | None = None) -> bytes:
        """Ask `peer`'s handler for `topic` (see `handle_calls`) and return its reply.

        One request and one reply over the peer's side channel, bounded by `timeout` (default:
        the handshake timeout). Raises `HandshakeTimeout`, `HandshakeRejected`, `ProtocolError`,
        or `EngineIdMismatch` when another engine now answers at the peer's address (refused there
        before its handler runs); `CallTooLarge` (a `ValueError`) at once, unsent, for a payload over
        what the peer takes (its `EngineConfig.max_request_bytes`, said in its handshake; ours for a peer that
        does not say).
        """
        self._require_agent()
        assert self._zmq is not None
        host, port = peer.address
        if not host:
            raise HandshakeRejected(f"peer {peer.engine_id!r} (found in etcd) serves no side channel to call")
        limit = peer.max_request_bytes or self.config.max_request_bytes
        room = limit - len(topic.encode()) - len(self.engine_id.encode()) - _CALL_ENVELOPE
        if len(payload) > room:  # (refused there: the call would fail only after the round trip, or time out)
            raise CallTooLarge(f"call payload of {len(payload)} bytes is over the {room} {peer.engine_id!r} takes "
                               "(its EngineConfig.max_request_bytes)")  # fmt: skip
        try:
            reply = await call_peer(
                self._zmq,
                host,
                port,
                messages.CallRequest(
                    engine_id=self.engine_id, topic=topic, payload=payload, to_engine_id=peer.engine_id
                ),
                timeout=handshake_limit(self.config, timeout, f"{host}:{port}"),
                max_frame_bytes=self.config.max_frame_bytes,
                secret=self.config.auth_secret,
            )
        except BaseException as exc:
            self.stats.counters["call_failures"] += 1
            current = asyncio.current_task()
            if isinstance(exc, asyncio.CancelledError) and self._closing and current and not current.cancelling():
                raise EngineClosedError("the engine closed during the call") from None  # its sockets went
            raise
        if reply.engine_id != peer.engine_id:
            raise EngineIdMismatch(f"{host}:{port} is now engine {reply.engine_id!r}, not {peer.engine_id!r}",
                                   address=f"{host}:{port}")  # fmt: skip
        self.stats.counters["calls"] += 1
        self._peers.table.touch(peer, asyncio.get_running_loop().time())  # (a use: not evicted as idle)
        return reply.payload

    def set_extra(self, **extra: str) -> None:
        """Free-form strings sent to peers in the handshake (adapters put TP rank etc. here)."""
        self.extra.update({k: str(v) for k, v in extra.items()})
        self._changed()

    async def connect(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        engine_id: str | None = None,
        expected_engine_id: str | None = None,
        timeout: float | None = None,
        refresh: bool = False,
    ) -> Peer:
        """Handshake with the engine at host:port (or find `engine_id` in etcd) and return it as a `Peer`.

        With `engine_id` instead of an address, the peer's published record comes from etcd
        (`EngineConfig.etcd`, see `publish`): see `Dialer.connect_published`.

        A peer already connected at that address is returned without a new handshake unless
        `refresh` is set, a transfer with it failed since, or it is not the `expected_engine_id`
        (another engine may have taken the address); if the handshake then finds a new agent or
        engine there, the old one's descriptor lists and remote agent are dropped.
        Concurrent connects to one address share one handshake; connects to different addresses
        run concurrently.

        Raises `HandshakeTimeout`, `HandshakeRejected`, `ProtocolError`, `IncompatiblePeerError`
        or `EngineIdMismatch` (and through etcd `DiscoveryUnavailable` or `PeerNotPublished`).
        """
        self._require_agent()
        if engine_id is not None:
            if host is not None or port is not None or expected_engine_id not in (None, engine_id):
                raise TypeError("connect() takes host and port, or an engine_id to find in etcd, not both")
            return await self._dialer.connect_published(engine_id, timeout, refresh)
        if host is None or port is None:
            raise TypeError("connect() needs host and port, or engine_id")
        if not isinstance(host, str) or not host.strip() or isinstance(port, bool) or not isinstance(port, Integral):
            raise TypeError(f"connect() takes a host name or address and an int port, got {host!r}, {port!r}")
        if not 0 < port < 65536:
            raise ValueError(f"connect(): port {port} is outside 1..65535")
        return await self._dialer.connect(host, int(port), expected_engine_id, timeout, refresh)

    # -- discovery through etcd -------------------------------------------------------------
    async def publish(self) -> None:
        """Publish this engine in etcd (`EngineConfig.etcd`) so peers can ``connect(engine_id=...)``.

        What is published: our engine id, compat hash and side-channel address, and (without a
        shared secret) what our handshake answers: agent metadata, layouts, extra. With a secret
        the metadata stays behind the authenticated side channel, where readers then handshake.
        It is put again whenever it changes (a registration, `set_extra`, `serve`), and it lives
        on a lease renewed from our loop: if we die it disappears within `EtcdConfig.lease_ttl_s`;
        `close()` removes it at once. Raises `DiscoveryUnavailable` if etcd does not take it
        within the handshake timeout.
        """
        self._require_agent()
        if self.address is not None and _unreachable_host(self.address[0]):
            raise ValueError(f"publish(): serving on {self.address[0]!r}, an address peers cannot dial (a wildcard); "
                             "serve on an address they reach to publish it")  # fmt: skip
        await self._dialer.require_directory().publish(self._published())

    def _published(self) -> messages.PublishedEngine:
        reply = self._metadata()
        if self.config.auth_secret is None:  # (with a secret the record holds no metadata)
            self._memory.mark_exposed()
        host, port = self.address or ("", 0)
        larger = reply.tcp_segment_bytes > UCX_TCP_DEFAULT_SEGMENT
        return messages.PublishedEngine(
            version=messages.SEGMENTS_RECORD_VERSION if larger else messages.PROTOCOL_VERSION,
            engine_id=self.engine_id,
            compat_hash=self._compat_hash,
            host=host,
            port=port,
            metadata=None if self.config.auth_secret is not None else reply,
            fingerprint=reply_fingerprint(reply),
        )

    def _changed(self) -> None:
        """What a handshake answers changed: rebuild the reply, and put it in etcd again if published."""
        self._reply_cache = None
        if self._agent is not None and not self._closing:
            self._dialer.republish(self._published)

    def peer(self, engine_id: str) -> Peer:
        """The connected peer with that engine id (raises `PeerUnknownError`)."""
        peer = self._peers.table.get(engine_id)
        if peer is None:
            raise PeerUnknownError(engine_id)
        return peer

    @property
    def peers(self) -> list[Peer]:
        return list(self._peers.table)

    def disconnect(self, peer: Peer) -> None:
        """Forget a peer: fail its transfers, release its descriptor lists and remote agent.

        A peer already forgotten is left as it is; one this engine does not hold (another engine's)
        raises `PeerUnknownError`.
        """
        self._require_agent()
        if peer.connected and peer not in self._peers.table:
            raise PeerUnknownError(f"peer {peer.engine_id!r} is not one of this engine's")
        self._peers.forget(peer)

    # -- transfers ------------------------------------------------------------------------
    async def start_read(
        self,
        peer: Peer,
        local_blocks: BlockIds,
        remote_blocks: BlockIds,
        *,
        local: ViewLike = None,
        remote: ViewLike = None,
        notify: bytes | None = None,
        timeout: float | None = None,
        lease_expires_at: float | None = None,
    ) -> Transfer:
        """Submit a READ of the peer's `remote_blocks` into our `local_blocks`.

        Waits only for admission (backpressure), then returns the `Transfer`; await it for the
        result. `local`/`remote` choose layouts or views (default: the only layout on each
        side). `notify` is delivered to the peer once all data has moved. With empty block lists
        only the notification is sent (a full prefix-cache hit). `timeout` sets a deadline
        counted from now (default `EngineConfig.transfer_timeout_s`), enforced even if nobody
        awaits the transfer. `lease_expires_at` is the producer's lease expiry (its `time.time()`,
        see `lend`): past it the read is refused with `LeaseExpired` before anything is posted,
        and the transfer's deadline never runs beyond it.

        Raises `LayoutError` (a `ValueError`) for bad ids or views before anything is posted.
        """
        return await self._submit(
            "READ", peer, local_blocks, remote_blocks, local, remote, notify, timeout, lease_expires_at
        )

    async def start_write(
        self,
        peer: Peer,
        local_blocks: BlockIds,
        remote_blocks: BlockIds,
        *,
        local: ViewLike = None,
        remote: ViewLike = None,
        notify: bytes | None = None,
        timeout: float | None = None,
        lease_expires_at: float | None = None,
    ) -> Transfer:
        """Submit a WRITE of our `local_blocks` into the peer's `remote_blocks` (see `start_read`)."""
        return await self._submit(
            "WRITE", peer, local_blocks, remote_blocks, local, remote, notify, timeout, lease_expires_at
        )

    async def settle(self, transfers: Sequence[Transfer], timeout: float | None = None) -> bool:
        """Cancel the unfinished `transfers` and wait until NIXL holds none of their handles.

        After a request fails, its memory may be handed to someone else only once no sibling
        transfer can still write into it; cancelling is not enough while a READ is in flight
        (NIXL accepts the release and the bytes keep landing). True once every one of them is
        quiet; False if some handle is still alive after `timeout`, or when the engine closed with
        NIXL holding one (that memory stays fenced).
        """
        for transfer in transfers:
            transfer.cancel("settling a failed request")
        self._wakeup()
        try:
            async with asyncio.timeout(timeout):
                for transfer in transfers:
                    if not await transfer.wait_quiet():
                        return False
        except TimeoutError:
            return False
        return True

    def renew_lease(self, transfers: Iterable[Transfer], lease_expires_at: float) -> int:
        """The producer's lease on running `transfers` now ends at `lease_expires_at` (its `time.time()`,
        as given at submit): a read longer than the first lease need not fail while the lease is renewed.

        Each deadline follows its lease but never passes the transfer's own `timeout`. An expiry
        already past (the producer let the blocks go) ends them with `LeaseExpired`, reported once
        NIXL holds none of their handles, as any error. Transfers submitted without a lease, and
        ended ones, are left alone. Returns how many were moved. Call it on the engine's loop.
        """
        self._require_agent()
        if asyncio._get_running_loop() is not self._loop:
            raise WrongThreadError("renew_lease() runs on the engine's loop (its transfers' deadlines live there)")
        if lease_expires_at != lease_expires_at:
            raise ValueError("lease_expires_at must be a number of seconds, not NaN")
        assert self._loop is not None
        now, wall = self._loop.time(), time.time()
        moved = 0
        for transfer in transfers:
            peer = self._peers.table.of_agent(transfer.remote_agent)
            if peer is not None:  # (a forgotten peer's transfers failed with it)
                moved += self._driver.renew_lease(transfer, now + lease_expires_at - (wall + peer.clock_offset_s))
        return moved

    @contextlib.contextmanager
    def collect_transfers(self) -> Iterator[list[Transfer]]:
        """Collect every transfer submitted inside this block, by this task or tasks it starts.

        For a request made of several transfers: whatever way it ends, `settle()` the list
        before handing the request's memory to anyone (a sibling may still be in flight). A task
        started inside that submits after the block ended gets `CollectionClosedError` (nothing
        posted): the list's owner may have settled it and handed the memory on.
        """
        collected = TransferCollection()
        token = COLLECTOR.set(collected)
        try:
            yield collected
        finally:
            collected.closed = True
            COLLECTOR.reset(token)

    async def read(self, peer: Peer, local_blocks: BlockIds, remote_blocks: BlockIds, **kwargs: Any) -> TransferResult:
        """`start_read` and wait for it."""
        return await (await self.start_read(peer, local_blocks, remote_blocks, **kwargs))

    async def write(self, peer: Peer, local_blocks: BlockIds, remote_blocks: BlockIds, **kwargs: Any) -> TransferResult:
        """`start_write` and wait for it."""
        return await (await self.start_write(peer, local_blocks, remote_blocks, **kwargs))

    async def start_reads(
        self,
        peer: Peer,
        local_blocks: BlockIdRows,
        remote_blocks: BlockIdRows,
        *,
        local: ViewLike = None,
        remote: ViewLike = None,
        notify: Sequence[bytes | None] | None = None,
        timeout: float | None = None,
        lease_expires_at: float | None = None,
    ) -> list[Transfer]:
        """`start_read` for many transfers at once: transfer i reads `remote_blocks[i]` into `local_blocks[i]`.

        Each side is one row of block ids per transfer (rows of one length, e.g. an (n, k) array,
        are checked in one numpy pass). Every row is validated before anything is posted, and the
        peer, views, descriptor lists and deadline are resolved once for all, so each transfer
        costs less than its own `start_read`. A row with no blocks on either side only notifies.
        `notify` holds one message (or None) per transfer. Admission is all or nothing: the batch
        waits for room for every one of its transfers (a batch beyond the engine's limits goes
        alone, as an oversized transfer does), and if the deadline passes first
        (`TransferTimeout`) or the caller is cancelled, nothing was posted.
        """
        return await self._submit_rows(
            "READ", peer, local_blocks, remote_blocks, local, remote, notify, timeout, lease_expires_at
        )

    async def start_writes(
        self,
        peer: Peer,
        local_blocks: BlockIdRows,
        remote_blocks: BlockIdRows,
        *,
        local: ViewLike = None,
        remote: ViewLike = None,
        notify: Sequence[bytes | None] | None = None,
        timeout: float | None = None,
        lease_expires_at: float | None = None,
    ) -> list[Transfer]:
        """`start_write` for many transfers at once (see `start_reads`)."""
        return await self._submit_rows(
            "WRITE", peer, local_blocks, remote_blocks, local, remote, notify, timeout, lease_expires_at
        )

    async def start_read_batch(
        self,
        peer: Peer,
        local_blocks: BlockIdRows,
        remote_blocks: BlockIdRows,
        *,
        local: ViewLike = None,
        remote: ViewLike = None,
        timeout: float | None = None,
        lease_expires_at: float | None = None,
    ) -> TransferBatch:
        """Many independent reads as one `TransferBatch`: row i reads `remote_blocks[i]` into `local_blocks[i]`.

        For thousands of small transfers in flight at once: each row is one NIXL request that
        succeeds or fails alone, but the batch is one object to submit, track and await (see
        `TransferBatch`), so the engine's cost per row is a fraction of a `Transfer`'s. Rows are
        validated as by `start_reads` and every row needs blocks; admission takes room for every
        row at once; `timeout` and `lease_expires_at` hold for the whole batch. No notifications:
        send one with `notify()` once the batch is done.
        """
        return await self._submit_batch("READ", peer, local_blocks, remote_blocks, local, remote, timeout,
                                        lease_expires_at)  # fmt: skip

    async def start_write_batch(
        self,
        peer: Peer,
        local_blocks: BlockIdRows,
        remote_blocks: BlockIdRows,
        *,
        local: ViewLike = None,
        remote: ViewLike = None,
        timeout: float | None = None,
        lease_expires_at: float | None = None,
    ) -> TransferBatch:
        """Many independent writes as one `TransferBatch` (see `start_read_batch`)."""
        return await self._submit_batch("WRITE", peer, local_blocks, remote_blocks, local, remote, timeout,
                                        lease_expires_at)  # fmt: skip

    async def _submit_batch(self, op: str, peer: Peer, local_blocks: BlockIdRows, remote_blocks: BlockIdRows,
                            local: ViewLike, remote: ViewLike, timeout: float | None,
                            lease_expires_at: float | None) -> TransferBatch:  # fmt: skip
        local_view, remote_view = self._submit_views(peer, local, remote)
        lrows = as_block_id_rows(local_blocks, local_view.layout.num_blocks, what="local", unique=op == "READ")
        rrows = as_block_id_rows(remote_blocks, remote_view.layout.num_blocks, what="remote", unique=op == "WRITE")
        lidx, ridx = pair_descriptor_id_rows(local_view, lrows, remote_view, rrows)
        lengths = [lidx.shape[1]] * len(lidx) if isinstance(lidx, np.ndarray) else [len(row) for row in lidx]
        if not lengths:
            raise ValueError("a batch needs at least one row")
        if not all(lengths):
            raise ValueError(f"row {lengths.index(0)} of the batch has no blocks (every row needs some)")
        piece_len = local_view.piece_len
        deadline, lease_deadline = self._deadlines(peer, timeout, lease_expires_at)
        local_dlist, remote_dlist = await self._admit(peer, [n * piece_len for n in lengths], deadline,
                                                      lease_deadline, local_view, remote_view)  # fmt: skip
        descriptors = sum(lengths)
        return self._driver.submit_batch(op, peer, local_dlist, remote_dlist, (lidx, ridx), descriptors,
                                         descriptors * piece_len, deadline, lease_deadline,
                                         _route(local_view, remote_view))  # fmt: skip

    async def _submit(
        self,
        op: str,
        peer: Peer,
        local_blocks: BlockIds,
        remote_blocks: BlockIds,
        local: ViewLike,
        remote: ViewLike,
        notify: bytes | None,
        timeout: float | None,
        lease_expires_at: float | None = None,
    ) -> Transfer:
        local_view, remote_view = self._submit_views(peer, local, remote)
        if notify is not None:
            self._notify.check(notify, op, peer)
        lidx: DescIds
        ridx: DescIds
        short = pair_short_ids(local_view, local_blocks, remote_view, remote_blocks, op=op)
        if short is not None:  # a few blocks (one request's): plain tuples, no numpy
            lidx, ridx = short
        else:
            lids = as_block_ids(local_blocks, local_view.layout.num_blocks, what="local", unique=op == "READ")
            rids = as_block_ids(remote_blocks, remote_view.layout.num_blocks, what="remote", unique=op == "WRITE")
            if len(lids) == 0 and len(rids) == 0:
                if notify is not None:  # (travels as configured, even a WRITE's)
                    self._notify.check(notify, "NOTIFY", peer)
                self._may_only_notify(peer, timeout, lease_expires_at)
                return self._driver.notify_only(op, peer, notify)
            lidx, ridx = pair_descriptor_ids(local_view, lids, remote_view, rids)
        if notify is not None and len(lidx):  # (most submits notify nothing: no call for them)
            self._notify.check_rides(notify, op)
        nbytes = len(lidx) * local_view.piece_len
        deadline, lease_deadline = self._deadlines(peer, timeout, lease_expires_at)
        if self._admission.try_acquire(nbytes):  # room now: no coroutine to wait in
            local_dlist, remote_dlist = self._admitted(peer, (nbytes,), local_view, remote_view)
        else:
            local_dlist, remote_dlist = await self._admit(peer, (nbytes,), deadline, lease_deadline, local_view,
                                                          remote_view)  # fmt: skip
        return self._driver.submit(op, peer, (local_dlist, lidx), (remote_dlist, ridx), local_view.piece_len, notify,
                                   deadline, lease_deadline, _route(local_view, remote_view))  # fmt: skip

    async def _submit_rows(
        self,
        op: str,
        peer: Peer,
        local_blocks: BlockIdRows,
        remote_blocks: BlockIdRows,
        local: ViewLike,
        remote: ViewLike,
        notify: Sequence[bytes | None] | None,
        timeout: float | None,
        lease_expires_at: float | None,
    ) -> list[Transfer]:
        local_view, remote_view = self._submit_views(peer, local, remote)
        lrows = as_block_id_rows(local_blocks, local_view.layout.num_blocks, what="local", unique=op == "READ")
        rrows = as_block_id_rows(remote_blocks, remote_view.layout.num_blocks, what="remote", unique=op == "WRITE")
        n = len(lrows)
        notes = [None] * n if notify is None else list(notify)
        if len(notes) != n:
            raise ValueError(f"notify has {len(notes)} messages for {n} transfers")
        if notify is not None:
            for message in notes:
                if message is not None:
                    self._notify.check(message, op, peer)
        lidx, ridx = pair_descriptor_id_rows(local_view, lrows, remote_view, rrows)
        if notify is not None and not (isinstance(lidx, np.ndarray) and lidx.shape[1]):  # some rows may be empty
            for row, message in zip(lidx, notes, strict=True):
                if message is not None and not len(row):  # it only notifies, as configured (even a WRITE)
                    self._notify.check(message, "NOTIFY", peer)
        if op == "WRITE" and notify is not None:
            for row, message in zip(lidx, notes, strict=True):
                if len(row):
                    self._notify.check_rides(message, op)
        piece_len = local_view.piece_len
        if isinstance(lidx, np.ndarray):  # rows of one length
            sizes = [lidx.shape[1] * piece_len] * len(lidx) if lidx.shape[1] else []
        else:  # rows without blocks only notify: they need no room
            sizes = [len(row) * piece_len for row in lidx if len(row)]
        if not sizes:  # nothing to read or write: notifications only
            self._may_only_notify(peer, timeout, lease_expires_at)
            return [self._driver.notify_only(op, peer, m) for m in notes]
        deadline, lease_deadline = self._deadlines(peer, timeout, lease_expires_at)
        local_dlist, remote_dlist = await self._admit(peer, sizes, deadline, lease_deadline, local_view,
                                                      remote_view)  # fmt: skip
        rows = zip(lidx, ridx, notes, strict=True)
        return self._driver.submit_many(op, peer, local_dlist, remote_dlist, piece_len, rows, deadline,
                                        lease_deadline, _route(local_view, remote_view))  # fmt: skip

    def _require_peer(self, peer: Peer) -> None:
        self._require_agent()
        if not peer.connected or peer not in self._peers.table:
            raise PeerUnknownError(f"peer {peer.engine_id!r} is not connected (connect again)")

    def _submit_views(self, peer: Peer, local: ViewLike, remote: ViewLike) -> tuple[BlockView, BlockView]:
        """Check the engine and peer, and resolve both sides' views."""
        self._require_peer(peer)
        local_view = self._memory.view(local, self._memory.layouts, "this engine")
        return local_view, self._memory.view(remote, peer.layouts, f"peer {peer.engine_id}")

    def _may_only_notify(self, peer: Peer, timeout: float | None, lease_expires_at: float | None) -> None:
        """A submit with no blocks sends its notification at once: refused as any submit would be (a lease run
        out, a budget spent, a `collect_transfers()` block ended), nothing sent."""
        self._deadlines(peer, timeout, lease_expires_at)
        if (collected := COLLECTOR.get()) is not None and collected.closed:
            raise CollectionClosedError("submitted by a task outliving its collect_transfers() block: not sent")

    def _deadlines(self, peer: Peer, timeout: float | None, lease_expires_at: float | None
                   ) -> tuple[float | None, float | None]:  # fmt: skip
        """A submit's (deadline, lease deadline) in loop time, apart (a renewal moves only the lease:
        `renew_lease`); `LeaseExpired` if the lease already ran out."""
        assert self._loop is not None
        now = self._loop.time()
        for name, value in (("timeout", timeout), ("lease_expires_at", lease_expires_at)):
            if value is not None and value != value:  # NaN: every comparison with it is False (no deadline)
                raise ValueError(f"{name} must be a number of seconds, not NaN")
        if timeout is None:
            timeout = self.config.transfer_timeout_s
        elif timeout <= 0:  # (a budget computed by the caller that ran out): nothing is posted
            raise TransferTimeout(f"the deadline passed before the submit (timeout {timeout}s)", peer=peer.engine_id)
        if lease_expires_at is None:
            return (None if timeout is None else now + timeout), None
        remaining = lease_expires_at - (time.time() + peer.clock_offset_s)
        if remaining <= 0:
            self.stats.counters["lease_refusals"] += 1
            raise LeaseExpired(
                f"the lease from {peer.engine_id} expired {-remaining:.3f}s ago: its blocks may hold other data",
                peer=peer.engine_id,
            )
        return (None if timeout is None else now + timeout), now + remaining

    async def _admit(self, peer: Peer, sizes: Sequence[int], deadline: float | None, lease_deadline: float | None,
                     local_view: BlockView, remote_view: BlockView) -> tuple[Any, Any]:  # fmt: skip
        """Wait for room for transfers of `sizes` bytes, all of them together (nothing is posted before);
        then their (local, remote) prepared descriptor lists. Each transfer gives its room back as it ends.

        The wait ends at the deadline or the lease, whichever comes first (a renewal reaches a transfer
        only once it is submitted); past the lease it is `LeaseExpired`, as a late submit is."""
        try:
            await self._admission.acquire(sum(sizes), earliest(deadline, lease_deadline), count=len(sizes))
        except TimeoutError:
            if lease_deadline is not None and earliest(deadline, lease_deadline) == lease_deadline:
                self.stats.counters["lease_refusals"] += 1
                raise LeaseExpired(f"the lease from {peer.engine_id} ran out while waiting for room to submit: "
                                   "nothing posted", peer=peer.engine_id) from None  # fmt: skip
            raise TransferTimeout("deadline passed while waiting for room to submit", peer=peer.engine_id) from None
        return self._admitted(peer, sizes, local_view, remote_view, waited=True)

    def _admitted(self, peer: Peer, sizes: Sequence[int], local_view: BlockView, remote_view: BlockView, *,
                  waited: bool = False) -> tuple[Any, Any]:  # fmt: skip
        """Room for `sizes` was taken: the descriptor lists, or the room back if the engine or peer went meanwhile.

        After a wait, both views must still describe registered memory: a layout deregistered (or
        registered again, or refreshed by the peer) meanwhile would have its stale addresses
        prepared, and cached for later submits too.
        """
        try:
            assert self._loop is not None
            agent = self._require_agent()  # the engine may have closed while we waited
            if not peer.connected or peer not in self._peers.table:
                raise PeerUnknownError(f"peer {peer.engine_id!r} was disconnected while waiting for room")
            if (collected := COLLECTOR.get()) is not None and collected.closed:
                raise CollectionClosedError("submitted by a task outliving its collect_transfers() block: not posted")
            if waited:
                _still_registered(local_view, self._memory.layouts, "deregistered here")
                _still_registered(remote_view, peer.layouts, f"changed by peer {peer.engine_id!r}")
            self._peers.table.touch(peer, self._loop.time())
            return self._memory.local_dlist(agent, local_view), self._memory.remote_dlist(agent, peer.agent_name,
                                                                                         remote_view)  # fmt: skip
        except BaseException:
            for size in sizes:
                self._admission.release(size)
            raise

    # -- notifications --------------------------------------------------------------------
    async def notify(self, peer: Peer, message: bytes) -> None:
        """Send a notification to a peer (not tied to any transfer, nor to any layout)."""
        self._require_peer(peer)
        self._notify.check(message, "NOTIFY", peer)
        self._driver.notify_only("WRITE", peer, message).result()

    async def wait_notifications(self, message: bytes, count: int = 1, *, timeout: float | None = None) -> list[str]:
        """Wait until `count` notifications carrying `message` have arrived; return the senders.

        Notifications that arrived before the call count. Raises `NotificationTimeout`.
        """
        self._require_agent()
        self._wakeup()
        return await self._notifications.wait(message, count, timeout)

    def lend(self, message: bytes, *, readers: int = 1, ttl_s: float) -> Lease:
        """Hold blocks for `readers` remote readers, who notify `message` when done.

        Give readers `lease.expires_at` (our wall clock); they refuse to read past it. Await
        the lease: True once every reader notified, False when it expired first (the readers
        vanished). Either way the caller may then reuse the blocks.
        """
        self._require_agent()
        self._wakeup()
        return Lease(self._notifications, message, readers, ttl_s)

    def notifications(self, *, claim: bool = False) -> AsyncIterator[Notification]:
        """An async iterator over every notification arriving from now on.

        `claim=True`: notifications no waiter wants go only to this iterator instead of also
        being kept for a later `wait_notifications`.
        """
        self._require_agent()
        return self._notifications.subscribe(claim=claim)

    # -- the poller -----------------------------------------------------------------------
    def poll_soon(self) -> None:
        """Ask the poller for a sweep now (progress NIXL, drain notifications), even if idle.

        For a producer whose peers are reading: UCX may hold a reader's next operation until
        our worker acknowledges its last notification, and an idle poller sleeps up to
        `PollConfig.idle_interval_s`. A host that knows when activity is due (a vLLM step)
        calls this instead of making the poller spin. Pokes (this, and the engine's own periodic
        ones) leave a back-off from an error alone; new work ends it.
        """
        if not self._backing_off:
            self._wakeup()

    def _wakeup(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _check_by(self, hot_from: float) -> None:
        """Transfers were just posted and are in flight: have the poller first check them when its
        pacing says (`AdaptivePacer.after_post`), not at once. `hot_from`: as the driver's.

        Each small read a vLLM decode server loads otherwise paid a poll that found it in flight:
        a loop turn, a notification drain and a state check, on the core the model steps run on.
        """
        wake, timer, loop = self._wake, self._wake_timer, self._loop
        if wake is None or wake.done() or timer is None or loop is None:
            return  # the poller is running (its next sweep sees them), or already woken
        delay = self._pacer.after_post(hot_from - time.perf_counter())
        if delay == 0.0:
            self._wakeup()
        elif (due := loop.time() + delay) < self._wake_due:  # an idle sleep: cut it short
            timer.cancel()
            self._wake_timer, self._wake_due = loop.call_later(delay, self._wakeup), due

    async def _sleep(self, delay: float) -> None:
        loop = self._loop
        assert loop is not None
        self._wake = loop.create_future()
        self._wake_timer, self._wake_due = loop.call_later(delay, self._wakeup), loop.time() + delay
        try:
            await self._wake
        finally:
            self._wake_timer.cancel()
            self._wake = self._wake_timer = None

    async def _poll_forever(self) -> None:
        try:
            await self._poll_until_cancelled()
        except asyncio.CancelledError:
            if not self._closing and self._agent is not None:
                await self._close_as_poller()
            raise

    async def _close_as_poller(self) -> None:
        """The poller was cancelled, not by `close()`: `asyncio.run`'s shutdown cancels every task left,
        this one with the tasks awaiting transfers. Nothing else progresses NIXL, so their transfers
        (cancelled meanwhile, waiting for NIXL to let go) would never end: the process hung at exit.
        Close the engine here, polling on until that is done (bounded by the release grace)."""
        log.warning("the engine's poller was cancelled before close(): closing the engine now")
        self._poller = None  # (close() must neither wait for nor cancel this task)
        closing = asyncio.ensure_future(self.close())
        loop = self._loop
        assert loop is not None
        while not closing.done():
            try:
                await self._poll_once(loop) if self._agent is not None else await asyncio.sleep(0.001)
            except asyncio.CancelledError:  # (cancelled again: the close still needs us)
                continue
            except Exception as exc:  # (the close fails what is left after its grace)
                log.debug("poller error while closing: %r", exc)
                await asyncio.sleep(0.001)
        if not closing.cancelled() and closing.exception() is not None:
            log.error("closing the engine after its poller was cancelled failed", exc_info=closing.exception())

    async def _poll_until_cancelled(self) -> None:
        loop = self._loop
        assert loop is not None
        errors = ErrorThrottle(log, "engine poller error; failing the transfers in flight")
        while True:
            try:
                await self._poll_once(loop)
                errors.ok()
            except Exception as exc:  # a bug must not silently stop every deadline and completion
                errors.record(exc)
                try:
                    self._fail_in_flight(f"engine poller error: {type(exc).__name__}")
                    self._driver.fence_releasing(loop.time())  # sweeps that keep breaking watch nothing
                except Exception as again:  # nor one that breaks failing them: the next sweep tries again
                    errors.record(again)
                # Work submitted meanwhile is looked at when due, not after the back-off; pokes
                # (`poll_soon`, each idle vLLM step) do not wake it, or errors would repeat at their pace.
                self._backing_off = True
                try:
                    await self._sleep(errors.backoff_s)
                finally:
                    self._backing_off = False

    def _fail_in_flight(self, reason: str) -> None:
        self._driver.end_all(lambda t: TransferFailed(reason, transfer_id=t.id, peer=t.peer))

    async def _poll_once(self, loop: asyncio.AbstractEventLoop) -> None:
        agent = self._agent
        assert agent is not None
        counters = self.stats.counters
        counters["polls"] += 1
        # Incoming notifications are not "activity": they promise no more work for us, and
        # spinning on them would steal the core a peer's copy needs (2-core machines).
        try:
            self._notify.drain(agent, self._peers.table)
        except NIXL_ERRORS as exc:  # NIXL's trouble draining is no reason to fail every transfer
            self._housekeeping_errors.record(exc)
        driver = self._driver
        activity = await driver.sweep(agent, loop) if driver.active or driver.fenced else False
        self._peers.drop_quiet()  # (logs what NIXL refuses to let go of)
        now = loop.time()
        self._peers.evict_idle(now)
        if activity:
            self._pacer.activity(now)
        # Fenced transfers do not keep the poller hot: NIXL may hold them for a long time.
        delay = self._pacer.delay(now, busy=bool(driver.active), waiting=self._notifications.has_waiters,
                                  hot_in=driver.hot_from - time.perf_counter())  # fmt: skip
        if delay == 0.0:
            await asyncio.sleep(0)
        else:
            counters["poller_sleeps"] += 1
            await self._sleep(delay)


def _still_registered(view: BlockView, layouts: dict[str, BlockLayout], how: str) -> None:
    """`LayoutError` unless `view`'s layout is still the one registered under its name."""
    current = layouts.get(view.layout.name)
    if current is not view.layout and current != view.layout:
        raise LayoutError(f"layout {view.layout.name!r} was {how} while the transfer waited for room: nothing posted")


def _route(local: BlockView, remote: BlockView) -> tuple[str, str]:
    """The memory kinds a transfer copies between: inline copies are timed per route (`CopyRates`)."""
    return local.layout.mem_type, remote.layout.mem_type  # (MemType is a str enum)
