"""The handshake side channel: a zmq.asyncio ROUTER that answers metadata queries, and the
client coroutine that asks.

The server runs as one coroutine on the engine's loop. Replies are prepared bytes (the engine
rebuilds them when its registrations change), so serving a query is one decode and one send:
many concurrent queries cost nothing, and a malformed or oversized one gets an `ErrorReply`
and the server carries on. ZMQ's own frame limit (`max_frame_bytes`) drops senders of oversized
frames; a message of many frames left unfinished is held whole by ZMQ (no option bounds it), so
the port must be reachable only from trusted hosts (README, "Security").

The client opens a DEALER per handshake and bounds the whole exchange by one timeout: ZMQ
cannot tell "nobody listens" from "slow", so the timeout is what keeps a dead peer from
hanging the caller.

With a shared secret, the server answers a request without proof by an `AuthChallenge`
carrying a fresh single-use nonce; the client asks again with an HMAC over that nonce and its
request. Refusals are logged with the asker's engine id, never with the secret.

The same socket answers calls (`CallRequest`): small authenticated request/reply exchanges a
handler registered by topic answers (`on_call`), such as an adapter's lease renewals.

The same socket takes side-channel notifications (`NotifyMessage`, never answered). Every
metadata reply carries a fresh notify session issued to the asker's engine id by the server's
`NotifyGuard`; a notification is delivered only in a known session, from the engine it was
issued to, with a sequence number not seen before (and a valid MAC with a secret). Refused
ones are counted by reason in `notifications_refused` and logged at most once a second per
reason, so a flood of them cannot flood the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import NamedTuple, TypeVar

import msgspec
import zmq
import zmq.asyncio

from . import messages
from ._notify_guard import UNKNOWN_SESSION, NotifyGuard
from ._poller import ErrorThrottle
from ._zmq_tcp import bare_host, endpoint, for_host
from .exceptions import EngineIdMismatch, HandshakeRejected, HandshakeTimeout, IncompatiblePeerError, ProtocolError

__all__ = ["HandshakeServer", "Refusal", "call_peer", "fetch_metadata"]

log = logging.getLogger(__name__)

# A reply builder returns the reply; the server adds the asker's notify session and encodes it.
# (Prepared bytes are still answered as they are, without a session: notifications from that
# asker are then refused. Transitional, until every caller returns the struct.)
ReplyFor = Callable[[messages.MetadataRequest], messages.MetadataReply]
# A call handler answers one `CallRequest` (raising `Refusal` to refuse it).
CallHandler = Callable[[messages.CallRequest], messages.CallReply]
_Reply = TypeVar("_Reply", messages.MetadataReply, messages.CallReply)
_NONCE_TTL_S = 10.0
_MAX_RESTARTS = 5
_SERVE_SLICE_S = 0.002  # the longest the server answers queued messages before letting the loop run
_MAX_NONCES = 4096
_MAX_NOTIFY_SESSIONS = 4096
_REFUSAL_LOG_INTERVAL_S = 1.0
_MAX_BUSY_HINT_MS = 5000  # the longest a busy hint keeps us brisk


class Refusal(Exception):
    """Raised by a reply builder to refuse a request: answered as an `ErrorReply`, counted as rejected."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _error(code: str, message: str) -> bytes:
    return messages.encode(messages.ErrorReply(code=code, message=message))


class _Answer(NamedTuple):
    """What the server sends back, to whom, and the notify session it carries (b"": none)."""

    identity: bytes
    delimiter: list[bytes]
    payload: bytes
    session: bytes = b""


