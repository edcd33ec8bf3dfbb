"""The pytest plugin (`nixl_async.testing`), tested the way users get it: through pytester."""

pytest_plugins = ["pytester"]

USER_TESTS = """
import asyncio
import numpy as np
import pytest
from nixl_async import TransferFailed, TransferFenced, TransferTimeout
from nixl_async.testing import verify_blocks

async def test_read_from_a_peer_process(nixl_engine, nixl_peer):
    regions = [np.zeros(64 * 4096, np.uint8) for _ in range(2)]
    nixl_engine.register("kv", regions, block_len=4096)
    peer = await nixl_engine.connect(*nixl_peer.address)
    await nixl_engine.read(peer, [0, 1], [5, 6])
    assert verify_blocks(regions, 4096, [0, 1], [5, 6], seed=nixl_peer.spec.seed) == []

async def test_fault_knobs(nixl_engine, nixl_peer_factory):
    peer_proc = nixl_peer_factory(num_regions=1, num_blocks=16, block_len=1 << 20, tcp=True, seed=9)
    nixl_engine.register("kv", [np.zeros(16 << 20, np.uint8)], block_len=1 << 20)
    peer = await nixl_engine.connect(*peer_proc.address)
    await nixl_engine.read(peer, [0], [0])
    peer_proc.pause()
    # A paused peer never finishes the slices in flight: past the grace the memory is fenced.
    with pytest.raises((TransferTimeout, TransferFailed, TransferFenced)):
        await nixl_engine.read(peer, range(16), range(16), timeout=0.5)
    peer_proc.resume()
    await peer_proc.akill()
    assert peer_proc.proc.poll() is not None
"""


def test_fixtures_work_in_a_users_suite(pytester):
    pytester.makepyfile(test_user=USER_TESTS)
    result = pytester.runpytest_subprocess("-o", "asyncio_mode=auto", "-q")
    result.assert_outcomes(passed=2)


def test_leaked_handles_fail_the_test(pytester):
    pytester.makepyfile(
        test_leak="""
async def test_leaks(nixl_engine):
    nixl_engine._agent.live["xfers"] += 1  # what a leaked NIXL handle looks like to the counter
"""
    )
    result = pytester.runpytest_subprocess("-o", "asyncio_mode=auto", "-q")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*NIXL handles still live after close*xfers*"])


def test_engine_config_marker(pytester):
    pytester.makepyfile(
        test_marker="""
import pytest

@pytest.mark.nixl_engine_config(max_inflight_transfers=3, engine_id="custom")
async def test_config(nixl_engine):
    assert nixl_engine.config.max_inflight_transfers == 3
    assert nixl_engine.engine_id == "custom"
    assert nixl_engine.address is not None
"""
    )
    result = pytester.runpytest_subprocess("-o", "asyncio_mode=auto", "-q", "--strict-markers")
    result.assert_outcomes(passed=1)


def test_a_test_failing_with_its_peer_paused_mid_read_reports_only_its_own_failure(pytester):
    """The engine fixture closes after the peer factory when a test names the factory first: against a
    peer still stopped, the read stayed in NIXL and the test also got a leak error (and the agent stayed)."""
    pytester.makepyfile(
        test_paused="""
import asyncio

import numpy as np
from nixl_async.testing import TCP_TLS

BLOCK, BLOCKS = 1 << 20, 32


async def test_fails_while_paused(monkeypatch, nixl_peer_factory, nixl_engine):
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    peer_proc = nixl_peer_factory(num_regions=1, num_blocks=BLOCKS, block_len=BLOCK, tcp=True)
    nixl_engine.register("kv", [np.zeros(BLOCKS * BLOCK, np.uint8)], block_len=BLOCK)
    peer = await nixl_engine.connect(*peer_proc.address)
    transfer = await nixl_engine.start_read(peer, list(range(BLOCKS)), list(range(BLOCKS)))
    while not transfer.core.has_running:
        await asyncio.sleep(0.0005)
    peer_proc.pause()
    assert False, "the test's own failure"
"""
    )
    result = pytester.runpytest_subprocess("-o", "asyncio_mode=auto", "-q", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.no_fnmatch_line("*NIXL handles still live*")


def test_a_peer_whose_parent_was_killed_exits(tmp_path):
    """A test run killed from outside (CI's timeout, the OOM killer) left its peers running for good."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "from nixl_async.testing.peer_process import PeerProcess, PeerSpec\n"
        "peer = PeerProcess(PeerSpec(engine_id='orphan')).start()\n"
        "print(peer.pid, flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return  # exited, not reaped yet (by whoever adopted it)
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the peer outlived its parent by 10 s")


def test_an_engine_whose_serve_failed_is_closed_and_a_peer_that_would_not_stop_spares_the_others(pytester):
    """An audit of session 39: the engine fixture started and served outside its `try` (a serve that failed
    left the started engine, poller and agent, open), and the peer factory stopped its peers one after the
    other with nothing around each (one that raised left the rest running until pytest exited)."""
    pytester.makeconftest(
        """
import pytest
from nixl_async import TransferEngine

STARTED = []
_start, _serve = TransferEngine.start, TransferEngine.serve

async def start(self):
    STARTED.append(self)
    return await _start(self)

async def serve(self, host, port):
    if self.engine_id == "will-not-serve":
        raise OSError("address in use")
    return await _serve(self, host, port)

TransferEngine.start, TransferEngine.serve = start, serve
"""
    )
    pytester.makepyfile(
        test_teardown="""
import pytest
from conftest import STARTED

PEERS = []

@pytest.mark.nixl_engine_config(engine_id="will-not-serve")
async def test_serve_fails(nixl_engine):
    pass

def test_a_peer_refuses_to_stop(nixl_peer_factory):
    first, second = nixl_peer_factory(), nixl_peer_factory()
    PEERS.extend([first, second])
    first.stop = lambda timeout: (_ for _ in ()).throw(RuntimeError("stuck"))

def test_after():
    assert [engine._closed for engine in STARTED] == [True]
    assert [peer.proc.poll() is not None for peer in PEERS] == [True, True]
"""
    )
    result = pytester.runpytest_subprocess("-o", "asyncio_mode=auto", "-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, errors=2)
    result.stdout.fnmatch_lines(["*address in use*", "*stuck*"])
