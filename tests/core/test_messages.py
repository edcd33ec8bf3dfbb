"""The side-channel codec: round trips, refusals, schema evolution, compatibility hash."""

import msgspec
import pytest

from nixl_async import messages
from nixl_async.layout import BlockLayout, LayoutKind, MemType


def _reply(**over):
    layout = BlockLayout.from_regions("kv", [4096, 8192], num_blocks=4, block_len=1024, kind=LayoutKind.BLOCKS_FIRST_KV)
    fields = dict(
        version=1, engine_id="e", agent_name="e/1", agent_metadata=b"\x00md", compat_hash="h", layouts=[layout]
    )
    fields.update(over)
    return messages.MetadataReply(**fields)


def test_round_trips():
    request = messages.MetadataRequest(engine_id="me", expected_engine_id="you")
    assert messages.decode_request(messages.encode(request)) == request
    reply = _reply(extra={"tp_rank": "1"})
    assert messages.decode_reply(messages.encode(reply)) == reply
    error = messages.ErrorReply(code="x", message="y")
    assert messages.decode_reply(messages.encode(error)) == error


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        msgspec.msgpack.encode({"type": "nope"}),
        msgspec.msgpack.encode({"type": "metadata_request", "version": "one"}),
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode(_reply())[:-3],  # truncated
    ],
)
def test_bad_requests_raise_decode_errors(payload):
    with pytest.raises(msgspec.DecodeError):
        messages.decode_request(payload)


def test_reply_with_invalid_layout_is_refused_on_decode():
    raw = msgspec.to_builtins(_reply(), builtin_types=(bytes,))
    raw["layouts"][0]["num_blocks"] = 0
    with pytest.raises(msgspec.ValidationError, match="num_blocks"):
        messages.decode_reply(msgspec.msgpack.encode(raw))
    raw = msgspec.to_builtins(_reply(), builtin_types=(bytes,))
    raw["layouts"][0]["mem_type"] = "TAPE"
    with pytest.raises(msgspec.ValidationError):
        messages.decode_reply(msgspec.msgpack.encode(raw))


def test_older_reply_without_new_fields_still_decodes():
    raw = msgspec.to_builtins(_reply(), builtin_types=(bytes,))
    del raw["extra"]
    decoded = messages.decode_reply(msgspec.msgpack.encode(raw))
    assert decoded.extra == {} and decoded.layouts[0].mem_type is MemType.DRAM


def test_compat_hash_is_order_insensitive_and_sensitive_to_values():
    a = messages.compat_hash({"model": "m", "dtype": "bf16"})
    assert a == messages.compat_hash({"dtype": "bf16", "model": "m"})
    assert a != messages.compat_hash({"dtype": "fp16", "model": "m"})
    assert a != messages.compat_hash({})


def test_notify_session_fields_default_for_older_peers():
    raw = msgspec.to_builtins(_reply(), builtin_types=(bytes,))
    del raw["notify_session"]
    assert messages.decode_reply(msgspec.msgpack.encode(raw)).notify_session == b""  # an older server
    older = messages.decode_request(msgspec.msgpack.encode({"type": "notify", "engine_id": "e", "message": b"m"}))
    assert isinstance(older, messages.NotifyMessage) and (older.session, older.seq) == (b"", 0)
    note = messages.NotifyMessage(engine_id="e", message=b"m", session=b"s" * 16, seq=7)
    assert messages.decode_request(messages.encode(note)) == note


def test_notify_mac_covers_session_number_sender_and_message():
    secret = b"k" * 32
    base = messages.notify_mac(secret, b"s" * 16, 1, "e", b"m")
    others = [
        messages.notify_mac(secret, b"t" * 16, 1, "e", b"m"),
        messages.notify_mac(secret, b"s" * 16, 2, "e", b"m"),
        messages.notify_mac(secret, b"s" * 16, 1, "f", b"m"),
        messages.notify_mac(secret, b"s" * 16, 1, "e", b"n"),
        messages.notify_mac(b"j" * 32, b"s" * 16, 1, "e", b"m"),
    ]
    assert len({base, *others}) == 6


