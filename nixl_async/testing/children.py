"""Servers a test or benchmark starts (vLLM, etcd, proxies) end with it, even when it is killed.

A killed pytest runs no fixture teardown: its vLLM servers kept their ports and the next run's
requests reached them (a confusing 404 for a model path of the run before), and etcd servers
piled up. `dies_with_us` prefixes a command with util-linux's ``setpriv --pdeathsig SIGTERM``:
the kernel sends SIGTERM to the child when the thread that started it exits, and the signal
survives the ``exec`` of ``ip netns exec`` and of the server itself. Only from the main thread:
a child started from a worker thread would be ended when that thread ends. Where ``setpriv`` is
missing (not Linux), the command is left as it is.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Sequence

__all__ = ["dies_with_us"]


def dies_with_us(command: Sequence[str]) -> list[str]:
    """`command`, set to receive SIGTERM when the calling (main) thread's process dies."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return list(command)
    return [setpriv, "--pdeathsig", "SIGTERM", "--", *command]
