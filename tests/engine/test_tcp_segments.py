"""UCX/TCP segments: engines move a READ's data in 512 KiB active messages, and a pair whose reader
would receive larger segments than it takes is refused at the handshake, by name.

A reader on UCX's 64 KiB segments reading from an agent that sends 512 KiB loses its link on the
first READ (NIXL_ERR_REMOTE_DISCONNECT, seen with NIXL 1.5.1 over ``UCX_TLS=tcp``); these tests
run over TCP in two processes, where that would happen.
"""

import asyncio
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq.asyncio

from nixl_async import EngineConfig, IncompatiblePeerError, TransferEngine, messages
from nixl_async.config import TCP_SEGMENT_BYTES, UCX_TCP_DEFAULT_SEGMENT, tcp_segment_in_use
from nixl_async.handshake import fetch_metadata
from nixl_async.layout import BlockLayout
from nixl_async.testing import TCP_TLS, PeerCommandError, TransferCommand, assert_no_live_handles, verify_blocks

BLOCK = 1 << 20
BLOCKS = 16
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _tcp(monkeypatch):
    monkeypatch.setenv("UCX_TLS", TCP_TLS)  # read when this process's first UCX worker is made


def _regions():
    return [np.zeros(BLOCKS * BLOCK, dtype=np.uint8)]


@pytest.mark.parametrize(
    ("configured", "environ", "expected"),
    [
        (TCP_SEGMENT_BYTES, {}, 512 << 10),
        (None, {}, UCX_TCP_DEFAULT_SEGMENT),
        (TCP_SEGMENT_BYTES, {"UCX_TCP_RX_SEG_SIZE": "1m"}, 1 << 20),
        (None, {"UCX_TCP_RX_SEG_SIZE": "256kb"}, 256 << 10),
        (TCP_SEGMENT_BYTES, {"UCX_TCP_RX_SEG_SIZE": "131072"}, 128 << 10),
        (TCP_SEGMENT_BYTES, {"UCX_TCP_RX_SEG_SIZE": " 2MB"}, 2 << 20),
        # the environment names a segment: the engine passes none, so UCX's default receive size holds
        (TCP_SEGMENT_BYTES, {"UCX_TCP_TX_SEG_SIZE": "16k"}, UCX_TCP_DEFAULT_SEGMENT),
    ],
)
def test_the_segment_in_use_follows_the_environment_then_the_config(configured, environ, expected):
    assert tcp_segment_in_use(configured, environ) == expected


@pytest.mark.parametrize("given", ["lots", "512q", "\u0665\u0661\u0662k", "", "-1k", "0", "0k"])
def test_an_unreadable_environment_segment_is_refused(given):
    """... naming the variable (before: "not a UCX size: 'auto'"; and "0" was taken as a 0-byte segment)."""
    with pytest.raises(ValueError, match=r"UCX_TCP_RX_SEG_SIZE=.*not a UCX size"):
        tcp_segment_in_use(TCP_SEGMENT_BYTES, {"UCX_TCP_RX_SEG_SIZE": given})


@pytest.mark.parametrize("value", [True, 1000, 128 << 20, "512k", 1.5])
def test_config_refuses_segments_it_cannot_use(value):
    with pytest.raises(ValueError, match="tcp_segment_bytes"):
        EngineConfig(tcp_segment_bytes=value)


def test_config_takes_numpys_whole_numbers_and_refuses_fields_of_the_wrong_kind():
    """An audit of session 39: numpy's ints were refused here alone; a list of backend parameters raised
    AttributeError and an int secret TypeError, neither naming the field."""
    import numpy as np

    config = EngineConfig(tcp_segment_bytes=np.int64(1 << 20), tcp_send_buffer_bytes=np.int32(16 << 20))
    assert type(config.tcp_segment_bytes) is int and config.tcp_segment_bytes == 1 << 20
    assert type(config.tcp_send_buffer_bytes) is int
    for fields, named in (({"backend_params": [("num_threads", "2")]}, "backend_params"),
                          ({"backend_params": {"num_threads": 2}}, "backend_params"),
                          ({"auth_secret": 12345678901234567890}, "auth_secret")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"EngineConfig\.{named}") as refused:
            EngineConfig(**fields)
        assert "1234567890" not in str(refused.value)  # the secret never shows
    assert EngineConfig(auth_secret=bytearray(b"s" * 16)).auth_secret == b"s" * 16


def test_config_refuses_segment_settings_that_would_bypass_the_handshake_check():
    with pytest.raises(ValueError, match=r"TCP_RX_SEG_SIZE.*tcp_segment_bytes"):
        EngineConfig(backend_params={"engine_config": "TCP_KEEPCNT=3,tcp_rx_seg_size=1m"})


def test_backend_settings_carry_the_segment_unless_the_environment_names_one():
    ours = EngineConfig().backend_settings("UCX", {})["engine_config"].split(",")
    assert f"TCP_RX_SEG_SIZE={512 << 10}" in ours and f"TCP_TX_SEG_SIZE={512 << 10}" in ours
    assert "SEG_SIZE" not in EngineConfig(tcp_segment_bytes=None).backend_settings("UCX", {})["engine_config"]
    # UCX would take the environment's receive size anyway, and a receive below our send segment is an error
    for key in ("UCX_TCP_RX_SEG_SIZE", "UCX_TCP_TX_SEG_SIZE"):
        assert "SEG_SIZE" not in EngineConfig().backend_settings("UCX", {key: "64k"})["engine_config"]


