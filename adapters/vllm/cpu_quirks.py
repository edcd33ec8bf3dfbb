"""Process set-up the CPU backend needs before NIXL/UCX start threads (README, "vLLM" section).

- AMX: vLLM's bf16 attention uses AMX tiles, which need a per-process permission. Asked for
  after UCX has created its threads (with small signal stacks) the kernel refuses it and the
  first forward dies with SIGILL, so it is requested here, before our agent exists.
- ``UCX_RCACHE_MAX_UNRELEASED=1024``: what vLLM itself sets before importing NIXL.

NIXL's progress thread needs no switch here: the engine always creates its agent without it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["prepare_process"]

log = logging.getLogger(f"vllm.{__name__}")  # under "vllm", so it shows in vLLM's log

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_done = False


def request_amx_permission() -> bool:
    """Ask the kernel for AMX tile data; False where that is not possible (not x86-64 Linux)."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def prepare_process() -> None:
    """Idempotent; call before the first transfer engine of the process is created."""
    global _done
    if _done:
        return
    _done = True
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    if not request_amx_permission():
        log.debug("AMX tile permission not granted (no AMX on this CPU, or not x86-64 Linux)")
