"""Servers a test starts end with it even when it is killed (no teardown runs then)."""

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from nixl_async.testing.children import dies_with_us

pytestmark = pytest.mark.skipif(shutil.which("setpriv") is None, reason="util-linux setpriv (Linux) not here")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("wrapped", [True, False])
def test_a_server_started_by_a_killed_test_ends_with_it(wrapped):
    """Before, a killed pytest left its vLLM and etcd servers running, holding their ports."""
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        from nixl_async.testing.children import dies_with_us
        command = [sys.executable, "-c", "import time; time.sleep(60)"]
        server = subprocess.Popen(dies_with_us(command) if {wrapped} else command)
        print(server.pid, flush=True)
        time.sleep(60)
    """)
    test = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server = int(test.stdout.readline())
    try:
        time.sleep(0.3)  # (the server is running: setpriv has exec'd it)
        assert _alive(server)
        test.kill()
        test.wait()
        deadline = time.monotonic() + 5
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(server) != wrapped
    finally:
        if _alive(server):
            os.kill(server, 9)


def test_only_the_main_thread_binds_a_child_to_itself():
    """A child bound to a worker thread would be ended when that thread ends."""
    seen: list[list[str]] = []
    worker = threading.Thread(target=lambda: seen.append(dies_with_us(["true"])))
    worker.start()
    worker.join()
    assert seen == [["true"]]
    assert dies_with_us(["true"])[-2:] == ["--", "true"]


def test_a_server_refuses_a_port_another_process_answers_on():
    """Before, a vLLM server or proxy left by another run passed the new one's readiness check (its /health
    answered) and took the run's requests: 404s for a model path it did not have."""
    import socket

    from nixl_async_vllm.launch import ProxyProcess, VllmServer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="taken by another process"):
            VllmServer("model", port, 0, None).start()
        with pytest.raises(RuntimeError, match="taken by another process"):
            ProxyProcess(port, "http://127.0.0.1:1", "http://127.0.0.1:2").start()
