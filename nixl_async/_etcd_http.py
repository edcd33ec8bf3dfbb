"""etcd v3 through its JSON gateway (``/v3/...`` over HTTP, etcd >= 3.4), on the caller's loop.

Why HTTP and not gRPC: a gRPC asyncio client adds gRPC's own poller thread and binds its
completion queue to event loops; an engine run in several loops in turn (tests, tools) hung on
a gRPC call that never completed. aiohttp runs entirely in the loop that awaits it. The gateway's
JSON is decoded into msgspec Structs (etcd sends 64-bit numbers as strings and bytes as base64).

Only what discovery needs: range, put, lease grant / keep-alive / revoke, and a prefix watch.
Errors: `EtcdUnreachable` (no connection), `EtcdError` (etcd answered with an error).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeVar

import msgspec

__all__ = ["EtcdError", "EtcdHttp", "EtcdUnreachable", "Event", "KeyValue", "prefix_end"]

_T = TypeVar("_T")


class EtcdUnreachable(Exception):
    """No HTTP exchange with etcd was possible (refused, reset, DNS)."""


class WatchIdle(EtcdUnreachable):
    """A watch stream carried nothing for its idle limit: quiet, or a dead connection (a partition
    or a lost host resets nothing, and the stream would wait for ever). Watch again from there."""


class EtcdError(Exception):
    """etcd answered with an error; `code` is its gRPC status code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Header(msgspec.Struct, frozen=True):
    revision: int = 0


class KeyValue(msgspec.Struct):
    key: bytes
    value: bytes = b""
    mod_revision: int = 0
    lease: int = 0


class _Range(msgspec.Struct):
    header: _Header
    kvs: list[KeyValue] = []


class _Grant(msgspec.Struct):
    ID: int
    TTL: int = 0


class _KeepAliveResult(msgspec.Struct):
    TTL: int = 0  # absent (0): the lease is gone


class _KeepAlive(msgspec.Struct):
    result: _KeepAliveResult


class Event(msgspec.Struct):
    kv: KeyValue
    type: str = "PUT"


class _WatchResult(msgspec.Struct):
    header: _Header = _Header()
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""
    events: list[Event] = []


class _WatchLine(msgspec.Struct):
    result: _WatchResult | None = None
    error: dict[str, Any] | None = None


def _etcd_error(data: bytes, fallback: str) -> EtcdError:
    """The error in an etcd gateway's answer: ``{"code", "message"}`` from a unary call, ``{"error": {"grpc_code",
    "message"}}`` from a streaming one (keepalive, watch), whose code was read as 0 (UNAVAILABLE not retried)."""
    try:
        body = msgspec.json.decode(data) if data.startswith(b"{") else {}
    except msgspec.DecodeError:
        body = {}
    inner = body.get("error")
    if isinstance(inner, dict):
        body = {"code": inner.get("grpc_code", inner.get("code")), "message": inner.get("message")}
    code = body.get("code")
    return EtcdError(code if isinstance(code, int) else 0, str(body.get("message") or fallback))


