"""Servers a test or benchmark starts (vLLM, etcd, proxies) end with it, even when it is killed.

A killed pytest runs no fixture teardown: its vLLM servers kept their ports and the next run's
requests reached them (a confusing 404 for a model path of the run before), and etcd servers
piled up. `dies_with_us` prefixes a command with util-linux's ``setpriv --pdeathsig SIGTERM``:
the kernel sends SIGTERM to the child when the thread that started it exits, and the signal
survives the ``exec`` of ``ip netns exec`` and of the server itself. Only from the main thread:
a child started from a worker thread would be ended when that thread ends. Where ``setpriv`` is
missing or too old for ``--pdeathsig`` (not Linux, util-linux < 2.33), the command is left as it is.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import threading
from collections.abc import Sequence

__all__ = ["dies_with_us"]


@functools.cache
def _setpriv() -> str | None:
    """util-linux's setpriv, if it has --pdeathsig (2.33 and later)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return None
    try:
        subprocess.run([setpriv, "--pdeathsig", "SIGTERM", "--", "true"], check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return setpriv


def dies_with_us(command: Sequence[str]) -> list[str]:
    """`command`, set to receive SIGTERM when the calling (main) thread's process dies."""
    if threading.current_thread() is not threading.main_thread() or (setpriv := _setpriv()) is None:
        return list(command)
    return [setpriv, "--pdeathsig", "SIGTERM", "--", *command]
