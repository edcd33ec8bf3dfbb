"""Fleet discovery through etcd: engines publish what a handshake would tell, under a lease.

Layout in etcd: one key per engine, ``<namespace>/engines/<engine_id>``, whose value is a msgpack
`PublishedEngine` (its handshake reply: NIXL agent metadata, layouts, compat hash, extra; and its
side-channel address if it serves one). The key is attached to the engine's lease: the engine
renews it every third of `lease_ttl_s` from its loop, so an engine that dies (or loses etcd)
disappears that long after; `close()` revokes the lease and the key goes at once.

Why our own keys and not NIXL's etcd exchange (``NIXL_ETCD_ENDPOINTS``, read from the process
environment when an agent is made): NIXL talks to etcd from a worker thread of its own, which loads
remote agents into ours while our loop uses it (and so turns NIXL's locking on for every call); a
fetch only queues work, to be polled for; and its keys carry no lease, so a crashed engine's
metadata stays in etcd for good. Here etcd is spoken by the engine's loop (`aetcd`, gRPC's
asyncio API; gRPC adds its own poller thread, which never touches NIXL), every record carries what
the compat and engine-id checks need, and liveness is etcd's lease.

Every call is bounded by the engine's handshake timeout; etcd down or unreachable is
`DiscoveryUnavailable`. Transfers never touch etcd: engines already connected keep transferring.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec

from . import messages
from .config import EtcdConfig
from .exceptions import DiscoveryUnavailable, ProtocolError

__all__ = ["EtcdDirectory"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_RETRY_S = 1.0  # after a failed renewal or a broken watch
_WARN_INTERVAL_S = 10.0


class EtcdDirectory:
    """An engine's view of etcd: publish itself (kept alive), look up and watch others."""

    def __init__(self, config: EtcdConfig, *, timeout: float) -> None:
        try:
            import aetcd
        except ImportError:  # pragma: no cover - depends on the install
            raise DiscoveryUnavailable(
                "EngineConfig.etcd needs the aetcd package: pip install 'nixl-async[etcd]'"
            ) from None
        self._config = config
        self._timeout = timeout
        self._client: Any = aetcd.Client(config.host, config.port, timeout=timeout)
        self._prefix = f"{config.namespace}/engines/".encode()
        self._record: messages.PublishedEngine | None = None  # what we publish (None: nothing)
        self._lease_id: int | None = None
        self._dirty = asyncio.Event()  # the record changed: put it again
        self._keeper: asyncio.Task[None] | None = None
        self._warned_at = float("-inf")
        self.republished = 0  # puts after the first (a re-registration, a lost lease)

    @property
    def endpoint(self) -> str:
        return self._config.endpoint

    def key(self, engine_id: str) -> bytes:
        return self._prefix + engine_id.encode()

    async def _bounded(self, what: str, call: Awaitable[_T]) -> _T:
        """Await an etcd call within the timeout; any failure of etcd is `DiscoveryUnavailable`."""
        from aetcd.exceptions import ClientError

        try:
            async with asyncio.timeout(self._timeout):
                return await call
        except TimeoutError:
            raise DiscoveryUnavailable(
                f"etcd at {self.endpoint} did not answer {what} within {self._timeout}s", address=self.endpoint
            ) from None
        except ClientError as exc:
            raise DiscoveryUnavailable(f"etcd at {self.endpoint} failed {what}: {exc}", address=self.endpoint) from None

    # -- looking up -----------------------------------------------------------------------
    async def lookup(self, engine_id: str) -> messages.PublishedEngine | None:
        """The record `engine_id` published, or None. Raises `DiscoveryUnavailable`, `ProtocolError`."""
        found = await self._bounded(f"a lookup of {engine_id!r}", self._client.get(self.key(engine_id)))
        return None if found is None else self._decode(engine_id, found.value)

    def _decode(self, engine_id: str, value: bytes) -> messages.PublishedEngine:
        try:
            return messages.decode_published(value)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"undecodable etcd record for engine {engine_id!r}: {exc}",
                                address=self.endpoint) from None  # fmt: skip

    async def changes(self) -> AsyncIterator[tuple[str, messages.PublishedEngine | None]]:
        """(engine id, its new record, or None once gone) for every change under our prefix, for ever.

        A broken watch (etcd restarted, unreachable) is retried every second; changes made
        while it was broken are replayed from the last revision seen when etcd still has them.
        """
        from aetcd.exceptions import ClientError

        next_revision: int | None = None
        while True:
            watch = None
            try:
                opening = self._client.watch_prefix(self._prefix, start_revision=next_revision)
                watch = await self._bounded("a watch", opening)
                async for event in watch:
                    next_revision = event.kv.mod_revision + 1
                    engine_id = event.kv.key[len(self._prefix) :].decode(errors="replace")
                    if event.kind == "DELETE":
                        yield engine_id, None
                        continue
                    try:
                        yield engine_id, self._decode(engine_id, event.kv.value)
                    except ProtocolError as exc:
                        log.warning("%s", exc)
            except (DiscoveryUnavailable, ClientError) as exc:
                self._warn(f"watching etcd at {self.endpoint} failed ({exc}): retrying")
            except Exception:  # a bug must not end the watch for good: say so loudly, and go on
                log.exception("watching etcd at %s failed: retrying", self.endpoint)
            finally:
                if watch is not None:
                    with contextlib.suppress(Exception):
                        await watch.cancel()
            await asyncio.sleep(_RETRY_S)

    # -- publishing -----------------------------------------------------------------------
    async def publish(self, record: messages.PublishedEngine) -> None:
        """Put `record` under our key on a fresh lease, then keep the lease alive from a task.

        Raises `DiscoveryUnavailable` if etcd does not take it within the timeout.
        """
        self._record = record
        await self._put_on_lease()
        if self._keeper is None:
            self._keeper = asyncio.get_running_loop().create_task(self._keep(), name=f"etcd-keeper:{self.endpoint}")

    def republish(self, record: messages.PublishedEngine) -> None:
        """`record` replaces what we published (once published); the keeper puts it soon."""
        if self._record is None:
            return
        self._record = record
        self._dirty.set()

    async def _put_on_lease(self) -> None:
        record = self._record
        assert record is not None
        if self._lease_id is None:
            lease = await self._bounded("a lease grant", self._client.lease(self._config.lease_ttl_s))
            self._lease_id = lease.id
        key = self.key(record.metadata.engine_id)
        await self._bounded("a put", self._client.put(key, messages.encode(record), lease=self._lease_id))

    async def _keep(self) -> None:
        """Renew the lease every ttl/3; put the record again when it changed or the lease was lost.

        A failed put drops the lease (it may be the lease etcd no longer knows): the next try
        grants a new one, and the old one, if it lives, runs out on its own.
        """
        interval = self._config.lease_ttl_s / 3
        renew_at = time.monotonic() + interval
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, renew_at - time.monotonic())):
                    await self._dirty.wait()
            putting = self._dirty.is_set()
            try:
                if putting:
                    self._dirty.clear()
                    await self._put_on_lease()
                    self.republished += 1
                    renew_at = max(renew_at, time.monotonic() + _RETRY_S)
                if time.monotonic() >= renew_at:
                    reply = await self._bounded("a lease renewal", self._client.refresh_lease(self._lease_id))
                    if reply is None or reply.TTL <= 0:  # it ran out meanwhile: our key is gone
                        self._warn(f"our etcd lease at {self.endpoint} had run out: publishing again")
                        self._lease_id = None
                        self._dirty.set()
                        continue
                    renew_at = time.monotonic() + interval
            except DiscoveryUnavailable as exc:
                self._warn(f"{exc}: retrying")
                if putting:
                    self._lease_id = None
                    self._dirty.set()
                renew_at = time.monotonic() + _RETRY_S
                await asyncio.sleep(_RETRY_S)

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= _WARN_INTERVAL_S:
            self._warned_at = now
            log.warning("%s", message)

    async def close(self) -> None:
        """Stop renewing, revoke the lease (our key goes at once; bounded), close the client."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None
        if self._lease_id is not None:
            try:
                await self._bounded("a lease revocation", self._client.revoke_lease(self._lease_id))
            except DiscoveryUnavailable as exc:
                log.warning("%s: our key goes when the lease runs out", exc)
            self._lease_id = None
        self._record = None
        with contextlib.suppress(Exception):
            await self._client.close()
