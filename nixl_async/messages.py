"""Side-channel messages: tagged msgspec Structs, one shared encoder and typed decoders.

A handshake is one request and one reply. The request says who asks and (optionally) whom it
expects; the reply carries what the asker needs to reach our memory: NIXL agent metadata, our
layouts and the compatibility hash, and a fresh notify session for side-channel notifications.
Any request that cannot be decoded gets an `ErrorReply`. New fields go last, with defaults, so
older peers still decode newer messages.

A `CallRequest` asks the handler a peer registered for a topic and gets one `CallReply`
(adapters use it for small acknowledged exchanges, such as lease renewals); it is
authenticated exactly like a `MetadataRequest`.

A `NotifyMessage` names the session the receiver issued to its sender and a sequence number
that grows with every notification in that session, so the receiver refuses a replayed one
(see `_notify_guard.py`); with a shared secret its HMAC covers session, sequence number,
sender and message.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping
from typing import Any, cast

import msgspec

from .config import UCX_TCP_DEFAULT_SEGMENT
from .layout import BlockLayout

__all__ = [
    "PROTOCOL_VERSION",
    "SEGMENTS_RECORD_VERSION",
    "AuthChallenge",
    "CallReply",
    "CallRequest",
    "ErrorReply",
    "MetadataReply",
    "MetadataRequest",
    "NotifyMessage",
    "PublishedEngine",
    "Reply",
    "Request",
    "SignedReply",
    "compat_hash",
    "decode_published",
    "decode_reply",
    "decode_request",
    "encode",
    "notify_mac",
    "reply_mac",
    "request_mac",
]

PROTOCOL_VERSION = 1
# An etcd record of an engine that sends UCX/TCP segments larger than UCX's default carries this
# version: engines from before `tcp_segment_bytes`, which adopt records without asking and know
# only version 1, refuse it instead of reading those segments into smaller buffers.
SEGMENTS_RECORD_VERSION = 2


class MetadataRequest(msgspec.Struct, tag="metadata_request", frozen=True, kw_only=True):
    """Asks a peer for what is needed to transfer with it."""

    version: int = PROTOCOL_VERSION
    engine_id: str = ""
    expected_engine_id: str | None = None
    # Shared-secret authentication: the server's single-use nonce and our HMAC over it.
    nonce: bytes = b""
    mac: bytes = b""
    # The largest UCX/TCP segment the asker receives (absent: an older engine, UCX's default).
    tcp_segment_bytes: int = UCX_TCP_DEFAULT_SEGMENT
    # With a shared secret: answer with a `SignedReply` (the server proves the secret too), bound
    # through our MAC to `client_nonce`, fresh per request (a recorded exchange cannot be replayed).
    signed_reply: bool = False
    client_nonce: bytes = b""
    # The asker's frame limit (its `max_frame_bytes`; 0: not said): ZMQ drops a larger reply without a
    # word, and the asker would wait out its timeout, so the server answers with an error instead.
    max_reply_bytes: int = 0


class MetadataReply(msgspec.Struct, tag="metadata", frozen=True, kw_only=True):
    """Everything a reader needs to reach the replying engine's memory."""

    version: int
    engine_id: str
    agent_name: str
    agent_metadata: bytes
    compat_hash: str
    layouts: list[BlockLayout]
    extra: dict[str, str] = {}
    wall_clock: float = 0.0  # the server's time.time() when answering: readers estimate clock offsets
    # Issued by the server to the asking engine id for this handshake only: side-channel
    # notifications to this server must carry it (b"": an older server that issues none).
    notify_session: bytes = b""
    # The largest UCX/TCP segment the server sends a reader (absent: an older engine, UCX's default).
    tcp_segment_bytes: int = UCX_TCP_DEFAULT_SEGMENT
    # The largest request (side-channel notification, call) the server takes; a larger one is dropped
    # there unanswered, so senders refuse it first (0: an older engine that does not say).
    max_request_bytes: int = 0


