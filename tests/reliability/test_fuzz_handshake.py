"""Fuzz the handshake listener of a peer process with 10 k malformed messages (hypothesis)."""

import msgspec
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nixl_async import messages
from nixl_async.config import TCP_SEGMENT_BYTES
from nixl_async.testing import Stats

MESSAGES = 10_000
# {"type": "metadata_request", "x": ...}: msgspec skips an unknown field's value, recursing into it
_UNKNOWN_FIELD = b"\x82" + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("metadata_request") + b"\xa1x"
POISON = {
    "not_utf8": b"\x81\xa4type\xa2\xff\xfe",  # 9 bytes
    "deep": _UNKNOWN_FIELD + b"\x91" * 1000 + b"\xc0",  # ~1 KiB
}

json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
valid = st.builds(
    messages.MetadataRequest, engine_id=st.text(max_size=30), expected_engine_id=st.none() | st.text(max_size=10)
).map(messages.encode)
answerable = st.builds(
    messages.MetadataRequest, engine_id=st.text(max_size=30), tcp_segment_bytes=st.integers(TCP_SEGMENT_BYTES, 2**40)
).map(messages.encode)
payloads = st.one_of(
    answerable,  # well-formed, from a reader on the peer's segments: answered with the metadata
    st.binary(max_size=256),  # random bytes
    st.tuples(valid, st.integers(0, 40)).map(lambda t: t[0][: max(0, len(t[0]) - 1 - t[1])]),  # truncated msgpack
    json_like.map(msgspec.msgpack.encode),  # wrong schema
    st.fixed_dictionaries(
        {"type": st.just("metadata_request")},
        optional={"version": json_like, "engine_id": json_like, "tcp_segment_bytes": json_like},
    ).map(msgspec.msgpack.encode),  # right tag, wrong fields
    st.integers(64 << 10, 1 << 20).map(lambda n: b"\x91" * n),  # oversized request (below ZMQ's frame limit)
    st.binary(min_size=1, max_size=31).map(lambda b: b"\x81\xa4type" + bytes([0xA0 | len(b)]) + b),  # str, not UTF-8
    st.integers(900, 20_000).map(lambda n: _UNKNOWN_FIELD + b"\x91" * n + b"\xc0"),  # nested deep, within the size
)
frames = st.one_of(payloads.map(lambda p: [p]), st.lists(payloads, min_size=2, max_size=3))  # some with extra frames


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_listener_answers_every_malformed_message(nixl_peer):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://{nixl_peer.host}:{nixl_peer.port}")
    counts = {"sent": 0, "errors": 0, "metadata": 0}
    rss = []

    relaxed = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example]

    @settings(max_examples=MESSAGES, deadline=None, database=None, suppress_health_check=relaxed)
    @given(frames)
    def one(parts: list[bytes]) -> None:
        sock.send_multipart(parts)
        *envelope, last = sock.recv_multipart()  # a leading empty frame is a REQ delimiter, echoed back
        assert envelope in ([], [b""])
        reply = messages.decode_reply(last)  # a well-formed reply, every time
        counts["sent"] += 1
        if counts["sent"] in (500, MESSAGES):
            rss.append(_rss_kib(nixl_peer.pid))
        body = parts[1:] if len(parts) > 1 and parts[0] == b"" else parts  # REQ-style envelope
        try:
            request = messages.decode_request(body[0]) if len(body) == 1 and len(body[0]) <= 64 << 10 else None
        except msgspec.DecodeError:
            request = None
        # a well-formed request from a reader that takes the peer's TCP segments gets the metadata
        valid_request = (
            isinstance(request, messages.MetadataRequest)
            and request.version == 1
            and request.tcp_segment_bytes >= TCP_SEGMENT_BYTES
        )
        if valid_request:
            assert isinstance(reply, messages.MetadataReply)
            counts["metadata"] += 1
        else:
            assert isinstance(reply, messages.ErrorReply) and reply.code and reply.message
            counts["errors"] += 1

    try:
        one()
    finally:
        ctx.destroy(0)
    assert counts["sent"] >= MESSAGES and counts["errors"] > MESSAGES // 2 and counts["metadata"] > 0
    # still serving, every message accounted for, and memory bounded
    counters = nixl_peer.request_sync(Stats())["counters"]
    assert counters["handshakes_served"] == counts["metadata"] and counters["handshakes_rejected"] == counts["errors"]
    assert rss[-1] - rss[0] < 32 * 1024, f"listener RSS grew {rss[-1] - rss[0]} KiB over {MESSAGES} messages"


def test_messages_msgspec_fails_on_oddly_are_answered_and_never_restart_the_listener(nixl_peer):
    """A string that is not UTF-8, or nesting ~1000 deep: msgspec raises `UnicodeDecodeError` and
    `RecursionError` for them, not `DecodeError`. Before, each one restarted the listener (dropping the
    handshakes under way) and six in a row stopped it for good: anyone who could reach the port, secret
    or not, could end an engine's handshakes, calls and side-channel notifications."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(f"tcp://{nixl_peer.host}:{nixl_peer.port}")
    try:
        for _ in range(8):
            for payload in POISON.values():
                sock.send(payload)
                reply = messages.decode_reply(sock.recv())
                assert isinstance(reply, messages.ErrorReply) and reply.code == "bad_request", reply
        sock.send(messages.encode(messages.MetadataRequest(engine_id="after", tcp_segment_bytes=TCP_SEGMENT_BYTES)))
        assert isinstance(messages.decode_reply(sock.recv()), messages.MetadataReply)
    finally:
        ctx.destroy(0)
    assert nixl_peer.request_sync(Stats())["counters"]["handshake_server_restarts"] == 0


def test_frames_over_the_zmq_limit_drop_only_that_sender(nixl_peer):
    ctx = zmq.Context()
    try:
        abuser = ctx.socket(zmq.DEALER)
        abuser.connect(f"tcp://{nixl_peer.host}:{nixl_peer.port}")
        abuser.send(b"\x00" * (5 << 20))  # over max_frame_bytes (4 MiB): ZMQ drops the connection
        honest = ctx.socket(zmq.DEALER)
        honest.setsockopt(zmq.RCVTIMEO, 5000)
        honest.connect(f"tcp://{nixl_peer.host}:{nixl_peer.port}")
        honest.send(messages.encode(messages.MetadataRequest(tcp_segment_bytes=TCP_SEGMENT_BYTES, engine_id="honest")))
        assert isinstance(messages.decode_reply(honest.recv()), messages.MetadataReply)
    finally:
        ctx.destroy(0)
