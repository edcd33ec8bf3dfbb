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

One poller coroutine drives all in-flight transfers (see `_poller.py` for its pacing) and posts
large transfers slice by slice (see `transfer.py`), so no coroutine on the loop stalls for more
than one slice's copy. Backpressure: a submit beyond `max_inflight_transfers` or
`max_inflight_bytes` waits for room, in arrival order (see `_admission.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, Self

import msgspec
import numpy.typing as npt
import zmq
import zmq.asyncio

from . import messages
from ._admission import Admission
from ._agent import NIXL_ERRORS, OwnedAgent
from ._memory import MemoryRegistry, ViewLike, layout_of_memory
from ._notify_guard import REFUSAL_REASONS
from ._peers import Peer, PeerTable, Reconcile, pick_layout, reconcile
from ._poller import AdaptivePacer
from ._side_notify import SideChannelNotifier
from ._slicing import CopyRate
from ._state import Action, Complete, Fenced, Finish, Quiet, Release, TransferState
from .config import EngineConfig
from .exceptions import (
    EngineClosedError,
    EngineIdMismatch,
    HandshakeRejected,
    IncompatiblePeerError,
    LayoutError,
    LeaseExpired,
    PeerUnknownError,
    TransferCancelled,
    TransferError,
    TransferFailed,
    TransferTimeout,
)
from .handshake import HandshakeServer, Refusal, fetch_metadata
from .layout import (
    BlockLayout,
    LayoutKind,
    as_block_ids,
    pair_descriptor_ids,
)
from .notifications import Lease, Notification, NotificationBox
from .stats import EngineStats, StatsSnapshot
from .transfer import Transfer, TransferFuture, TransferResult, plan_slices

__all__ = ["Peer", "TransferEngine"]

log = logging.getLogger(__name__)

BlockIds = Sequence[int] | npt.ArrayLike
# After serving a handshake, poll briskly this long: the asker's first transfer needs our UCX
# worker progressed to finish connection wire-up.
_WIREUP_BRISK_S = 2.0
# A post slower than this ends the poller's sweep early so other coroutines get the loop.
_SWEEP_BUDGET_S = 0.001
_NEVER = float("inf")
_CLOSE_GRACE_S = 0.2  # progress this long at close when a notification went out recently


_NOTIFY_ERRORS: tuple[type[BaseException], ...] = (*NIXL_ERRORS, KeyError, zmq.ZMQError)
# Agents (and the memory their handles use) that closed with handles NIXL never let go of: never
# destroyed, so no byte can land in freed memory. Empty unless a close ran into a fenced transfer.
_KEPT_ALIVE: list[tuple[Any, list[Any], list[Transfer]]] = []
# Where `collect_transfers()` gathers the transfers submitted in its context (child tasks included).
_COLLECTOR: contextvars.ContextVar[list[Transfer] | None] = contextvars.ContextVar("nixl_async_collector", default=None)


def _engine_id_of(agent_name: str) -> str:
    """Our agents are named "<engine id>/<start time>"; other agents keep their own name."""
    engine_id, sep, stamp = agent_name.rpartition("/")
    return engine_id if sep and stamp.isalnum() else agent_name


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
        self._compat_hash = messages.compat_hash(self.config.compat)
        self._reply_cache: messages.MetadataReply | None = None
        self.extra: dict[str, str] = {}
        self._memory = MemoryRegistry()
        self._table = PeerTable()
        self._orphan_dlists: list[Any] = []  # remote lists a peer's new layouts replaced, still in use
        self._next_eviction = -_NEVER
        self._notifier: SideChannelNotifier | None = None  # notify_via="side_channel"
        self._connecting: dict[tuple[str, int], asyncio.Task[Peer]] = {}
        self._active: dict[int, Transfer] = {}
        self._next_deadline = _NEVER  # no transfer's deadline comes before this
        self._last_notification_at = -_NEVER
        self._fenced: dict[int, Transfer] = {}  # told the caller, NIXL still holds handles
        self._retiring_peers: dict[str, Peer] = {}  # forgotten; their remote agent goes once quiet
        self._closed = False
        self._final_live: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._copy_rate = CopyRate(self.config)  # sizes the next slices
        self._cancel_by_awaiter_cb = self._on_awaiter_cancelled  # one bound method for every future
        self._admission = Admission(self.config.max_inflight_transfers, self.config.max_inflight_bytes)
        self._notifications = NotificationBox(self.config.max_unclaimed_notifications)
        self._pacer = AdaptivePacer(self.config.poll)
        self._wake: asyncio.Future[None] | None = None

    # -- life cycle -----------------------------------------------------------------------
    @property
    def engine_id(self) -> str:
        return self.config.engine_id

    @property
    def agent_name(self) -> str:
        return self._require_agent().name

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
        if self._agent is not None or self._closed:
            raise RuntimeError("engine already started" if self._agent is not None else "engine was closed")
        self._loop = asyncio.get_running_loop()
        agent_name = f"{self.engine_id}/{time.time_ns():x}"
        self._agent = OwnedAgent(agent_name, self.config.backends, self.config.backend_params)
        self._zmq = zmq.asyncio.Context()
        self._notifier = SideChannelNotifier(self._zmq, self.engine_id, self.config.auth_secret)
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
        if self._agent is None or self._closing:
            return
        self._closing = True
        self._admission.close()  # waiters wake and fail with EngineClosedError
        agent = self._agent
        assert self._loop is not None
        if self._server is not None:
            await self._server.close()
        connecting = list(self._connecting.values())
        for task in connecting:
            task.cancel()
        await asyncio.gather(*connecting, return_exceptions=True)
        for transfer in list(self._active.values()):
            self._end(transfer, TransferCancelled("the engine was closed", transfer_id=transfer.id, peer=transfer.peer))
        self._notifications.close(EngineClosedError("the engine was closed"))
        # The poller carries ended transfers to quiet (or fenced, after the grace). Notifications
        # sent moments ago leave only as the worker is progressed: give them a moment too.
        recent = self._loop.time() - self._last_notification_at < _WIREUP_BRISK_S
        deadline = time.monotonic() + self.config.release_grace_s + 0.5
        brisk_until = time.monotonic() + (_CLOSE_GRACE_S if recent else 0.0)
        while (self._active or self._fenced or time.monotonic() < brisk_until) and time.monotonic() < deadline:
            self._wakeup()
            await asyncio.sleep(0.001)
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        fenced = [t for t in (*self._active.values(), *self._fenced.values()) if not t.quiet]
        if fenced:
            # NIXL may still write into (or read from) that memory: never deregister or free it.
            log.error("closing with %d transfers NIXL still holds (%s): keeping the agent and its memory alive",
                      len(fenced), ", ".join(f"#{t.id}" for t in fenced))  # fmt: skip
            _KEPT_ALIVE.append((agent, self._memory.keepalives(), fenced))
            self._memory.forget()
        else:
            for peer in [*self._table, *self._retiring_peers.values()]:
                self._forget_peer(peer)
                self._drop_remote(peer)
            self._memory.release_all(agent)
        self._notifier_close()
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
        self._final_live = agent.live_handles()
        # Drop the agent here, on the loop thread: its destructor tears down the UCX worker.
        self._agent = None
        self._closed = True
        del agent

    def _require_agent(self) -> OwnedAgent:
        if self._agent is None or self._closing:
            raise EngineClosedError("the engine is not running: start() it first (and do not use it after close())")
        return self._agent

    def live_handles(self) -> dict[str, int]:
        """Live NIXL handles by kind; all zero (empty) after `close()` unless memory stayed fenced."""
        return self._agent.live_handles() if self._agent is not None else dict(self._final_live)

    def snapshot(self) -> StatsSnapshot:
        """Counters, latency histograms and live handles, as a plain value."""
        admission = self._admission
        extra = {
            "notifications_dropped": self._notifications.dropped,
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
        self._reply_cache = None
        self.stats.counters["registered_bytes"] += layout.total_bytes
        return layout

    def deregister(self, name: str) -> None:
        """Deregister a layout. Transfers using it must have finished."""
        agent = self._require_agent()
        handles = self._memory.local_dlists_of(name)
        busy = [t for t in (*self._active.values(), *self._fenced.values()) if any(t.local_dlist is h for h in handles)]
        if busy:
            fenced = sum(t.state is TransferState.FENCED for t in busy)
            raise LayoutError(f"layout {name!r} has {len(busy)} transfers in flight ({fenced} fenced): kept registered")
        self._memory.deregister(agent, name)
        self._reply_cache = None

    def layout(self, name: str | None = None) -> BlockLayout:
        """Our registered layout called `name` (or our only one)."""
        return pick_layout(self._memory.layouts, name, "this engine")

    # -- handshake ------------------------------------------------------------------------
    async def serve(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Answer handshakes on host:port (port 0 picks a free one); returns the address."""
        self._require_agent()
        if self._server is not None:
            raise RuntimeError(f"already serving on {self._server.host}:{self._server.port}")
        assert self._zmq is not None
        server = HandshakeServer(
            self._zmq,
            self._reply_for,
            max_request_bytes=self.config.max_request_bytes,
            max_frame_bytes=self.config.max_frame_bytes,
            on_request=self._on_handshake_request,
            on_notify=self._on_side_channel_notification,
            secret=self.config.auth_secret,
        )
        address = await server.start(host, port)
        self._server = server
        return address

    def _on_handshake_request(self) -> None:
        self.stats.counters["handshakes_served"] += 1
        assert self._loop is not None
        self._pacer.stay_brisk(self._loop.time() + _WIREUP_BRISK_S)
        self._wakeup()

    def _reply_for(self, request: messages.MetadataRequest) -> messages.MetadataReply:
        if request.expected_engine_id not in (None, self.engine_id):
            raise Refusal(
                "engine_id_mismatch", f"this is engine {self.engine_id!r}, not {request.expected_engine_id!r}"
            )
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
            )
        return msgspec.structs.replace(self._reply_cache, wall_clock=time.time())

    def set_extra(self, **extra: str) -> None:
        """Free-form strings sent to peers in the handshake (adapters put TP rank etc. here)."""
        self.extra.update({k: str(v) for k, v in extra.items()})
        self._reply_cache = None

    async def connect(
        self,
        host: str,
        port: int,
        *,
        expected_engine_id: str | None = None,
        timeout: float | None = None,
        refresh: bool = False,
    ) -> Peer:
        """Handshake with the engine at host:port and return it as a `Peer`.

        A peer already connected at that address is returned without a new handshake unless
        `refresh` is set, a transfer with it failed since, or it is not the `expected_engine_id`
        (another engine may have taken the address); if the handshake then finds a new agent or
        engine there, the old one's descriptor lists and remote agent are dropped.
        Concurrent connects to one address share one handshake; connects to different addresses
        run concurrently.

        Raises `HandshakeTimeout`, `HandshakeRejected`, `ProtocolError`, `IncompatiblePeerError`
        or `EngineIdMismatch`.
        """
        self._require_agent()
        key = (host, port)
        peer = self._table.at(key)
        moved = peer is not None and expected_engine_id is not None and peer.engine_id != expected_engine_id
        if peer is None or refresh or moved or not peer.connected or peer.stale:
            task = self._connecting.get(key)
            if task is None:
                assert self._loop is not None
                task = self._loop.create_task(
                    self._handshake(host, port, timeout or self.config.handshake_timeout_s),
                    name=f"handshake:{host}:{port}",
                )
                self._connecting[key] = task
                task.add_done_callback(functools.partial(self._connect_done, key))
            peer = await asyncio.shield(task)
        assert self._loop is not None
        self._table.touch(peer, self._loop.time())
        if expected_engine_id is not None and peer.engine_id != expected_engine_id:
            raise EngineIdMismatch(
                f"{host}:{port} is engine {peer.engine_id!r}, expected {expected_engine_id!r}",
                address=f"{host}:{port}",
            )
        return peer

    def _connect_done(self, key: tuple[str, int], _task: asyncio.Task[Peer]) -> None:
        self._connecting.pop(key, None)

    async def _handshake(self, host: str, port: int, timeout: float) -> Peer:
        assert self._zmq is not None and self._loop is not None
        started = self._loop.time()
        asked_at = time.time()
        try:
            reply = await fetch_metadata(
                self._zmq,
                host,
                port,
                messages.MetadataRequest(engine_id=self.engine_id),
                timeout=timeout,
                max_frame_bytes=self.config.max_frame_bytes,
                secret=self.config.auth_secret,
            )
            answered_at = time.time()
            offset = reply.wall_clock - (asked_at + answered_at) / 2 if reply.wall_clock else 0.0
            if reply.compat_hash != self._compat_hash:
                raise IncompatiblePeerError(
                    f"{host}:{port} (engine {reply.engine_id!r}) has compatibility hash {reply.compat_hash}, "
                    f"ours is {self._compat_hash}: its memory cannot be used with ours",
                    address=f"{host}:{port}",
                )
            peer = await self._reconcile(reply, (host, port), offset)
        except BaseException:
            self.stats.counters["handshake_failures"] += 1
            raise
        self.stats.counters["handshakes"] += 1
        self.stats.histograms["handshake_us"].record(self._loop.time() - started)
        return peer

    async def _reconcile(self, reply: messages.MetadataReply, address: tuple[str, int], offset: float) -> Peer:
        """Carry out what `reconcile` decides for a handshake reply (see `_peers.py`)."""
        agent = self._require_agent()
        assert self._loop is not None
        now = self._loop.time()
        old = self._table.get(reply.engine_id)
        busy = old is not None and old.agent_name in self._busy_agents()
        decision = reconcile(old, reply, busy=busy)
        previous = self._table.at(address)
        if previous is not None and previous.engine_id != reply.engine_id:
            self._forget_peer(previous)  # another engine now answers at this address: that one is gone
        if old is not None and decision in (Reconcile.KEEP, Reconcile.REFRESH_LAYOUTS):
            if decision is Reconcile.REFRESH_LAYOUTS:
                in_use = {id(t.remote_dlist) for t in self._live_transfers()}
                self._orphan_dlists += self._memory.drop_remote(agent, old.agent_name, keep=in_use)
            old.refresh(reply, clock_offset_s=offset, now=now)
            self._table.add(old, address)
            return old
        if old is not None:  # RELOAD or REPLACE: its transfers end; its remote agent goes once quiet
            self._forget_peer(old)
        retiring = self._retiring_peers.get(reply.agent_name)
        if retiring is not None:
            # NIXL still has that agent loaded for transfers that are releasing: wait for them
            # (bounded by the grace) before loading it anew.
            await self._retired(retiring, self.config.release_grace_s + 0.5)
        peer = Peer(reply, address, now=self._loop.time())
        peer.agent_name = agent.add_remote(reply.agent_metadata)
        peer.clock_offset_s = offset
        self._table.add(peer)
        return peer

    def _live_transfers(self) -> list[Transfer]:
        return [*self._active.values(), *self._fenced.values()]

    def _busy_agents(self) -> set[str]:
        return {t.remote_agent for t in self._live_transfers()}

    async def _retired(self, peer: Peer, timeout: float) -> None:
        assert self._loop is not None
        deadline = self._loop.time() + timeout
        while peer.agent_name in self._retiring_peers:
            if self._loop.time() >= deadline:
                raise HandshakeRejected(
                    f"transfers with the previous connection to {peer.engine_id} are still fenced in NIXL",
                    address=f"{peer.address[0]}:{peer.address[1]}",
                )
            self._wakeup()
            await asyncio.sleep(0.005)

    def peer(self, engine_id: str) -> Peer:
        """The connected peer with that engine id (raises `PeerUnknownError`)."""
        peer = self._table.get(engine_id)
        if peer is None:
            raise PeerUnknownError(engine_id)
        return peer

    @property
    def peers(self) -> list[Peer]:
        return list(self._table)

    def disconnect(self, peer: Peer) -> None:
        """Forget a peer: fail its transfers, release its descriptor lists and remote agent."""
        self._require_agent()
        self._forget_peer(peer)

    def _forget_peer(self, peer: Peer) -> None:
        """Stop using a peer now; its remote agent and descriptor lists go once its transfers are quiet."""
        if not peer.connected:
            return
        for transfer in list(self._active.values()):
            if transfer.remote_agent == peer.agent_name:
                error = TransferCancelled("peer disconnected", transfer_id=transfer.id, peer=peer.engine_id)
                self._end(transfer, error)
        self._notifier_forget(peer)
        peer.connected = False
        self._table.remove(peer)
        self._retiring_peers[peer.agent_name] = peer
        self._drop_quiet_peers()

    def _drop_quiet_peers(self) -> None:
        """Remove what forgotten peers left once no live transfer uses it."""
        if self._orphan_dlists:
            in_use = {id(t.remote_dlist) for t in self._live_transfers()}
            agent = self._require_agent_any()
            for handle in [h for h in self._orphan_dlists if id(h) not in in_use]:
                self._orphan_dlists.remove(handle)
                agent.release_dlist(handle)
        if self._retiring_peers:
            busy = self._busy_agents()
            for name, peer in list(self._retiring_peers.items()):
                if name not in busy:
                    self._drop_remote(peer)

    def _evict_idle_peers(self) -> None:
        """Forget peers unused for `peer_ttl_s` (a fleet whose instances come and go must not leak)."""
        ttl = self.config.peer_ttl_s
        assert self._loop is not None
        now = self._loop.time()
        if ttl is None or now < self._next_eviction or not len(self._table):
            return
        self._next_eviction = now + min(ttl / 2, 1.0)
        for peer in self._table.idle(now, ttl, self._busy_agents()):
            self.stats.counters["peers_evicted"] += 1
            self._forget_peer(peer)

    def _drop_remote(self, peer: Peer) -> None:
        if self._retiring_peers.pop(peer.agent_name, None) is None:
            return
        agent = self._require_agent_any()
        self._memory.drop_remote(agent, peer.agent_name)
        agent.remove_remote(peer.agent_name)

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
        quiet; False if some handle is still alive after `timeout` (that memory stays fenced).
        """
        for transfer in transfers:
            transfer.cancel("settling a failed request")
        self._wakeup()
        try:
            async with asyncio.timeout(timeout):
                for transfer in transfers:
                    await transfer.wait_quiet()
        except TimeoutError:
            return False
        return True

    @contextlib.contextmanager
    def collect_transfers(self) -> Iterator[list[Transfer]]:
        """Collect every transfer submitted inside this block, by this task or tasks it starts.

        For a request made of several transfers: whatever way it ends, `settle()` the list
        before handing the request's memory to anyone (a sibling may still be in flight).
        """
        collected: list[Transfer] = []
        token = _COLLECTOR.set(collected)
        try:
            yield collected
        finally:
            _COLLECTOR.reset(token)

    async def read(self, peer: Peer, local_blocks: BlockIds, remote_blocks: BlockIds, **kwargs: Any) -> TransferResult:
        """`start_read` and wait for it."""
        return await (await self.start_read(peer, local_blocks, remote_blocks, **kwargs))

    async def write(self, peer: Peer, local_blocks: BlockIds, remote_blocks: BlockIds, **kwargs: Any) -> TransferResult:
        """`start_write` and wait for it."""
        return await (await self.start_write(peer, local_blocks, remote_blocks, **kwargs))

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
        agent = self._require_agent()
        assert self._loop is not None
        if not peer.connected or peer not in self._table:
            raise PeerUnknownError(f"peer {peer.engine_id!r} is not connected (connect again)")
        if notify is not None and not isinstance(notify, bytes):
            raise TypeError("notify must be bytes")
        local_view = self._memory.view(local, self._memory.layouts, "this engine")
        remote_view = self._memory.view(remote, peer.layouts, f"peer {peer.engine_id}")
        lids = as_block_ids(local_blocks, local_view.layout.num_blocks, what="local", unique=op == "READ")
        rids = as_block_ids(remote_blocks, remote_view.layout.num_blocks, what="remote", unique=op == "WRITE")
        now = self._loop.time()
        if len(lids) == 0 and len(rids) == 0:
            return self._notify_only(op, peer, notify, now)
        lidx, ridx = pair_descriptor_ids(local_view, lids, remote_view, rids)
        nbytes = len(lidx) * local_view.piece_len
        if timeout is None:
            timeout = self.config.transfer_timeout_s
        if lease_expires_at is not None:
            remaining = lease_expires_at - (time.time() + peer.clock_offset_s)
            if remaining <= 0:
                self.stats.counters["lease_refusals"] += 1
                raise LeaseExpired(
                    f"the lease from {peer.engine_id} expired {-remaining:.3f}s ago: its blocks may hold other data",
                    peer=peer.engine_id,
                )
            timeout = remaining if timeout is None else min(timeout, remaining)
        deadline = None if timeout is None else now + timeout
        lease_deadline = None if lease_expires_at is None else now + remaining

        try:
            await self._admission.acquire(nbytes, deadline)
        except TimeoutError:
            raise TransferTimeout("deadline passed while waiting for room to submit") from None
        try:
            agent = self._require_agent()  # the engine may have closed while we waited
            if not peer.connected or peer not in self._table:
                raise PeerUnknownError(f"peer {peer.engine_id!r} was disconnected while waiting for room")
            self._table.touch(peer, self._loop.time())
            future = TransferFuture(loop=self._loop)
            future.transfer_id, future.on_cancel = next(self._ids), self._cancel_by_awaiter_cb
            transfer = Transfer(
                transfer_id=future.transfer_id,
                op=op,
                peer=peer.engine_id,
                remote_agent=peer.agent_name,
                local_dlist=self._memory.local_dlist(agent, local_view),
                remote_dlist=self._memory.remote_dlist(agent, peer.agent_name, remote_view),
                slices=plan_slices(
                    lidx, ridx, local_view.piece_len, self._copy_rate.slice_bytes(), self.config.max_post_descriptors
                ),
                notify=notify,
                nbytes=nbytes,
                deadline=deadline,
                submitted_at=now,
                future=future,
                cancel_cb=self._end,
                slices_in_flight=self.config.slices_in_flight,
                release_grace_s=self.config.release_grace_s,
            )
        except BaseException:
            self._admission.release(nbytes)
            raise
        transfer.lease_deadline = lease_deadline
        if (collected := _COLLECTOR.get()) is not None:
            collected.append(transfer)
        self._active[transfer.id] = transfer  # from here on `_retire` gives the room back
        if deadline is not None and deadline < self._next_deadline:
            self._next_deadline = deadline
        self.stats.counters["transfers_submitted"] += 1
        if len(transfer.slices[0][0]) * transfer.piece_len <= self.config.min_post_bytes:
            self._pump(agent, transfer, max_posts=1)  # the fast path: small transfers finish here
        # (a bigger first slice is posted by the poller, after other coroutines had a turn)
        if transfer.state is TransferState.POSTING:
            self._pacer.activity(self._loop.time())
            self._wakeup()
        return transfer

    def _send_notification(self, peer: Peer, message: bytes) -> None:
        """Send `message` to `peer` the configured way (see `EngineConfig.notify_via`)."""
        if self.config.notify_via == "nixl":
            self._require_agent().send_notification(peer.agent_name, message)
            return
        assert self._notifier is not None
        self._notifier.send(peer.address, peer.notify_session, message)  # raises zmq.Again when the queue is full

    def _notifier_forget(self, peer: Peer) -> None:
        if self._notifier is not None:
            self._notifier.forget(peer.address)

    def _notifier_close(self) -> None:
        if self._notifier is not None:
            self._notifier.close()

    def _on_side_channel_notification(self, sender: str, message: bytes) -> None:
        self._notifications.deliver(sender, message)
        self.stats.counters["notifications_received"] += 1

    def _sent_notification(self, now: float) -> None:
        # NIXL gives no handle for a notification: it leaves when our UCX worker is progressed
        # (after wire-up, for a new peer). Keep polling briskly a while, and let close() wait.
        self._last_notification_at = now
        self._pacer.stay_brisk(now + _WIREUP_BRISK_S)
        self._wakeup()

    def _notify_only(self, op: str, peer: Peer, notify: bytes | None, now: float) -> Transfer:
        assert self._loop is not None
        transfer = Transfer(
            transfer_id=next(self._ids),
            op=op,
            peer=peer.engine_id,
            remote_agent=peer.agent_name,
            local_dlist=None,
            remote_dlist=None,
            slices=[],
            notify=notify,
            nbytes=0,
            deadline=None,
            submitted_at=now,
            future=TransferFuture(loop=self._loop),
            cancel_cb=self._end,
        )
        try:
            if notify is not None:
                self._send_notification(peer, notify)
                self.stats.counters["notifications_sent"] += 1
                self._sent_notification(now)
        except _NOTIFY_ERRORS as exc:
            error = TransferFailed(f"notification to {peer.engine_id} failed: {exc}",
                                   transfer_id=transfer.id, peer=peer.engine_id)  # fmt: skip
            transfer.core.end(error, now)
            transfer.mark_quiet()
            transfer.finish(error)
            return transfer
        transfer.core.succeed()
        transfer.mark_quiet()
        transfer.finish(TransferResult(transfer.id, op, peer.engine_id, 0, 0, 0, 0.0, notify is not None))
        return transfer

    # -- the pump: posting slices and checking them ----------------------------------------
    def _pump(self, agent: OwnedAgent, transfer: Transfer, max_posts: int, swept: float = 0.0) -> bool:
        """Advance one transfer: check its running slices, post new ones (at most `max_posts`).

        What NIXL says goes into the transfer's state machine; its actions are carried out by
        `_apply`. `swept` is when the poller's sweep began, recorded while slices are in flight.
        Returns whether anything moved (a slice ended or was posted, or the transfer ended).
        """
        core = transfer.core
        moved = False
        for index in core.running_list():
            try:
                state = agent.state(transfer.handles[index])
            except NIXL_ERRORS as exc:
                state = f"ERR ({exc})"
            if state != "PROC":
                moved = True
                self._apply(transfer, core.checked(index, state))
        if core.has_running:
            transfer.last_pending_at = swept
        for index in core.to_release():  # releases NIXL refused earlier
            self._apply(transfer, [Release(index)])
        chained = transfer.op == "WRITE" and transfer.notify is not None
        for index in core.to_post(max_posts):
            if core.state is not TransferState.POSTING:
                break
            # A WRITE's notification rides on its last slice (NIXL orders it after the data at
            # the target). A READ's is sent once the data has landed here: chained to the READ it
            # keeps the READ "PROC" until the *producer's* worker is progressed.
            notif = transfer.notify if chained and index == len(transfer.slices) - 1 else None
            lidx, ridx = transfer.slices[index]
            started = time.perf_counter()
            try:
                handle = agent.make_xfer(transfer.op, transfer.local_dlist, lidx, transfer.remote_dlist, ridx,
                                         notif or b"")  # fmt: skip
            except NIXL_ERRORS as exc:
                self._apply(transfer, core.post_failed(index, str(exc)))
                return True
            transfer.handles[index] = handle
            try:
                state = agent.post(handle)
            except NIXL_ERRORS as exc:
                state = f"ERR ({exc})"
            took = time.perf_counter() - started
            transfer.post_seconds += took
            self.stats.histograms["post_us"].record(took)
            moved = True
            if state == "DONE":  # copied inside the call: tells us the copy rate
                self._copy_rate.observe(len(lidx) * transfer.piece_len, took)
            self._apply(transfer, core.posted(index, state))
        return moved

    def _apply(self, transfer: Transfer, actions: list[Action]) -> None:
        """Carry out what a transfer's state machine asked for."""
        for action in actions:
            match action:
                case Release(index=index):
                    handle = transfer.handles.get(index)
                    ok = handle is None or self._require_agent_any().release_xfer(handle)
                    if ok:
                        transfer.handles.pop(index, None)
                    self._apply(transfer, transfer.core.released(index, ok))
                case Complete():
                    self._apply(transfer, self._check_complete(transfer))
                case Finish(error=None):
                    self._complete(transfer)
                case Finish(error=TransferError() as error):
                    self._failed(transfer, error)
                case Fenced(error=error):
                    error.quiet = transfer.wait_quiet
                    self._retire(transfer)
                    self._fenced[transfer.id] = transfer
                    self.stats.counters["transfers_fenced"] += 1
                    log.warning("transfer #%d with %s: %s", transfer.id, transfer.peer, error)
                    transfer.finish(error)
                case Quiet():
                    self._fenced.pop(transfer.id, None)
                    self.stats.counters["transfers_unfenced"] += 1
                    transfer.mark_quiet()

    def _check_complete(self, transfer: Transfer) -> list[Action]:
        """Every byte arrived: refuse data that came past the lease, send a READ's notification."""
        assert self._loop is not None
        core = transfer.core
        if transfer.lease_deadline is not None and self._loop.time() >= transfer.lease_deadline:
            # The data arrived, but maybe after the producer reused the blocks: not to be trusted.
            expired = LeaseExpired(f"the lease from {transfer.peer} ran out during the {transfer.op}",
                                   peer=transfer.peer)  # fmt: skip
            return core.end(expired, self._loop.time())
        if transfer.op == "READ" and transfer.notify is not None:
            try:
                self._send_notification(self._peer_of_agent(transfer.remote_agent), transfer.notify)
            except _NOTIFY_ERRORS as exc:
                error = TransferFailed(f"the data was read but notifying {transfer.peer} failed: {exc}",
                                       transfer_id=transfer.id, peer=transfer.peer)  # fmt: skip
                return core.end(error, self._loop.time())
        return core.succeed()

    def _peer_of_agent(self, agent_name: str) -> Peer:
        peer = self._table.of_agent(agent_name)
        if peer is None:
            raise KeyError(f"no connected peer has agent {agent_name}")
        return peer

    def _require_agent_any(self) -> OwnedAgent:
        """The agent, also while closing (releases still have to happen)."""
        assert self._agent is not None
        return self._agent

    def _complete(self, transfer: Transfer) -> None:
        assert self._loop is not None
        transfer.done_seen_at = time.perf_counter()
        elapsed = self._loop.time() - transfer.submitted_at
        self._retire(transfer)
        if (peer := self._table.of_agent(transfer.remote_agent)) is not None:
            self._table.touch(peer, self._loop.time())  # a transfer longer than the TTL is still use
        counters = self.stats.counters
        counters["transfers_done"] += 1
        counters["bytes_" + transfer.op.lower()] += transfer.nbytes
        if transfer.notify is not None:
            counters["notifications_sent"] += 1
            self._sent_notification(self._loop.time())
        self.stats.histograms["transfer_us"].record(elapsed)
        transfer.mark_quiet()
        transfer.finish(
            TransferResult(
                transfer.id,
                transfer.op,
                transfer.peer,
                transfer.nbytes,
                transfer.descriptors,
                len(transfer.slices),
                elapsed,
                transfer.notify is not None,
                transfer.post_seconds,
            )
        )

    def _failed(self, transfer: Transfer, error: TransferError) -> None:
        """A transfer ended with `error` and its memory is quiet: tell the caller."""
        self._retire(transfer)
        if isinstance(error, TransferFailed):
            peer = self._table.of_agent(transfer.remote_agent)
            if peer is not None:
                peer.stale = True  # the next connect() handshakes again
        kind = {TransferState.CANCELLED: "cancelled", TransferState.TIMED_OUT: "timeouts"}.get(
            transfer.state, "failures"
        )
        self.stats.counters["transfers_" + kind] += 1
        transfer.mark_quiet()
        transfer.finish(error)

    def _on_awaiter_cancelled(self, transfer_id: int) -> None:
        """A task awaiting the transfer was cancelled (see `TransferFuture`): end the transfer."""
        transfer = self._active.get(transfer_id)
        if transfer is not None:
            transfer.cancel("the awaiting task was cancelled")

    def _end(self, transfer: Transfer, error: TransferError) -> None:
        """End a transfer with an error: post nothing more; the caller hears once it is quiet."""
        assert self._loop is not None
        self._apply(transfer, transfer.core.end(error, self._loop.time()))
        if transfer.core.state is TransferState.RELEASING:
            self._wakeup()  # the poller watches its running slices until they end

    def _retire(self, transfer: Transfer) -> None:
        if self._active.pop(transfer.id, None) is not None:
            self._admission.release(transfer.nbytes)

    # -- notifications --------------------------------------------------------------------
    async def notify(self, peer: Peer, message: bytes) -> None:
        """Send a notification to a peer (not tied to any transfer)."""
        (await self._submit("WRITE", peer, [], [], None, None, message, None)).result()

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
        calls this instead of making the poller spin.
        """
        self._wakeup()

    def _wakeup(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    async def _sleep(self, delay: float) -> None:
        assert self._loop is not None
        self._wake = self._loop.create_future()
        timer = self._loop.call_later(delay, self._wakeup)
        try:
            await self._wake
        finally:
            timer.cancel()
            self._wake = None

    def _drain_notifications(self, agent: OwnedAgent) -> None:
        batch = agent.notifications()
        if not batch:
            return
        for agent_name, msgs in batch.items():
            peer = self._table.of_agent(agent_name)
            sender = peer.engine_id if peer is not None else _engine_id_of(agent_name)
            for msg in msgs:
                self._notifications.deliver(sender, bytes(msg))
        self.stats.counters["notifications_received"] += sum(len(m) for m in batch.values())

    def _expire(self, now: float) -> None:
        """End transfers past their deadline; remember the next deadline so sweeps skip this."""
        posting = [t for t in self._active.values() if t.state is TransferState.POSTING]
        for transfer in [t for t in posting if t.deadline is not None and now >= t.deadline]:
            self._end(
                transfer,
                TransferTimeout(
                    f"{transfer.op} with {transfer.peer} missed its deadline",
                    transfer_id=transfer.id,
                    peer=transfer.peer,
                ),
            )
        self._next_deadline = min(
            (t.deadline for t in self._active.values() if t.deadline is not None and t.state is TransferState.POSTING),
            default=_NEVER,
        )

    async def _poll_forever(self) -> None:
        loop = self._loop
        assert loop is not None
        errors = _ErrorThrottle(log, "engine poller error; failing the transfers in flight")
        while True:
            try:
                await self._poll_once(loop)
                errors.ok()
            except Exception as exc:  # a bug must not silently stop every deadline and completion
                errors.record(exc)
                for transfer in list(self._active.values()):
                    self._end(transfer, TransferFailed(f"engine poller error: {type(exc).__name__}",
                                                       transfer_id=transfer.id, peer=transfer.peer))  # fmt: skip
                await asyncio.sleep(errors.backoff_s)

    async def _poll_once(self, loop: asyncio.AbstractEventLoop) -> None:
        agent = self._agent
        assert agent is not None
        counters = self.stats.counters
        counters["polls"] += 1
        # Incoming notifications are not "activity": they promise no more work for us, and
        # spinning on them would steal the core a peer's copy needs (2-core machines).
        self._drain_notifications(agent)
        activity = False
        if self._active or self._fenced:
            swept = time.perf_counter()
            finished = False
            for n, transfer in enumerate([*self._active.values(), *self._fenced.values()], 1):
                if finished:  # let the awaiters of finished transfers run before the next post
                    await asyncio.sleep(0)
                    finished = False
                    swept = time.perf_counter()
                if transfer.quiet:
                    continue  # ended while we yielded
                if self._pump(agent, transfer, 1, swept):
                    activity = True
                    finished = transfer.done()
                if transfer.state is TransferState.RELEASING:  # past its grace it is reported fenced
                    self._apply(transfer, transfer.core.tick(loop.time()))
                # A post can be a multi-ms copy, and 10k state checks add up: bound the stall.
                if (activity or not n % 256) and time.perf_counter() - swept > _SWEEP_BUDGET_S:
                    await asyncio.sleep(0)
                    swept = time.perf_counter()
            now = loop.time()
            if now >= self._next_deadline:
                self._expire(now)
        self._drop_quiet_peers()
        self._evict_idle_peers()
        now = loop.time()
        if activity:
            self._pacer.activity(now)
        # Fenced transfers do not keep the poller hot: NIXL may hold them for a long time.
        delay = self._pacer.delay(now, busy=bool(self._active), waiting=self._notifications.has_waiters)
        if delay == 0.0:
            await asyncio.sleep(0)
        else:
            counters["poller_sleeps"] += 1
            await self._sleep(delay)


class _ErrorThrottle:
    """Log a repeating error once per interval with a count, and back off while it repeats."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 10.0) -> None:
        self._log, self._what, self._interval = logger, what, interval_s
        self._last_logged = -_NEVER
        self._suppressed = 0
        self.backoff_s = 0.01

    def record(self, exc: Exception) -> None:
        now = time.monotonic()
        if now - self._last_logged >= self._interval:
            more = f" ({self._suppressed} more since the last report)" if self._suppressed else ""
            self._log.error("%s%s", self._what, more, exc_info=exc)
            self._last_logged, self._suppressed = now, 0
        else:
            self._suppressed += 1
        self.backoff_s = min(self.backoff_s * 2, 1.0)

    def ok(self) -> None:
        self.backoff_s = 0.01