class ErrorReply(msgspec.Struct, tag="error", frozen=True, kw_only=True):
    """The request was refused; `code` is machine-readable, `message` for humans."""

    code: str
    message: str


class AuthChallenge(msgspec.Struct, tag="auth_challenge", frozen=True, kw_only=True):
    """The server wants proof of the shared secret: ask again with an HMAC over this nonce."""

    nonce: bytes


class SignedReply(msgspec.Struct, tag="signed_reply", frozen=True, kw_only=True):
    """The answer to an authenticated request that asked for it (`signed_reply`): `payload` is the
    encoded reply, and `mac` (`reply_mac`) binds it to the secret and to that request's own MAC, so
    only a holder of the secret can make it, for that request alone. Without it the asker proves
    the secret to whoever answers at the address, and takes its word for the rest."""

    payload: bytes
    mac: bytes


class NotifyMessage(msgspec.Struct, tag="notify", frozen=True, kw_only=True):
    """A notification sent over the side channel instead of NIXL (never answered).

    Why: a NIXL notification is an active message, and UCX holds the sender's next operation
    to that peer until the receiver's worker is progressed; the side channel wakes the
    receiver's loop through its socket instead. `session` is the receiver's `notify_session`
    from our handshake and `seq` grows with every notification we send (the receiver accepts
    each number once, in order). With a shared secret, `mac` is `notify_mac` over all of them.

    With `busy_ms` > 0 it is no notification but a hint, never delivered: the sender has
    transfers with us in flight, so progress our UCX worker briskly that long (over TCP a peer's
    READ or WRITE moves only while the target's worker is progressed; idle, ours is progressed
    every 50 ms).
    """

    version: int = PROTOCOL_VERSION
    engine_id: str
    message: bytes
    mac: bytes = b""
    session: bytes = b""
    seq: int = 0
    busy_ms: int = 0


class CallRequest(msgspec.Struct, tag="call", frozen=True, kw_only=True):
    """Asks the handler the receiving engine registered for `topic`; answered by one `CallReply`."""

    version: int = PROTOCOL_VERSION
    engine_id: str = ""
    topic: str
    payload: bytes = b""
    nonce: bytes = b""
    mac: bytes = b""
    signed_reply: bool = False  # as `MetadataRequest.signed_reply`
    client_nonce: bytes = b""  # ... and `MetadataRequest.client_nonce`
    max_reply_bytes: int = 0  # ... and `MetadataRequest.max_reply_bytes`
    to_engine_id: str = ""  # the engine meant: another one at that address refuses before its handler runs


class CallReply(msgspec.Struct, tag="call_reply", frozen=True, kw_only=True):
    """The handler's answer; `engine_id` lets the caller check who answered."""

    engine_id: str
    payload: bytes


class PublishedEngine(msgspec.Struct, tag="published_engine", frozen=True, kw_only=True):
    """What an engine publishes in a discovery service (etcd) for peers to find it by engine id.

    `host` and `port` name its side channel, if it serves one. `metadata` is the reply a handshake
    would give (without a notify session: those are issued per asker), or None when the engine has a
    shared secret: its NIXL metadata (the keys to its memory) then stays behind the authenticated
    side channel, and readers handshake there.
    """

    version: int = PROTOCOL_VERSION
    engine_id: str
    compat_hash: str
    host: str = ""
    port: int = 0
    metadata: MetadataReply | None = None
    # Digest of the handshake reply (agent, its metadata, layouts, extra): a reader holding the
    # peer compares it with what it holds to notice a change without seeing the metadata.
    fingerprint: str = ""


Reply = MetadataReply | CallReply | ErrorReply | AuthChallenge | SignedReply
Request = MetadataRequest | CallRequest | NotifyMessage
Authenticated = MetadataRequest | CallRequest

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_published_decoder = msgspec.msgpack.Decoder(PublishedEngine)


