"""UCX/TCP send buffers: where the host allows it, an engine's sockets send from 8 MiB buffers.

Over TCP a READ's data leaves the target only while the target's UCX worker is progressed, so the
target's send buffer bounds what one progress call sends (README, Design). The real check reads
the sockets of two processes with ``ss`` after a READ between them.
"""

import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from nixl_async import EngineConfig, TransferEngine
from nixl_async.config import TCP_SEND_BUFFER_BYTES, SendBufferLimits, tcp_send_buffer_request

BLOCK = 1 << 20
BLOCKS = 16
STOCK = SendBufferLimits(wmem_max=212992, autotune_max=4 << 20)  # an untuned Linux host


@pytest.mark.parametrize(
    ("wanted", "limits", "asked"),
    [
        (8 << 20, SendBufferLimits(4 << 20, 4 << 20), 4 << 20),  # the kernel grants twice what is asked
        (8 << 20, STOCK, None),  # 416 KiB at most: autotuning reaches 4 MiB
        (8 << 20, SendBufferLimits(3 << 20, 4 << 20), None),  # not granted in full
        (8 << 20, SendBufferLimits(128 << 20, 64 << 20), None),  # a tuned host: autotuning goes further
        (16 << 20, SendBufferLimits(128 << 20, 6 << 20), 8 << 20),
        (None, SendBufferLimits(4 << 20, 4 << 20), None),
        (8 << 20, None, None),  # the host did not say
    ],
)
def test_a_send_buffer_is_asked_for_only_where_it_beats_autotuning(wanted, limits, asked):
    assert tcp_send_buffer_request(wanted, limits) == asked


def test_backend_settings_carry_the_send_buffer_unless_the_caller_or_environment_set_one():
    roomy = SendBufferLimits(4 << 20, 4 << 20)
    assert "TCP_SNDBUF=4194304" in EngineConfig().backend_settings("UCX", {}, roomy)["engine_config"].split(",")
    assert "SNDBUF" not in EngineConfig().backend_settings("UCX", {}, STOCK)["engine_config"]
    assert "SNDBUF" not in EngineConfig().backend_settings("UCX", {})["engine_config"]  # no limits given
    assert "SNDBUF" not in EngineConfig(tcp_send_buffer_bytes=None).backend_settings("UCX", {}, roomy)["engine_config"]
    assert "SNDBUF" not in EngineConfig().backend_settings("UCX", {"UCX_TCP_SNDBUF": "1m"}, roomy)["engine_config"]
    given = EngineConfig(backend_params={"engine_config": "TCP_SNDBUF=2m"}).backend_settings("UCX", {}, roomy)
    assert [item for item in given["engine_config"].split(",") if "SNDBUF" in item] == ["TCP_SNDBUF=2m"]
    assert EngineConfig().backend_settings("GDS", {}, roomy) == {}


@pytest.mark.parametrize("value", [True, 1000, 2 << 30, "8m", 1.5])
def test_config_refuses_send_buffers_it_cannot_ask_for(value):
    with pytest.raises(ValueError, match="tcp_send_buffer_bytes"):
        EngineConfig(tcp_send_buffer_bytes=value)


def _ucx_send_buffers(ours: int, theirs: int, zmq_ports: set[int]) -> tuple[list[int], list[int]]:
    """Send-buffer sizes of the UCX connections between two processes: (our sockets', theirs').

    Connections to or from `zmq_ports` (the peer's handshake and control sockets) are left out.
    """
    listing = subprocess.run(["ss", "-tmpnH"], capture_output=True, text=True, check=True).stdout
    sockets = []  # (pid, local, remote, send buffer)
    for entry in re.finditer(r"(\S+)\s+(\S+)\s+users:\(\(.*?pid=(\d+),.*?\n\s*skmem:\(.*?tb(\d+)", listing):
        local, remote, pid, tb = entry.groups()
        if {int(local.rpartition(":")[2]), int(remote.rpartition(":")[2])} & zmq_ports:
            continue
        sockets.append((int(pid), local, remote, int(tb)))
    their_ends = {local for pid, local, _, _ in sockets if pid == theirs}
    our_ends = {local for pid, local, _, _ in sockets if pid == ours}
    mine = [tb for pid, _, remote, tb in sockets if pid == ours and remote in their_ends]
    peer = [tb for pid, _, remote, tb in sockets if pid == theirs and remote in our_ends]
    return mine, peer


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs iproute2's ss")
@pytest.mark.skipif(
    tcp_send_buffer_request(TCP_SEND_BUFFER_BYTES, SendBufferLimits.of_host()) is None,
    reason="this host's net.core.wmem_max / tcp_wmem leave the send buffer to autotuning",
)
@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({}, TCP_SEND_BUFFER_BYTES),
        ({"tcp_send_buffer_bytes": None}, None),  # autotuned: below the host's ceiling
        # a caller's own UCX setting wins, and reaches UCX even written in lower case (UCX would refuse it)
        ({"tcp_send_buffer_bytes": None, "backend_params": {"engine_config": "tcp_sndbuf=3m"}}, 6 << 20),
    ],
)
async def test_engines_send_from_the_buffer_they_asked_for(nixl_peer_factory, monkeypatch, config, expected):
    monkeypatch.delenv("UCX_TCP_SNDBUF", raising=False)  # it would win over both engines' settings
    peer_proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, tcp=True)
    engine = TransferEngine(EngineConfig(**config))
    await engine.start()
    try:
        engine.register("kv", [np.zeros(BLOCKS * BLOCK, dtype=np.uint8)], block_len=BLOCK)
        peer = await engine.connect(*peer_proc.address)
        await engine.read(peer, list(range(BLOCKS)), list(range(BLOCKS)))
        mine, theirs = _ucx_send_buffers(os.getpid(), peer_proc.pid, {peer_proc.port, peer_proc.control_port})
    finally:
        await engine.close()
    assert mine and theirs, "no UCX connection between the two processes"
    assert set(theirs) == {TCP_SEND_BUFFER_BYTES}  # the peer's engine, on the default: every socket
    if expected is None:
        assert max(mine) <= SendBufferLimits.of_host().autotune_max  # autotuned
    else:
        assert set(mine) == {expected}