class HandshakeServer:
    """Answers `MetadataRequest`s on ``tcp://host:port`` until closed.

    `reply_for` turns a decoded request into its `MetadataReply`; it runs on the loop thread,
    so it may touch the engine's state. The server adds a notify session issued to the asker.
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        reply_for: ReplyFor,
        *,
        max_request_bytes: int,
        max_frame_bytes: int,
        on_request: Callable[[], None] | None = None,
        on_notify: Callable[[str, bytes], None] | None = None,
        on_busy_hint: Callable[[float], None] | None = None,
        on_call: CallHandler | None = None,
        secret: bytes | None = None,
        max_notify_sessions: int = _MAX_NOTIFY_SESSIONS,
        on_failed: Callable[[], None] | None = None,
    ) -> None:
        self._context = context
        self._secret = secret
        self.guard = NotifyGuard(secret, max_sessions=max_notify_sessions)
        self.notifications_refused: Counter[str] = Counter()  # by NotifyGuard reason
        self._refusal_logged_at: dict[str, float] = {}
        self._nonces: OrderedDict[bytes, float] = OrderedDict()  # outstanding challenges
        self.auth_failures = 0
        self._reply_for = reply_for
        self._max_request_bytes = max_request_bytes
        self._max_frame_bytes = max_frame_bytes
        self._on_request = on_request
        self._on_notify = on_notify
        self._on_busy_hint = on_busy_hint
        self._on_call = on_call
        self._on_failed = on_failed
        self._unanswerable = ErrorThrottle(log, "a side-channel message could not be answered; dropped")
        self.notifications = 0
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.host = ""
        self.port = 0
        self.served = 0
        self.undelivered = 0  # answers not sent: the asker had gone (gave up waiting), or does not read them
        self.rejected = 0
        self.restarts = 0  # times the serving loop died and was restarted on the same address
        self.failed: BaseException | None = None  # set when it could not be restarted: nobody answers

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind and serve; `OSError` (with the errno, e.g. EADDRINUSE) if the address cannot be bound."""
        try:
            self._bind(host, port)
        except zmq.ZMQError as exc:
            raise OSError(exc.errno, f"cannot serve handshakes on {host}:{port}: {exc.strerror}") from exc
        self._task = asyncio.get_running_loop().create_task(self._supervise(), name=f"handshake-server:{self.port}")
        return self.host, self.port

    def _bind(self, host: str, port: int) -> None:
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an answer to an asker that has gone raises: its session is revoked
        try:
            for_host(sock, host)
            if port:
                sock.bind(endpoint(host, port))
            else:
                port = sock.bind_to_random_port(endpoint(host))
        except zmq.ZMQError:
            sock.close(0)
            raise
        self._socket, self.host, self.port = sock, bare_host(host), port

    async def _supervise(self) -> None:
        """Keep serving: if the loop dies (a bug, a broken socket), rebind the same address and go on.

        After `_MAX_RESTARTS` failures in a row the server gives up loudly (`failed` is set, the
        address cleared) rather than keep advertising an address nobody answers.
        """
        failures = 0
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self._serve()
                return
            except (Exception, asyncio.CancelledError) as exc:
                current = asyncio.current_task()
                if isinstance(exc, asyncio.CancelledError) and (current is None or current.cancelling()):
                    raise  # close() (or the loop's shutdown) asked for it
                failures = 1 if loop.time() - started > 1.0 else failures + 1  # a long good run resets the count
                self.restarts += 1
                log.error("handshake server on %s:%d died (%d in a row): %r", self.host, self.port, failures, exc)
                if self._socket is not None:
                    self._socket.close(0)
                    self._socket = None
                error: BaseException = exc
            while failures <= _MAX_RESTARTS:
                await asyncio.sleep(0.01 * 2**failures)
                try:
                    self._bind(self.host, self.port)
                    break
                except zmq.ZMQError as bind_error:
                    failures += 1
                    error = bind_error
            if failures > _MAX_RESTARTS:
                self.failed = error
                log.error("handshake server on %s:%d could not be restarted: no longer serving", self.host, self.port)
                self.host, self.port = "", 0
                if self._on_failed is not None:
                    self._on_failed()
                return

    async def _serve(self) -> None:
        sock = self._socket
        assert sock is not None
        loop = asyncio.get_running_loop()
        yielded = loop.time()
        while True:
            if loop.time() - yielded > _SERVE_SLICE_S:
                # A receive with messages queued returns without suspending: a sender that keeps
                # the socket busy would otherwise hold the loop (every deadline, every completion).
                await asyncio.sleep(0)
                yielded = loop.time()
            frames = await sock.recv_multipart(copy=True)
            try:
                reply = self._answer(frames)
            except Exception as exc:  # one message must not restart the server (and drop the handshakes under way)
                self._unanswerable.record(exc)  # (logged once per interval: a flood must not flood the log)
                self.rejected += 1
                continue
            if reply is None:
                continue
            identity, delimiter, payload, session = reply
            try:  # (NOBLOCK: done at once, never waits on an asker that does not read its answers)
                await sock.send_multipart([identity, *delimiter, payload], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # the asker went away (gave up waiting) or does not read its answers
                log.debug("handshake reply not sent: %s", exc)
                self.undelivered += 1
                if session:
                    self.guard.revoke(session)
            else:  # (queued for the asker: one that closes its socket this very moment is not seen here)
                if session:
                    self.guard.delivered(session)
                    self.served += 1

    def _answer(self, frames: list[bytes]) -> _Answer | None:
        if len(frames) < 2:
            return None  # no routing identity: cannot answer
        identity, rest = frames[0], frames[1:]
        delimiter = [b""] if len(rest) > 1 and rest[0] == b"" else []  # REQ clients add one
        body = rest[len(delimiter) :]
        if len(body) != 1:
            self.rejected += 1
            return _Answer(identity, delimiter, _error("bad_request", f"expected 1 payload frame, got {len(body)}"))
        payload = body[0]
        if len(payload) > self._max_request_bytes:
            self.rejected += 1
            return _Answer(
                identity,
                delimiter,
                _error("too_large", f"request of {len(payload)} bytes exceeds {self._max_request_bytes}"),
            )
        try:
            request = messages.decode_request(payload)
        except msgspec.DecodeError as exc:
            self.rejected += 1
            return _Answer(identity, delimiter, _error("bad_request", f"undecodable request: {exc}"))
        if isinstance(request, messages.NotifyMessage):
            self._take_notification(request)
            return None  # notifications are never answered
        if request.version != messages.PROTOCOL_VERSION:
            self.rejected += 1
            return _Answer(
                identity,
                delimiter,
                _error("version", f"protocol version {request.version} unsupported (want {messages.PROTOCOL_VERSION})"),
            )
        if self._secret is not None:
            if not request.mac:
                return _Answer(identity, delimiter, messages.encode(messages.AuthChallenge(nonce=self._challenge())))
            if not self._verify(request):
                self.rejected += 1
                self.auth_failures += 1
                self._log_refusal("bad or stale credentials", request.engine_id, self.auth_failures,
                                  what=f"refused a {_kind(request)}")  # fmt: skip
                return _Answer(identity, delimiter, _error("auth_failed", "authentication failed"))
        try:
            if isinstance(request, messages.CallRequest):
                if self._on_call is None:
                    raise Refusal("no_handler", "this engine answers no calls")
                return _Answer(identity, delimiter, self._signed(request, messages.encode(self._on_call(request))))
            reply = self._reply_for(request)
            if self._on_request is not None:  # answered: the asker's first transfer follows
                self._on_request()
        except Refusal as refusal:
            self.rejected += 1
            return _Answer(identity, delimiter, _error(refusal.code, str(refusal)))
        except (Exception, asyncio.CancelledError) as exc:  # never let one request take the server down
            # (nothing here awaits: a CancelledError is a handler's, e.g. `.result()` of a cancelled task)
            log.exception("answering a %s failed", type(request).__name__)
            self.rejected += 1
            return _Answer(identity, delimiter, _error("internal", type(exc).__name__))
        session = self.guard.issue(request.engine_id)
        answer = messages.encode(msgspec.structs.replace(reply, notify_session=session))
        try:
            signed = self._signed(request, answer)
        except Refusal as refusal:
            self.guard.revoke(session)
            self.rejected += 1
            return _Answer(identity, delimiter, _error(refusal.code, str(refusal)))
        return _Answer(identity, delimiter, signed, session)

    def _signed(self, request: messages.Authenticated, payload: bytes) -> bytes:
        """`payload`, wrapped in a `SignedReply` for an authenticated asker that wants one; `Refusal` if the
        asker said it takes no frame that large."""
        if self._secret is not None and request.signed_reply:
            mac = messages.reply_mac(self._secret, request.mac, payload)
            payload = messages.encode(messages.SignedReply(payload=payload, mac=mac))
        if 0 < request.max_reply_bytes < len(payload):
            raise Refusal("reply_too_large", f"the reply is {len(payload)} bytes, over the asker's max_frame_bytes "
                                             f"({request.max_reply_bytes}): raise it there")  # fmt: skip
        return payload

    def _take_notification(self, note: messages.NotifyMessage) -> None:
        if self._on_notify is None:
            self.rejected += 1
            return
        reason = self.guard.check(note)
        if reason == UNKNOWN_SESSION and note.busy_ms > 0:
            # A busy hint in a session this server never issued or no longer holds: a peer that restarted (or
            # whose session went) hinting until it handshakes again. It carries nothing: counted, not alarmed.
            self.notifications_refused[reason] += 1
            return
        if reason is not None:
            # Session, number and MAC are a notification's credentials: a refusal is an auth failure.
            self.rejected += 1
            self.auth_failures += 1
            self.notifications_refused[reason] += 1
            self._log_refusal(reason, note.engine_id, self.notifications_refused[reason])
            return
        if note.busy_ms > 0:
            if self._on_busy_hint is not None:  # a sender cannot keep us brisk longer than this at once
                self._on_busy_hint(min(note.busy_ms, _MAX_BUSY_HINT_MS) / 1000)
            return
        self.notifications += 1
        self._on_notify(note.engine_id, note.message)

    def _log_refusal(self, reason: str, engine_id: str, count: int,
                     what: str = "dropped a notification claiming to come") -> None:  # fmt: skip
        """At most one line per reason and second: whoever reaches the port chooses how many refusals there are."""
        now = time.monotonic()
        if now - self._refusal_logged_at.get(reason, -math.inf) < _REFUSAL_LOG_INTERVAL_S:
            return
        self._refusal_logged_at[reason] = now
        log.warning("%s from engine %r: %s (%d refused for this reason so far)", what, engine_id[:64], reason, count)

    def _challenge(self) -> bytes:
        now = time.monotonic()
        while self._nonces and (len(self._nonces) >= _MAX_NONCES or next(iter(self._nonces.values())) < now):
            self._nonces.popitem(last=False)
        nonce = secrets.token_bytes(16)
        self._nonces[nonce] = now + _NONCE_TTL_S
        return nonce

    def _verify(self, request: messages.Authenticated) -> bool:
        expires = self._nonces.pop(request.nonce, None)  # single use: a replay finds nothing
        if expires is None or expires < time.monotonic():
            return False
        assert self._secret is not None
        return hmac.compare_digest(request.mac, messages.request_mac(self._secret, request))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None


async def fetch_metadata(
    context: zmq.asyncio.Context,
    host: str,
    port: int,
    request: messages.MetadataRequest,
    *,
    timeout: float,
    max_frame_bytes: int,
    secret: bytes | None = None,
) -> messages.MetadataReply:
    """Ask the engine at host:port for its metadata (answering its challenge with `secret`).

    Raises `HandshakeTimeout` when no reply comes within `timeout`, `IncompatiblePeerError` when
    the server refuses us as a reader it could not serve (UCX/TCP segments), `HandshakeRejected`
    for another error reply or a challenge we cannot answer, and `ProtocolError` for an
    undecodable reply.
    """
    reply = await _ask(context, host, port, request, messages.MetadataReply, timeout, max_frame_bytes, secret)
    if reply.version != messages.PROTOCOL_VERSION:
        raise ProtocolError(f"{host}:{port} speaks protocol version {reply.version}", address=f"{host}:{port}")
    return reply


async def call_peer(
    context: zmq.asyncio.Context,
    host: str,
    port: int,
    request: messages.CallRequest,
    *,
    timeout: float,
    max_frame_bytes: int,
    secret: bytes | None = None,
) -> messages.CallReply:
    """Send one call to the engine at host:port and return its reply; raises as `fetch_metadata`."""
    return await _ask(context, host, port, request, messages.CallReply, timeout, max_frame_bytes, secret)


async def _ask(
    context: zmq.asyncio.Context,
    host: str,
    port: int,
    request: messages.Authenticated,
    expect: type[_Reply],
    timeout: float,
    max_frame_bytes: int,
    secret: bytes | None,
) -> _Reply:
    """One exchange on a fresh DEALER, answering an authentication challenge once, bounded by `timeout`.

    Raises `ProtocolError` unless the answer is an `expect`.
    """
    address = f"{host}:{port}"
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    request = msgspec.structs.replace(request, max_reply_bytes=max_frame_bytes)
    if secret is not None:  # (the server's nonce is its own: a recorded challenge could be sent again)
        request = msgspec.structs.replace(request, signed_reply=True, client_nonce=secrets.token_bytes(16))
    signed: messages.Authenticated | None = None
    reply: messages.Reply
    try:
        for_host(sock, host)
        try:
            sock.connect(endpoint(host, port))
        except zmq.ZMQError as exc:  # (a host with a space, a port out of range: from a caller or a record)
            raise HandshakeRejected(f"cannot dial {address}: {exc}", address=address) from None
        try:
            async with asyncio.timeout(timeout):
                reply = await _exchange(sock, request, address)
                if isinstance(reply, messages.AuthChallenge):
                    if secret is None:
                        raise HandshakeRejected(
                            f"{address} requires authentication: configure the shared secret", address=address
                        )
                    signed = msgspec.structs.replace(request, nonce=reply.nonce)
                    signed = msgspec.structs.replace(signed, mac=messages.request_mac(secret, signed))
                    reply = await _exchange(sock, signed, address)
        except TimeoutError:
            raise HandshakeTimeout(
                f"no {_kind(request)} reply from {address} within {timeout}s", address=address
            ) from None
    finally:
        sock.close(0)
    if isinstance(reply, messages.AuthChallenge):
        raise ProtocolError(f"{address} challenged twice", address=address)
    if secret is not None and not isinstance(reply, messages.ErrorReply):
        reply = _proven(reply, secret, signed, request, address)
    elif isinstance(reply, messages.SignedReply):
        raise ProtocolError(f"{address} signed a reply to a request we did not sign", address=address)
    if isinstance(reply, messages.ErrorReply) and reply.code == "incompatible_peer":
        raise IncompatiblePeerError(f"{address} refused the {_kind(request)}: {reply.message}", address=address)
    if isinstance(reply, messages.ErrorReply) and reply.code == "engine_id_mismatch":
        raise EngineIdMismatch(f"{address}: {reply.message}", address=address)
    if isinstance(reply, messages.ErrorReply):
        raise HandshakeRejected(f"{address} refused the {_kind(request)} ({reply.code}): {reply.message}",
                                address=address, code=reply.code)  # fmt: skip
    if not isinstance(reply, expect):
        raise ProtocolError(f"{address} answered a {_kind(request)} with a {type(reply).__name__}", address=address)
    return reply


def _proven(reply: messages.Reply, secret: bytes, signed: messages.Authenticated | None,
            request: messages.Authenticated, address: str) -> messages.Reply:  # fmt: skip
    """The reply inside a `SignedReply` whose MAC proves the server holds `secret` and answers `signed`;
    `HandshakeRejected` otherwise: an engine with our secret always challenges, then signs its answer
    (one at a dead engine's address answering in its place would be handed our transfers)."""
    kind = _kind(request)
    if signed is None:
        raise HandshakeRejected(f"{address} answered the {kind} without asking for our proof of the shared secret: "
                                "it does not hold it", address=address)  # fmt: skip
    if not isinstance(reply, messages.SignedReply):
        raise HandshakeRejected(f"{address} answered the {kind} unsigned: it does not prove the shared secret",
                                address=address)  # fmt: skip
    if not hmac.compare_digest(reply.mac, messages.reply_mac(secret, signed.mac, reply.payload)):
        raise HandshakeRejected(f"{address} answered the {kind} with a reply not signed with the shared secret",
                                address=address)  # fmt: skip
    try:
        inner = messages.decode_reply(reply.payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable {kind} reply from {address}: {exc}", address=address) from None
    if isinstance(inner, messages.SignedReply | messages.AuthChallenge):
        raise ProtocolError(f"{address} signed a {type(inner).__name__}", address=address)
    return inner


def _kind(request: messages.Authenticated) -> str:
    return "call" if isinstance(request, messages.CallRequest) else "handshake"


async def _exchange(sock: zmq.asyncio.Socket, request: messages.Authenticated, address: str) -> messages.Reply:
    await sock.send(messages.encode(request))
    frames = await sock.recv_multipart()
    if len(frames) != 1:
        raise ProtocolError(f"{address} replied with {len(frames)} frames, expected 1", address=address)
    try:
        return messages.decode_reply(frames[0])
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable {_kind(request)} reply from {address}: {exc}", address=address) from None
