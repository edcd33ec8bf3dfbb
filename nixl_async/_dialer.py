"""Reaching peers: handshakes by address, and discovery through etcd.

The engine owns one `Dialer`. It runs on the engine's loop like everything else: concurrent
connects to one peer share one handshake, a published record may stand in for a handshake,
and a follower task applies etcd's changes to the peers found there. What a peer holds in NIXL
once adopted is `_connections.py`'s business; the handshake server (our side of it) stays in
the engine, which answers with its own metadata.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import zmq.asyncio

from . import messages
from ._connections import Connections
from ._peers import Peer
from .config import UCX_TCP_DEFAULT_SEGMENT, EngineConfig
from .discovery import EtcdDirectory, RecordOrder
from .exceptions import (
    DiscoveryUnavailable,
    EngineClosedError,
    EngineIdMismatch,
    HandshakeRejected,
    HandshakeTimeout,
    IncompatiblePeerError,
    PeerNotPublished,
)
from .handshake import fetch_metadata
from .stats import EngineStats

log = logging.getLogger("nixl_async.engine")
_T = TypeVar("_T")


def segment_mismatch(reader_receives: int, server_sends: int) -> str:
    return (
        f"the reader receives UCX/TCP segments of at most {reader_receives} bytes and the server sends up to "
        f"{server_sends}: the reader's first READ would lose its link or crash it. Set EngineConfig.tcp_segment_bytes "
        "alike on both engines (None: UCX's default, as older engines use)"
    )


def handshake_limit(config: EngineConfig, timeout: float | None, where: str) -> float:
    """The time a handshake or call may take; `HandshakeTimeout` if none is left (a budget run out)."""
    if timeout is None:
        return config.handshake_timeout_s
    if not timeout > 0:  # (NaN too)
        raise HandshakeTimeout(f"no time left to reach {where} (timeout {timeout})", address=where)
    return timeout


async def _adopting(adopt: Coroutine[Any, Any, _T], deadline: float, timeout: float, where: str) -> _T:
    """`adopt`, given up at the connect's `deadline` (loop time) as `HandshakeTimeout`: it may wait, up to the
    release grace, for a previous connection's transfers to let go of the peer's agent, and then wait in turn
    behind another adoption of that engine; neither may stretch the caller's timeout."""
    limit = asyncio.timeout_at(deadline)
    try:
        async with limit:
            return await adopt
    except TimeoutError:
        if not limit.expired():
            raise  # (one of its own)
        raise HandshakeTimeout(f"{where} answered, but its previous connection's transfers still held its agent "
                               f"past the {timeout}s timeout", address=where) from None  # fmt: skip


