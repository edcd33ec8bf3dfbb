"""Fleet discovery through etcd: engines publish what a handshake would tell, under a lease.

Layout in etcd: one key per engine, ``<namespace>/engines/<engine_id>``, whose value is a msgpack
`PublishedEngine` (engine id, compat hash, side-channel address, and, unless the engine has a shared
secret, its handshake reply: NIXL agent metadata, layouts, extra). The key is attached to the engine's lease: the engine
renews it every third of `lease_ttl_s` from its loop, so an engine that dies (or loses etcd)
disappears that long after; `close()` revokes the lease and the key goes at once.

Why our own keys and not NIXL's etcd exchange (``NIXL_ETCD_ENDPOINTS``, read from the process
environment when an agent is made): NIXL talks to etcd from a worker thread of its own, which loads
remote agents into ours while our loop uses it (and so turns NIXL's locking on for every call); a
fetch only queues work, to be polled for; and its keys carry no lease, so a crashed engine's
metadata stays in etcd for good. Here etcd is spoken by the engine's loop (its JSON gateway over
aiohttp, `_etcd_http.py`: no thread), every record carries what the compat and engine-id checks
need, and liveness is etcd's lease.

Every call is bounded by the engine's handshake timeout; etcd down or unreachable is
`DiscoveryUnavailable`. Transfers never touch etcd: engines already connected keep transferring.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import msgspec

from . import messages
from ._etcd_http import EtcdError, EtcdHttp, EtcdUnreachable, KeyValue, WatchIdle
from .config import EtcdConfig
from .exceptions import DiscoveryUnavailable, EngineClosedError, ProtocolError

__all__ = ["Changes", "EtcdDirectory", "Found", "RecordOrder"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_RETRY_S = 1.0  # after a failed renewal or a broken watch
_WATCH_IDLE_S = 30.0  # a watch quiet this long is started again (it may sit on a dead connection)
_WARN_INTERVAL_S = 10.0
_UNREACHABLE_RETRY_S = 0.1
_GRPC_UNAVAILABLE = 14  # what etcd answers while a cluster has no leader, changes it, or times out: retried


@dataclass(frozen=True)
class Changes:
    """Records that changed (None: gone), each with etcd's revision of its change (`revisions`).
    `complete`: these are all the records there are (a resync), as of etcd's `revision`."""

    records: dict[str, messages.PublishedEngine | None]
    revisions: dict[str, int]
    complete: bool = False
    revision: int = 0
    asked_at: float = 0.0  # a complete listing: when it was asked for (`time.monotonic()`)


class Found(NamedTuple):
    """A lookup's answer: the record (None: none published) and the etcd revision it was read at."""

    record: messages.PublishedEngine | None
    revision: int


class RecordOrder:
    """The newest etcd revision of each engine's record applied here, so that an older read never
    undoes a newer one.

    A lookup and the watch race: the lookup reads a record, the watch applies the engine's next
    one (or its deletion), and the lookup's answer is applied last. Each application claims its
    revision first; a claim older than one applied fails (the lookup reads again, the watch skips
    the event). etcd's revisions go back only when it was wiped: a read found older than the same
    applied revision twice in a row is taken (a second read of one etcd is never older). A full
    listing starts the order again, but for records a lookup applied while it was under way, read
    after it (a newer revision): the listing's older record of those engines is not applied.
    """

    def __init__(self) -> None:
        self._applied: dict[str, int] = {}
        self._claimed_at: dict[str, float] = {}  # engine id -> when its applied revision was claimed
        self._listed_at = 0  # revision of the last full listing: engines it lacked were gone then

    def relisted(self, revision: int, present: dict[str, int], asked_at: float) -> set[str]:
        """A full listing at `revision`, asked for at `asked_at`, of the records `present` (engine id ->
        its mod revision). Returns the engines whose newer record a lookup applied meanwhile (kept)."""
        kept = {engine_id for engine_id, applied in self._applied.items()
                if applied > revision and self._claimed_at.get(engine_id, -math.inf) >= asked_at}  # fmt: skip
        self._applied = {**present, **{engine_id: self._applied[engine_id] for engine_id in kept}}
        self._claimed_at = {engine_id: self._claimed_at[engine_id] for engine_id in kept}
        self._listed_at = revision
        return kept

    def applied(self, engine_id: str) -> int:
        return self._applied.get(engine_id, self._listed_at)

    def claim(self, engine_id: str, revision: int, *, behind: int | None = None) -> bool:
        """Whether a read of `engine_id` at `revision` may be applied (and is then the newest).
        `behind`: the applied revision a previous read of it was older than."""
        applied = self.applied(engine_id)
        if revision < applied and applied != behind:
            return False
        self._applied[engine_id] = revision
        self._claimed_at[engine_id] = time.monotonic()
        return True