def prefix_end(prefix: bytes) -> bytes:
    """The end of etcd's range of keys starting with `prefix`."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\x00"
    end[-1] += 1
    return bytes(end)


class EtcdHttp:
    """One etcd endpoint; an aiohttp session made on first use in the running loop."""

    def __init__(self, endpoint: str) -> None:
        self.base = f"http://{endpoint}"
        self._session: Any = None  # aiohttp.ClientSession
        self._closed = False

    def _open(self) -> Any:
        import aiohttp

        if self._closed:  # a call still retrying after close() opens no new session
            raise EtcdUnreachable(f"{self.base}: the client is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(self.base, timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def _post(self, path: str, body: dict[str, Any], answer: type[_T]) -> _T:
        import aiohttp

        try:
            async with self._open().post(path, data=msgspec.json.encode(body)) as reply:
                data = await reply.read()
                status = reply.status
        except aiohttp.ClientError as exc:  # no connection, or a reply cut midway
            raise EtcdUnreachable(f"{self.base}: {exc!r}") from None
        if status != 200 or data.startswith(b'{"error"'):  # (a streaming endpoint's error comes with 200)
            raise _etcd_error(data, f"HTTP {status} on {path}")
        return msgspec.json.decode(data, type=answer, strict=False)

    async def get(self, key: bytes) -> tuple[KeyValue | None, int]:
        """`key` (None: absent), and the revision etcd read it at."""
        found = await self._post("/v3/kv/range", {"key": key}, _Range)
        return (found.kvs[0] if found.kvs else None), found.header.revision

    async def get_prefix(self, prefix: bytes, *, keys_only: bool = False) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` (without values if `keys_only`), and the revision they were read at."""
        body: dict[str, Any] = {"key": prefix, "range_end": prefix_end(prefix)}
        if keys_only:
            body["keys_only"] = True
        found = await self._post("/v3/kv/range", body, _Range)
        return found.kvs, found.header.revision

    async def put(self, key: bytes, value: bytes, lease: int) -> None:
        await self._post("/v3/kv/put", {"key": key, "value": value, "lease": lease}, _Range)

    async def grant(self, ttl: int) -> int:
        return (await self._post("/v3/lease/grant", {"TTL": ttl}, _Grant)).ID

    async def keep_alive(self, lease: int) -> int:
        """Renew `lease` once; its new TTL (0: it is gone)."""
        return (await self._post("/v3/lease/keepalive", {"ID": lease}, _KeepAlive)).result.TTL

    async def revoke(self, lease: int) -> None:
        await self._post("/v3/lease/revoke", {"ID": lease}, _Range)

    async def watch_prefix(self, prefix: bytes, start_revision: int, idle_s: float,
                           connect_s: float | None = None) -> AsyncIterator[Event]:  # fmt: skip
        """Events under `prefix` from `start_revision` on, until the stream breaks.

        Raises `WatchIdle` after `idle_s` without a byte, `EtcdUnreachable` (also when a new
        connection is not made within `connect_s`: a host dropping our packets would otherwise hold
        the watch for the kernel's minutes of retries), or `EtcdError` when etcd cancels the watch
        (e.g. that revision was compacted: read everything again and watch from there).
        """
        import aiohttp

        request = {"create_request": {"key": prefix, "range_end": prefix_end(prefix), "start_revision": start_revision}}
        # each read: the reply's head, then each chunk
        idle = aiohttp.ClientTimeout(total=None, sock_read=idle_s, sock_connect=connect_s)
        try:
            async with self._open().post("/v3/watch", data=msgspec.json.encode(request), timeout=idle) as reply:
                if reply.status != 200:
                    raise EtcdError(0, f"HTTP {reply.status} on /v3/watch")
                pending = b""
                async for chunk in reply.content.iter_any():
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if not line.strip():
                            continue
                        message = msgspec.json.decode(line, type=_WatchLine, strict=False)
                        if message.error is not None:
                            raise _etcd_error(line, "watch error")
                        result = message.result
                        if result is None:
                            continue
                        if result.canceled or result.compact_revision:
                            raise EtcdError(0, f"watch cancelled: {result.cancel_reason or 'compacted'}")
                        for event in result.events:
                            yield event
        except aiohttp.ConnectionTimeoutError as exc:  # (a TimeoutError too: not an idle stream)
            raise EtcdUnreachable(f"{self.base}: {exc!r}") from None
        except TimeoutError:  # (aiohttp's ServerTimeoutError)
            raise WatchIdle(f"{self.base}: nothing on the watch stream for {idle_s}s") from None
        except aiohttp.ClientError as exc:
            raise EtcdUnreachable(f"{self.base}: {exc!r}") from None
        raise EtcdUnreachable(f"{self.base}: the watch stream ended")

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None