def test_a_busy_hint_is_signed_over_its_duration_and_never_passes_for_a_notification():
    secret, session = b"k" * 32, b"s" * 16
    hint = messages.notify_mac(secret, session, 1, "e", b"", busy_ms=1000)
    assert hint != messages.notify_mac(secret, session, 1, "e", b"", busy_ms=2000)
    assert hint != messages.notify_mac(secret, session, 1, "e", b"")  # the same, as a notification
    note = messages.NotifyMessage(engine_id="e", message=b"", mac=hint, session=session, seq=1, busy_ms=1000)
    assert messages.decode_request(messages.encode(note)) == note


class _RequestBeforeSegments(msgspec.Struct, tag="metadata_request", frozen=True, kw_only=True):
    """MetadataRequest as engines before `tcp_segment_bytes` encoded it (the field layout they signed)."""

    version: int = 1
    engine_id: str = ""
    expected_engine_id: str | None = None
    nonce: bytes = b""
    mac: bytes = b""


class _CallBeforeSignedReplies(msgspec.Struct, tag="call", frozen=True, kw_only=True):
    """CallRequest as engines before `signed_reply` encoded it."""

    version: int = 1
    engine_id: str = ""
    topic: str
    payload: bytes = b""
    nonce: bytes = b""
    mac: bytes = b""


def _older_engines_mac(secret: bytes, request: msgspec.Struct) -> bytes:
    import hashlib
    import hmac

    unsigned = msgspec.structs.replace(request, mac=b"")
    return hmac.new(secret, msgspec.msgpack.encode(unsigned), hashlib.sha256).digest()


def test_a_request_on_ucx_default_segments_signs_as_older_engines_sign():
    """Authenticated handshakes keep working across versions: an older engine re-encodes a request
    without the new field (or sends none), so the field is signed only when not at its default."""
    secret = b"s" * 16
    fields = dict(engine_id="decode/tp0", expected_engine_id="prefill/tp0", nonce=b"n" * 16)
    older = _older_engines_mac(secret, _RequestBeforeSegments(**fields))
    assert messages.request_mac(secret, messages.MetadataRequest(**fields)) == older
    assert messages.request_mac(secret, messages.MetadataRequest(**fields, tcp_segment_bytes=64 << 10)) == older
    larger = messages.request_mac(secret, messages.MetadataRequest(**fields, tcp_segment_bytes=512 << 10))
    assert larger != older, "a segment size other than UCX's is covered by the MAC"
    call = dict(engine_id="d", topic="t", payload=b"p", nonce=b"n" * 16)
    older_call = _older_engines_mac(secret, _CallBeforeSignedReplies(**call))
    assert messages.request_mac(secret, messages.CallRequest(**call)) == older_call
    # asking for a signed reply is covered (an older server, which drops the field, refuses it: it cannot sign)
    assert messages.request_mac(secret, messages.CallRequest(**call, signed_reply=True)) != older_call
    assert messages.request_mac(secret, messages.MetadataRequest(**fields, signed_reply=True)) != older


@pytest.mark.parametrize("payload", [b"\x81\xa4type\xa2\xff\xfe",  # a string that is not UTF-8
                                     b"\x82\xa4type\xb0metadata_request\xa1x" + b"\x91" * 1000 + b"\xc0"],  # deep
                         ids=["not_utf8", "deep"])  # fmt: skip
def test_input_msgspec_raises_oddly_on_is_a_decode_error(payload):
    """msgspec raises `UnicodeDecodeError` / `RecursionError` for these; every caller catches `DecodeError`."""
    for decode in (messages.decode_request, messages.decode_reply, messages.decode_published):
        with pytest.raises(msgspec.DecodeError):
            decode(payload)