class EtcdDirectory:
    """An engine's view of etcd: publish itself (kept alive), look up and watch others."""

    def __init__(self, config: EtcdConfig, *, timeout: float) -> None:
        try:
            import aiohttp  # noqa: F401
        except ImportError:  # pragma: no cover - depends on the install
            raise DiscoveryUnavailable(
                "EngineConfig.etcd needs the aiohttp package: pip install 'nixl-async[etcd]'"
            ) from None
        self._config = config
        self._timeout = timeout
        self._client = EtcdHttp(config.endpoint)
        self._prefix = f"{config.namespace}/engines/".encode()
        self._record: messages.PublishedEngine | None = None  # what we publish (None: nothing)
        self._lease_id: int | None = None
        self._dirty = asyncio.Event()  # the record changed: put it again
        self._keeper: asyncio.Task[None] | None = None
        self._warned_at = float("-inf")
        self._closed = False
        self._closing = False  # close() began: no publish starts, one under way ends first
        self._publishing = asyncio.Lock()
        self.republished = 0  # puts after the first (a re-registration, a lost lease)

    @property
    def endpoint(self) -> str:
        return self._config.endpoint

    def key(self, engine_id: str) -> bytes:
        return self._prefix + engine_id.encode()

    async def _bounded(self, what: str, call: Callable[[], Awaitable[_T]], timeout: float | None = None) -> _T:
        """Make an etcd call within the timeout; any failure of etcd is `DiscoveryUnavailable`.

        Until the deadline an unreachable etcd, or one answering UNAVAILABLE (a cluster electing a
        leader), is tried again, so a blip shorter than the timeout costs only time.
        """
        if self._closed:
            raise EngineClosedError("the engine's etcd directory is closed")
        limit = self._timeout if timeout is None else timeout
        last: Exception | None = None
        try:
            async with asyncio.timeout(limit):
                while True:
                    try:
                        return await call()
                    except (EtcdUnreachable, EtcdError) as exc:
                        if isinstance(exc, EtcdError) and exc.code != _GRPC_UNAVAILABLE:
                            raise
                        if self._closed:  # closed meanwhile: no new connection
                            raise EngineClosedError("the engine's etcd directory was closed") from None
                        last = exc
                        await asyncio.sleep(_UNREACHABLE_RETRY_S)
        except TimeoutError:
            why = f" (last error: {last})" if last is not None else ""
            raise DiscoveryUnavailable(f"etcd at {self.endpoint} did not answer {what} within {limit}s{why}",
                                       address=self.endpoint) from None  # fmt: skip
        except (EtcdError, msgspec.DecodeError) as exc:
            raise DiscoveryUnavailable(f"etcd at {self.endpoint} failed {what}: {exc}", address=self.endpoint) from None

    # -- looking up -----------------------------------------------------------------------
    async def lookup(self, engine_id: str, timeout: float | None = None) -> Found:
        """The record `engine_id` published (None: none). Raises `DiscoveryUnavailable`, `ProtocolError`."""
        key = self.key(engine_id)
        found, revision = await self._bounded(f"a lookup of {engine_id!r}", lambda: self._client.get(key), timeout)
        return Found(None if found is None else self._decode(engine_id, found.value), revision)

    def _decode(self, engine_id: str, value: bytes) -> messages.PublishedEngine:
        try:
            record = messages.decode_published(value)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"undecodable etcd record for engine {engine_id!r}: {exc}",
                                address=self.endpoint) from None  # fmt: skip
        if record.version not in (messages.PROTOCOL_VERSION, messages.SEGMENTS_RECORD_VERSION):
            raise ProtocolError(f"etcd record for engine {engine_id!r} has protocol version {record.version}"
                                f" (want {messages.PROTOCOL_VERSION})", address=self.endpoint)  # fmt: skip
        return record

    def _decoded(self, key: bytes, value: bytes) -> messages.PublishedEngine | None:
        try:
            return self._decode(self._engine_id(key), value)
        except ProtocolError as exc:
            self._warn(str(exc))
            return None

    async def changes(self) -> AsyncIterator[Changes]:
        """Every change under our prefix, for ever: first (and after each broken watch) all records
        there are (`Changes.complete`), then each change as it happens.

        Reading everything and watching from that revision on misses nothing in between, survives
        a compacted history and an etcd that was wiped (its revisions start again). An undecodable
        record counts as gone. A broken watch is retried every second. One quiet for `_WATCH_IDLE_S`
        is started again at once (a partition leaves a dead connection open, on which it would wait
        for ever): from etcd's revision now if our keys stand as we know them (a listing of keys
        only), else after a full listing (etcd came back wiped, or we missed a change).
        """
        known: dict[bytes, int] = {}  # our keys -> their mod revisions, as listed and watched
        resume_at: int | None = None  # watch from here without a full listing
        while not self._closed:
            try:
                if resume_at is None:
                    asked_at = time.monotonic()
                    kvs, revision = await self._bounded("a listing", lambda: self._client.get_prefix(self._prefix))
                    known = {kv.key: kv.mod_revision for kv in kvs}
                    yield Changes({self._engine_id(kv.key): self._decoded(kv.key, kv.value) for kv in kvs},
                                  {self._engine_id(kv.key): kv.mod_revision for kv in kvs},
                                  complete=True, revision=revision, asked_at=asked_at)  # fmt: skip
                else:
                    revision, resume_at = resume_at, None
                async for event in self._client.watch_prefix(self._prefix, revision + 1, _WATCH_IDLE_S, self._timeout):
                    gone = event.type == "DELETE"
                    if gone:
                        known.pop(event.kv.key, None)
                    else:
                        known[event.kv.key] = event.kv.mod_revision
                    record = None if gone else self._decoded(event.kv.key, event.kv.value)
                    engine_id = self._engine_id(event.kv.key)  # (a deletion's mod revision is the deletion's)
                    yield Changes({engine_id: record}, {engine_id: event.kv.mod_revision})
            except EngineClosedError:
                return
            except WatchIdle:
                resume_at = await self._unchanged_since(known)
                continue
            except (DiscoveryUnavailable, EtcdUnreachable, EtcdError, msgspec.DecodeError) as exc:
                self._warn(f"watching etcd at {self.endpoint} failed ({exc}): retrying")
            except Exception:  # a bug must not end the watch for good: say so loudly, and go on
                log.exception("watching etcd at %s failed: retrying", self.endpoint)
            await asyncio.sleep(_RETRY_S)

    async def _unchanged_since(self, known: dict[bytes, int]) -> int | None:
        """etcd's revision now if our keys are exactly `known` (same mod revisions), else None."""

        def keys() -> Awaitable[tuple[list[KeyValue], int]]:
            return self._client.get_prefix(self._prefix, keys_only=True)

        try:
            kvs, revision = await self._bounded("a listing of keys", keys)
        except Exception:  # the full listing that follows says what is wrong
            return None
        return revision if {kv.key: kv.mod_revision for kv in kvs} == known else None

    def _engine_id(self, key: bytes) -> str:
        return key[len(self._prefix) :].decode(errors="replace")

    # -- publishing -----------------------------------------------------------------------
    async def publish(self, record: messages.PublishedEngine) -> None:
        """Put `record` under our key on a fresh lease, then keep the lease alive from a task.

        Raises `DiscoveryUnavailable` if etcd does not take it within the timeout.
        """
        async with self._publishing:  # (a close waits for it, so the lease it takes is revoked)
            if self._closing:
                raise EngineClosedError("the engine's etcd directory is closed")
            self._record = record
            await self._put_on_lease()
        if self._keeper is None and not self._closed:
            self._keeper = asyncio.get_running_loop().create_task(self._keep(), name=f"etcd-keeper:{self.endpoint}")

    @property
    def published(self) -> bool:
        """Whether we publish a record (so a change must be put again)."""
        return self._record is not None

    def republish(self, record: messages.PublishedEngine) -> None:
        """`record` replaces what we published (once published); the keeper puts it soon."""
        if self._record is None:
            return
        self._record = record
        self._dirty.set()

    async def _put_on_lease(self) -> None:
        record = self._record
        assert record is not None
        key, value = self.key(record.engine_id), messages.encode(record)
        for attempt in range(2):
            if self._lease_id is None:
                self._lease_id = await self._bounded("a lease grant",
                                                     lambda: self._client.grant(self._config.lease_ttl_s))  # fmt: skip
            lease_id = self._lease_id
            try:
                await self._bounded("a put", lambda: self._client.put(key, value, lease=lease_id))  # noqa: B023
                return
            except DiscoveryUnavailable as exc:
                if "lease not found" not in str(exc) or attempt:
                    raise
                self._lease_id = None  # it ran out (or etcd was wiped): put again on a new one

    async def _keep(self) -> None:
        """Renew the lease every ttl/3; put the record again when it changed or the lease was lost.

        A put and a renewal fail and are retried apart: a put etcd keeps refusing (a record over
        its size limit) must not stop the renewals that keep the record already there alive.
        """
        interval = self._config.lease_ttl_s / 3
        renew_at = time.monotonic() + interval
        put_at = float("inf")  # a put is due from then (the record changed, the lease was lost, a put failed)
        while True:
            if not self._dirty.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(0.0, min(renew_at, put_at) - time.monotonic())):
                        await self._dirty.wait()
            now = time.monotonic()
            if self._dirty.is_set():
                self._dirty.clear()
                put_at = min(put_at, now)
            if now >= put_at:
                try:
                    await self._put_on_lease()
                    self.republished += 1
                    put_at = float("inf")
                except Exception as exc:  # etcd down (DiscoveryUnavailable), refusing it, or anything else
                    self._warn(f"putting our etcd record at {self.endpoint} failed ({exc!r}): retrying")
                    put_at = time.monotonic() + _RETRY_S
            if now >= renew_at:
                try:
                    renew_at = await self._renew(interval)
                except Exception as exc:
                    self._warn(f"renewing our etcd lease at {self.endpoint} failed ({exc!r}): retrying")
                    renew_at = time.monotonic() + _RETRY_S
                if renew_at <= now:  # the lease or our key is gone: put again (now, or at a failed put's retry)
                    put_at = now if put_at == float("inf") else put_at
                    renew_at = put_at  # and renew right after it

    async def _renew(self, interval: float) -> float:
        """Renew our lease; when to renew next (now or earlier: put the record again first)."""
        lease = self._lease_id
        if lease is None:  # lost at the last put
            return float("-inf")
        # Within a third of the lease, so a renewal stuck on a dead connection is retried in time.
        ttl = await self._bounded("a lease renewal", lambda: self._client.keep_alive(lease), interval)
        if ttl <= 0:  # it ran out meanwhile (or etcd was wiped): our key is gone
            self._warn(f"our etcd lease at {self.endpoint} had run out: publishing again")
            self._lease_id = None
            return float("-inf")
        if not await self._key_held(lease):
            return float("-inf")
        return time.monotonic() + interval

    async def _key_held(self, lease: int) -> bool:
        """Whether our key is still there: a process publishing our engine id too (a misconfiguration)
        takes it over, and its lease, once revoked, deletes it while ours lives on."""
        record = self._record
        assert record is not None
        key = self.key(record.engine_id)
        found, _ = await self._bounded("a check of our key", lambda: self._client.get(key),
                                       self._config.lease_ttl_s / 3)  # fmt: skip
        if found is None:
            self._warn(f"our etcd record at {self.endpoint} was deleted while our lease lived: publishing again")
            return False
        if found.lease != lease:
            self._warn(f"engine id {record.engine_id!r} is published in etcd at {self.endpoint} by another process too "
                       "(its record replaced ours): two engines must not share an id")  # fmt: skip
        return True

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_INTERVAL_S:
            self._warned_at = now
            log.warning("%s", message)

    async def close(self) -> None:
        """Stop renewing, revoke the lease (our key goes at once; bounded), close the client; refuse calls after."""
        if self._closed:
            return
        self._closing = True
        async with self._publishing:  # a publish under way ends (within its timeout): its lease is ours to revoke
            pass
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        if self._lease_id is not None:
            try:
                lease_id = self._lease_id
                await self._bounded("a lease revocation", lambda: self._client.revoke(lease_id))
            except DiscoveryUnavailable as exc:
                log.warning("%s: our key goes when the lease runs out", exc)
            self._lease_id = None
        self._closed = True
        self._record = None
        await self._client.close()