async def test_engines_read_whole_megabytes_over_tcp_in_their_segments(nixl_peer_factory):
    peer_proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, tcp=True, seed=5)
    engine = TransferEngine(EngineConfig())
    await engine.start()
    try:
        regions = _regions()
        engine.register("kv", regions, block_len=BLOCK)
        peer = await engine.connect(*peer_proc.address)
        order = list(range(BLOCKS))[::-1]
        await engine.read(peer, list(range(BLOCKS)), order)
        assert verify_blocks(regions, BLOCK, list(range(BLOCKS)), order, seed=5) == []
    finally:
        await engine.close()
    assert_no_live_handles(engine)


async def test_a_reader_on_smaller_segments_is_refused_at_the_handshake(nixl_peer_factory):
    peer_proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, tcp=True)
    engine = TransferEngine(EngineConfig(tcp_segment_bytes=None))
    await engine.start()
    try:
        engine.register("kv", _regions(), block_len=BLOCK)
        with pytest.raises(IncompatiblePeerError, match=r"at most 65536 bytes .* up to 524288.*tcp_segment_bytes"):
            await engine.connect(*peer_proc.address)
        assert not engine.peers
    finally:
        await engine.close()
    assert_no_live_handles(engine)


async def test_a_segment_set_in_the_environment_is_announced(nixl_peer_factory):
    env = {"UCX_TCP_RX_SEG_SIZE": "1m", "UCX_TCP_TX_SEG_SIZE": "1m"}
    peer_proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, tcp=True, env=env)
    engine = TransferEngine(EngineConfig())
    await engine.start()
    try:
        engine.register("kv", _regions(), block_len=BLOCK)
        with pytest.raises(IncompatiblePeerError, match=r"at most 524288 bytes .* up to 1048576"):
            await engine.connect(*peer_proc.address)
    finally:
        await engine.close()


async def test_larger_segments_read_from_a_peer_on_ucx_defaults_but_not_the_other_way(nixl_peer_factory):
    peer_proc = nixl_peer_factory(
        num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, tcp=True, seed=9, tcp_segment_bytes=None
    )
    engine = TransferEngine(EngineConfig())
    await engine.start()
    try:
        regions = _regions()
        engine.register("kv", regions, block_len=BLOCK)
        host, port = await engine.serve("127.0.0.1", 0)
        peer = await engine.connect(*peer_proc.address)
        await engine.read(peer, list(range(BLOCKS)), list(range(BLOCKS)))
        assert verify_blocks(regions, BLOCK, list(range(BLOCKS)), list(range(BLOCKS)), seed=9) == []
        # the peer, receiving 64 KiB at most, could not READ what we send in 512 KiB: its handshake is refused
        read_back = TransferCommand(op="READ", host=host, port=port, local_blocks=[0], remote_blocks=[0])
        with pytest.raises(PeerCommandError, match="IncompatiblePeerError"):
            await peer_proc.request(read_back)
    finally:
        await engine.close()
    assert_no_live_handles(engine)


def _raw_read_state(address: tuple[str, int], ucx_params: dict[str, str]) -> str:
    """NIXL driven directly (the benchmarks' raw reader: no engine, no check of the reply's segment):
    READ every block, return the end state and whether the data is the peer's pattern (seed 5)."""
    from nixl_async_benchmarks.common import RawReader

    region = _regions()[0]
    local = BlockLayout.from_regions("kv", [region.ctypes.data], num_blocks=BLOCKS, block_len=BLOCK)
    raw = RawReader(f"raw-{time.time_ns():x}", local, address, progress_thread=False, ucx_params=ucx_params)
    handle, state = raw.post(np.arange(BLOCKS), np.arange(BLOCKS))
    deadline = time.monotonic() + 10
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
        state = raw.state(handle)
    intact = verify_blocks([region], BLOCK, list(range(BLOCKS)), list(range(BLOCKS)), seed=5) == []
    return f"{state} {'intact' if intact else 'wrong'}"


async def test_ucx_takes_the_segment_and_a_reader_on_its_default_cannot_read(nixl_peer_factory):
    """What the handshake check guards against, with NIXL alone: the engine's 512 KiB segments reach
    UCX, and a raw reader on UCX's 64 KiB cannot READ from it. It lost the link in one experiment
    and corrupted its heap in another (UCX received 512 KiB messages into 64 KiB buffers; "free():
    invalid next size"), so it runs in a child process. A raw reader on the same segments reads."""
    peer_proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, tcp=True, seed=5)
    asking = messages.MetadataRequest(engine_id="raw-reader", tcp_segment_bytes=TCP_SEGMENT_BYTES)
    reply = await fetch_metadata(zmq.asyncio.Context.instance(), *peer_proc.address, asking, timeout=5,
                                 max_frame_bytes=4 << 20)  # fmt: skip
    assert reply.tcp_segment_bytes == TCP_SEGMENT_BYTES
    same = EngineConfig(link_timeout_s=None, cuda_ipc_get=False).backend_settings("UCX", {})
    outcomes = []
    for params in (same, {}):
        child = (
            "from tests.engine.test_tcp_segments import _raw_read_state; "
            f"print('STATE', _raw_read_state({tuple(peer_proc.address)!r}, {params!r}), flush=True)"
        )
        done = await asyncio.create_subprocess_exec(
            sys.executable, "-c", child, env={**os.environ, "UCX_TLS": TCP_TLS}, cwd=REPO,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(done.communicate(), 60)
        states = [
            line.split(maxsplit=1)[1] for line in out.decode(errors="replace").splitlines() if line.startswith("STATE")
        ]
        outcomes.append((done.returncode, states))
    assert outcomes[0] == (0, ["DONE intact"]), outcomes[0]
    assert "DONE intact" not in outcomes[1][1], (
        f"a reader on UCX's 64 KiB segments read from 512 KiB ones: {outcomes[1]}"
    )