class Dialer:
    """Connects the engine to peers: by address (a side-channel handshake) or by engine id (etcd)."""

    def __init__(self, config: EngineConfig, stats: EngineStats, peers: Connections, compat_hash: str) -> None:
        self.config = config
        self.stats = stats
        self._peers = peers
        self._compat_hash = compat_hash
        self.directory: EtcdDirectory | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._zmq: zmq.asyncio.Context | None = None
        self._agent_name = ""
        self._tcp_segment: int | None = None  # the largest UCX/TCP segment our agent takes (None: no UCX)
        self._closing = False
        # ("host:port", the engine id expected there) or ("etcd", engine id)
        self._connecting: dict[tuple[str, str | None], asyncio.Task[Peer]] = {}
        self._ends: dict[tuple[str, str | None], float] = {}  # loop time each connect under way is bounded by
        self._follower: asyncio.Task[None] | None = None  # applies etcd changes to peers we hold
        self._discovered: set[str] = set()  # engine ids we connected to through etcd
        # What the follower last saw of each engine it follows, numbered: (number, the record's fingerprint, or
        # None: gone). An adoption (a lookup's, a handshake's) begun before it, of other metadata, may hold
        # what that record replaced: its peer is marked stale (`_stale_if_changed`).
        self._change_seq = 0
        self._seen: dict[str, tuple[int, str | None]] = {}
        self._order = RecordOrder()  # the newest etcd record of each applied (a lookup and the watch race)

    def open_directory(self) -> None:
        """Make the etcd client, if one is configured (first in `start`: if it fails, nothing else was made)."""
        if self.config.etcd is not None:
            self.directory = EtcdDirectory(self.config.etcd, timeout=self.config.handshake_timeout_s)

    def open(self, loop: asyncio.AbstractEventLoop, context: zmq.asyncio.Context, agent_name: str,
             tcp_segment: int | None) -> None:  # fmt: skip
        self._loop, self._zmq, self._agent_name, self._tcp_segment = loop, context, agent_name, tcp_segment

    @property
    def announced_segment(self) -> int:
        """The segment our handshakes state: ours, or UCX's default without a UCX backend (never checked then)."""
        return UCX_TCP_DEFAULT_SEGMENT if self._tcp_segment is None else self._tcp_segment

    def stop(self) -> None:
        """The engine is closing: start no follower, and stop the one running (before the server closes)."""
        self._closing = True
        if self._follower is not None:
            self._follower.cancel()

    async def close(self) -> None:
        """Stop following etcd and connecting; our record leaves etcd (its lease revoked)."""
        self.stop()
        if self._follower is not None:
            await asyncio.gather(self._follower, return_exceptions=True)
        connecting = list(self._connecting.values())
        for task in connecting:
            task.cancel()
        await asyncio.gather(*connecting, return_exceptions=True)
        if self.directory is not None:
            await self.directory.close()

    # -- by address -----------------------------------------------------------------------
    async def connect(self, host: str, port: int, expected_engine_id: str | None, timeout: float | None,
                      refresh: bool) -> Peer:  # fmt: skip
        """The peer at host:port, handshaking unless one usable is held (see `TransferEngine.connect`)."""
        limit = handshake_limit(self.config, timeout, f"{host}:{port}")  # (checked even when no handshake is needed)
        peer = self._peers.table.at((host, port))
        moved = peer is not None and expected_engine_id is not None and peer.engine_id != expected_engine_id
        if peer is None or refresh or moved or not peer.connected or peer.stale or peer.unpublished:
            # The peer refuses a handshake naming another engine: nothing of a wrong engine is loaded.
            handshake = functools.partial(self._handshake, host, port, limit, expected_engine_id)
            key = (f"{host}:{port}", expected_engine_id)
            peer = await self._shared(key, f"handshake:{host}:{port}", handshake, limit, fresh=refresh)
        assert self._loop is not None
        self._peers.table.touch(peer, self._loop.time())
        if expected_engine_id is not None and peer.engine_id != expected_engine_id:
            raise EngineIdMismatch(
                f"{host}:{port} is engine {peer.engine_id!r}, expected {expected_engine_id!r}",
                address=f"{host}:{port}",
            )
        return peer

    async def _shared(self, key: tuple[str, str | None], name: str,
                      connect: Callable[[], Coroutine[Any, Any, Peer]], timeout: float, *,
                      fresh: bool = False) -> Peer:  # fmt: skip
        """Run `connect` once per key at a time: concurrent connects to one peer share it (and a
        cancelled caller does not cancel it for the others). A caller joining one under way waits at
        most its own `timeout`.

        `fresh` (a refresh) joins only a connect begun after it was asked for: one already under way
        may have been answered before the change the refresh is for. It waits for that one to end
        (within `timeout`), then connects anew or joins one begun since.

        A joiner whose own timeout ends no sooner than the connect under way awaits that connect's own
        outcome: every caller of one failed handshake then hears its one error (one failure, counted
        once), not each its own timeout a moment before it.
        """
        assert self._loop is not None
        budget = timeout
        task = self._connecting.get(key)
        older = fresh and task is not None
        if older:
            assert task is not None
            deadline = self._loop.time() + timeout
            await asyncio.wait([task], timeout=timeout)  # (its outcome is its own callers')
            if not task.done():
                raise self._late(key, name, budget)
            timeout = deadline - self._loop.time()
            task = self._connecting.get(key)  # (the older one left it when it ended)
        if task is None:
            if self._closing:  # (a refresh whose older connect the close cancelled: nothing new starts now)
                raise EngineClosedError("the engine closed while connecting")
            task = self._loop.create_task(connect(), name=name)
            self._connecting[key] = task
            self._ends[key] = self._loop.time() + budget
            task.add_done_callback(functools.partial(self._connect_done, key))
            if not older:
                return await self._joined(task)  # bounded by this caller's timeout already
        if self._ends.get(key, math.inf) <= self._loop.time() + timeout:
            return await self._joined(task)  # it ends first, bounded by its own timeout
        try:
            async with asyncio.timeout(max(timeout, 0.0)) as waited:
                return await self._joined(task)
        except TimeoutError:
            if not waited.expired():  # the handshake's own HandshakeTimeout
                raise
            raise self._late(key, name, budget) from None

    @staticmethod
    def _late(key: tuple[str, str | None], name: str, timeout: float) -> Exception:
        late = DiscoveryUnavailable if key[0] == "etcd" else HandshakeTimeout
        return late(f"{name}: no answer within {timeout}s (a lookup started earlier goes on)",
                    address=name.partition(":")[2])  # fmt: skip

    async def _joined(self, task: asyncio.Task[Peer]) -> Peer:
        """Await a shared connect; `EngineClosedError` when the engine's close cancelled it (a caller
        not cancelled itself must not hear a cancellation it never asked for)."""
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._closing and task.cancelled() and current is not None and not current.cancelling():
                raise EngineClosedError("the engine closed while connecting") from None
            raise

    def _connect_done(self, key: tuple[str, str | None], task: asyncio.Task[Peer]) -> None:
        self._connecting.pop(key, None)
        self._ends.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: callers that gave up waiting (their own timeout) never will

    async def _handshake(self, host: str, port: int, timeout: float, expected_engine_id: str | None = None) -> Peer:
        assert self._zmq is not None and self._loop is not None
        changes_seen = self._change_seq
        started = self._loop.time()
        asked_at = time.time()
        request = messages.MetadataRequest(engine_id=self.config.engine_id, tcp_segment_bytes=self.announced_segment,
                                           expected_engine_id=expected_engine_id)  # fmt: skip
        try:
            reply = await fetch_metadata(
                self._zmq,
                host,
                port,
                request,
                timeout=timeout,
                max_frame_bytes=self.config.max_frame_bytes,
                secret=self.config.auth_secret,
            )
            answered_at = time.time()
            offset = reply.wall_clock - (asked_at + answered_at) / 2 if reply.wall_clock else 0.0
            if expected_engine_id is not None and reply.engine_id != expected_engine_id:
                # (a server that ignores the request's expected id): nothing of what it says is adopted
                raise EngineIdMismatch(f"{host}:{port} is engine {reply.engine_id!r}, expected {expected_engine_id!r}",
                                       address=f"{host}:{port}")  # fmt: skip
            self.check_peer(reply, f"{host}:{port}")
            peer = await _adopting(self._peers.adopt(reply, (host, port), offset, self._loop.time()),
                                   started + timeout, timeout, f"{host}:{port}")  # fmt: skip
            self._stale_if_changed(peer, changes_seen)
        except BaseException:
            self.stats.counters["handshake_failures"] += 1
            raise
        self.stats.counters["handshakes"] += 1
        self.stats.histograms["handshake_us"].record(self._loop.time() - started)
        return peer

    def _stale_if_changed(self, peer: Peer, changes_seen: int) -> None:
        """`peer` was adopted from what it said before the follower's change `changes_seen` + 1: if the follower
        saw since a record of it with other metadata (or none: it left etcd), what was adopted may be what that
        record replaced (the follower skipped it, no peer being held yet): the next connect looks again."""
        seen = self._seen.get(peer.engine_id)
        if seen is not None and seen[0] > changes_seen and seen[1] != peer.fingerprint:
            peer.stale = True

    def check_peer(self, reply: messages.MetadataReply, where: str) -> None:
        """Refuse a peer whose memory or wire we cannot use: ourselves, compatibility hash, then TCP segments."""
        if reply.agent_name == self._agent_name:
            raise HandshakeRejected(f"{where} is this engine itself: NIXL cannot load an agent as its own peer",
                                    address=where)  # fmt: skip
        self.check_compat(reply.engine_id, reply.compat_hash, where)
        if self._tcp_segment is not None and reply.tcp_segment_bytes > self._tcp_segment:
            why = segment_mismatch(self._tcp_segment, reply.tcp_segment_bytes)
            raise IncompatiblePeerError(f"{where} (engine {reply.engine_id!r}): {why}", address=where)

    def check_compat(self, engine_id: str, compat_hash: str, where: str) -> None:
        if compat_hash == self._compat_hash:
            return
        mismatch = f"{where} (engine {engine_id!r}) has compatibility hash {compat_hash}, ours is {self._compat_hash}"
        if self.config.enforce_compat:
            raise IncompatiblePeerError(f"{mismatch}: its memory cannot be used with ours", address=where)
        log.warning("%s: connecting anyway (EngineConfig.enforce_compat is off)", mismatch)

    # -- through etcd ---------------------------------------------------------------------
    def require_directory(self) -> EtcdDirectory:
        if self.directory is None:
            raise RuntimeError("no discovery service configured: set EngineConfig.etcd")
        return self.directory

    def republish(self, record: Callable[[], messages.PublishedEngine]) -> None:
        """Put our record again, if it was published (what a handshake answers changed)."""
        if self.directory is not None and self.directory.published and not self._closing:
            self.directory.republish(record())

    async def connect_published(self, engine_id: str, timeout: float | None, refresh: bool) -> Peer:
        """Connect to the engine `engine_id` published in etcd (see `_discover`)."""
        directory = self.require_directory()
        peer = self._peers.table.get(engine_id)
        if peer is None or refresh or not peer.connected or peer.stale or peer.unpublished:
            limit = handshake_limit(self.config, timeout, engine_id)
            discover = functools.partial(self._discover, directory, engine_id, limit)
            peer = await self._shared(("etcd", engine_id), f"discover:{engine_id}", discover, limit, fresh=refresh)
        elif engine_id not in self._discovered:  # held from a handshake by address: follow its record from now on
            self._discovered.add(engine_id)
            self._start_follower(directory)
        assert self._loop is not None
        self._peers.table.touch(peer, self._loop.time())
        return peer

    def _adopts_records(self, held: Peer | None) -> bool:
        """Whether a published record may stand in for a handshake reply.

        Only between engines without a shared secret (a record proves nothing), with NIXL
        notifications (side-channel ones need a session only the peer issues), and for a peer we
        have not handshaken with (that would drop its session and measured clock offset).
        """
        return (
            self.config.auth_secret is None
            and self.config.notify_via == "nixl"
            and not (held is not None and held.notify_session)
        )

    async def _discover(self, directory: EtcdDirectory, engine_id: str, timeout: float) -> Peer:
        """Find `engine_id` in etcd, check it as a handshake would, then adopt its record or handshake.

        A record adopted directly means the peer is never asked (its loop does no work for us)
        and its clock is taken to agree with ours (no round trip measures an offset). Otherwise
        etcd gives the address and the side-channel handshake runs as usual. A record older than
        one the follower applied meanwhile is read again, never adopted (`RecordOrder`).
        """
        assert self._loop is not None
        started = self._loop.time()
        changes_seen = self._change_seq
        behind: int | None = None  # the applied revision the last lookup was older than
        while True:
            remaining = max(0.001, timeout - (self._loop.time() - started))
            try:
                self._start_follower(directory)
                record, revision = await directory.lookup(engine_id, remaining)
                where = f"etcd record of {engine_id!r}"
                if record is None:
                    raise PeerNotPublished(f"no engine {engine_id!r} is published in etcd at {directory.endpoint}",
                                           address=directory.endpoint)  # fmt: skip
                if not _claims(record, engine_id):
                    raise EngineIdMismatch(f"etcd's record for {engine_id!r} is another engine's", address=where)
                self.check_compat(engine_id, record.compat_hash, where)
                direct = record.metadata is not None and self._adopts_records(self._peers.table.get(engine_id))
                if not direct and not record.host:
                    raise HandshakeRejected(f"engine {engine_id!r} serves no side channel, and its record cannot be "
                                            "used without one (a shared secret or notify_via='side_channel')",
                                            address=where)  # fmt: skip
            except BaseException:
                self.stats.counters["handshake_failures"] += 1
                raise
            self._discovered.add(engine_id)
            if not direct:
                remaining = max(0.001, timeout - (self._loop.time() - started))
                peer = await self._handshake(record.host, record.port, remaining, engine_id)  # counts itself
                if peer.engine_id != engine_id:
                    where = f"{record.host}:{record.port}"
                    raise EngineIdMismatch(f"{where} is engine {peer.engine_id!r}, etcd says {engine_id!r}",
                                           address=where)  # fmt: skip
                return peer
            try:
                adopted = await _adopting(self._adopt_published(record, revision, behind), started + timeout, timeout,
                                          f"etcd record of {engine_id!r}")  # fmt: skip
            except BaseException:
                self.stats.counters["handshake_failures"] += 1
                raise
            if adopted is not None:
                self._stale_if_changed(adopted, changes_seen)
                break
            behind = self._order.applied(engine_id)  # the follower applied a newer change: read again
        self.stats.counters["handshakes"] += 1
        self.stats.counters["handshakes_via_etcd"] += 1
        self.stats.histograms["handshake_us"].record(self._loop.time() - started)
        return adopted

    async def _adopt_published(
        self, record: messages.PublishedEngine, revision: int, behind: int | None = None
    ) -> Peer | None:
        """Adopt `record`, read at etcd's `revision`, unless a newer one was applied (None)."""
        assert self._loop is not None and record.metadata is not None
        self.check_peer(record.metadata, f"etcd record of {record.engine_id!r}")

        def newest() -> bool:
            return self._order.claim(record.engine_id, revision, behind=behind)

        return await self._peers.adopt_record(record.metadata, (record.host, record.port), self._loop.time(), newest,
                                              self._adopts_records)  # fmt: skip

    def _start_follower(self, directory: EtcdDirectory) -> None:
        if self._follower is None and not self._closing:
            assert self._loop is not None
            name = f"etcd-follower:{self.config.engine_id}"
            self._follower = self._loop.create_task(self._follow(directory), name=name)

    async def _follow(self, directory: EtcdDirectory) -> None:
        """Apply what etcd says about peers we found there: a changed record refreshes them, a gone one
        marks them unpublished.

        A peer adopted from a record is refreshed at once (new layouts usable, re-registered
        memory reloaded); one we handshook with is marked stale, so its next `connect` handshakes
        again. A record that went (closed, lease ran out) only marks the peer unpublished: transfers
        in flight go on, and the next ``connect(engine_id=...)`` raises `PeerNotPublished`, unless
        the record came back as it was (etcd wiped, a lease that lapsed): that clears the mark.
        """
        async for changes in directory.changes():
            gone: list[str] = []
            newer: set[str] = set()  # a lookup applied a newer record of these while the listing was read
            if changes.complete:
                newer = self._order.relisted(changes.revision, changes.revisions, changes.asked_at)
                # forgotten ones go (not those a lookup is connecting to: before, a listing read while the lookup
                # handshook dropped its peer, and no change of its record was followed from then on)
                connecting = {key[1] for key in self._connecting if key[0] == "etcd"}
                reloading = {peer.engine_id for peer in self._peers.retiring.values()}  # (a handshake may reload it)
                self._discovered &= {peer.engine_id for peer in self._peers.table} | connecting | reloading
                self._seen = {i: seen for i, seen in self._seen.items() if i in self._discovered}
                gone = [i for i in self._discovered if i not in changes.records]
            for engine_id, record in [*changes.records.items(), *((i, None) for i in gone)]:
                if engine_id in newer:
                    continue
                revision = changes.revisions.get(engine_id, changes.revision)
                followed = engine_id in self._discovered or ("etcd", engine_id) in self._connecting
                if followed and not changes.complete and not self._order.claim(engine_id, revision):
                    continue  # a lookup applied a newer record of it already
                peer = self._peers.table.get(engine_id)
                if followed:  # (a connect under way may adopt what it read before this: `_stale_if_changed`)
                    self._change_seq += 1
                    self._seen[engine_id] = (self._change_seq, None if record is None else record.fingerprint)
                if engine_id not in self._discovered or peer is None or not peer.connected:
                    continue
                if record is None:
                    if not peer.unpublished:
                        self.stats.counters["published_peers_gone"] += 1
                    peer.unpublished = True
                    continue
                if record.fingerprint == peer.fingerprint:
                    peer.unpublished = False  # (it may have gone and come back as it was)
                    if record.host and (record.host, record.port) != peer.address:
                        if not peer.notify_session:
                            peer.address = (record.host, record.port)  # it serves elsewhere now (calls go there)
                        elif record.port != peer.address[1]:  # (another name for one server keeps its port)
                            peer.stale = True  # its session is the old server's: the next connect handshakes
                    continue
                self.stats.counters["published_peers_refreshed"] += 1
                if record.metadata is None or not self._adopts_records(peer) or not _claims(record, engine_id):
                    peer.stale = True  # the next connect handshakes again (and checks whom it reaches)
                    continue
                try:
                    await self._adopt_published(record, revision)
                except Exception as exc:  # incompatible now, or fenced: the next connect says why
                    log.warning("refreshing peer %s from etcd failed: %s", engine_id, exc)
                    peer.stale = True


def _claims(record: messages.PublishedEngine, engine_id: str) -> bool:
    """Whether an etcd record under `engine_id`'s key is that engine's, by its key and by its agent metadata."""
    return record.engine_id == engine_id and (record.metadata is None or record.metadata.engine_id == engine_id)