def encode(message: Request | Reply | PublishedEngine) -> bytes:
    return _encoder.encode(message)


def _decoded(decoder: msgspec.msgpack.Decoder[Any], data: bytes) -> Any:
    """msgspec raises two kinds of bad input as they are, not as `DecodeError`: a string that is not
    UTF-8 (9 bytes are enough) and nesting ~1000 deep in an unknown field (~1 KiB). Callers catching
    `DecodeError` alone let them through: anyone who could reach the side channel stopped its server."""
    try:
        return decoder.decode(data)
    except (UnicodeDecodeError, RecursionError) as exc:
        raise msgspec.DecodeError(f"malformed message ({type(exc).__name__}: {exc})") from None


def decoder(of: Any) -> Callable[[bytes], Any]:
    """A msgpack decoder for type `of` whose every refusal of bad input is a `msgspec.DecodeError`."""
    raw = msgspec.msgpack.Decoder(of)
    return lambda data: _decoded(raw, data)


def decode_request(data: bytes) -> Request:
    """Decode a request; raises `msgspec.DecodeError` (incl. `ValidationError`) on bad input."""
    return cast(Request, _decoded(_request_decoder, data))


def decode_reply(data: bytes) -> Reply:
    """Decode a reply; raises `msgspec.DecodeError` (incl. `ValidationError`) on bad input."""
    return cast(Reply, _decoded(_reply_decoder, data))


def decode_published(data: bytes) -> PublishedEngine:
    """Decode a published record; raises `msgspec.DecodeError` on bad input."""
    return cast(PublishedEngine, _decoded(_published_decoder, data))


# Request fields added after authentication was: signed only when not at their default, so an older
# engine (which drops them when it re-encodes a request, or never sends them) computes the same MAC.
_LATER_FIELDS: dict[str, object] = {
    "tcp_segment_bytes": UCX_TCP_DEFAULT_SEGMENT,
    "signed_reply": False,
    "client_nonce": b"",
    "max_reply_bytes": 0,
    "to_engine_id": "",
}


def request_mac(secret: bytes, request: Authenticated) -> bytes:
    """HMAC-SHA256 binding the secret to the server's nonce and to the request's fields (and its kind)."""
    config = type(request).__struct_config__
    fields = msgspec.structs.asdict(msgspec.structs.replace(request, mac=b""))
    for name, default in _LATER_FIELDS.items():
        if name in fields and fields[name] == default:
            del fields[name]
    # the bytes of the struct's own encoding (tag first, fields in order), less the omitted fields
    signed = _encoder.encode({config.tag_field: config.tag, **fields})
    return hmac.new(secret, signed, hashlib.sha256).digest()


def reply_mac(secret: bytes, request_mac: bytes, payload: bytes) -> bytes:
    """HMAC-SHA256 of a `SignedReply`: the secret, the request it answers (by its MAC) and the reply's bytes."""
    return hmac.new(secret, b"nixl_async signed reply\0" + request_mac + payload, hashlib.sha256).digest()


def notify_mac(secret: bytes, session: bytes, seq: int, engine_id: str, message: bytes, busy_ms: int = 0) -> bytes:
    """HMAC-SHA256 of a side-channel notification's session, sequence number, sender and content.

    The session and sequence number are covered so a captured notification cannot be re-sent
    under another number, nor moved to another session or sender; a busy hint's duration is
    covered in place of the content, so neither can pass for the other.
    """
    signed = _encoder.encode(["busy", session, seq, engine_id, busy_ms] if busy_ms else
                             ["notify", session, seq, engine_id, message])  # fmt: skip
    return hmac.new(secret, signed, hashlib.sha256).digest()


def compat_hash(compat: Mapping[str, str]) -> str:
    """A stable digest of what must agree between two engines (order-insensitive)."""
    canonical = _encoder.encode([PROTOCOL_VERSION, sorted((str(k), str(v)) for k, v in compat.items())])
    return hashlib.sha256(canonical).hexdigest()[:32]
