"""The only module that imports NIXL.

`OwnedAgent` wraps one `nixl_agent` created with its progress thread off (the engine's loop
progresses it through its own calls) and refuses every call from a thread other than the one
that created it: NIXL agents are not thread-safe. It also counts every live handle (transfer
requests, prepared descriptor lists, remote agents, registrations) so leaks show in tests.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
import threading
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from ._host import backend_start_hint, nvidia_gpus
from .exceptions import BackendStartError, WrongThreadError
from .layout import BlockView, DescArray, DescIds, MemType

__all__ = ["NIXL_ERRORS", "OwnedAgent", "RegisteredMemory"]

# The backend wheels the `nixl` package chooses among when it finds no CUDA version, in its order.
_NIXL_WHEELS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def _torch_cuda_on_disk() -> str | None:
    """The CUDA version the installed torch was built for, read without importing torch.

    None: a CPU-only torch, or none. "unknown" when its version file cannot be read.
    """
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    version_spec = importlib.util.spec_from_file_location("_nixl_async_torch_version",
                                                          Path(spec.origin).parent / "version.py")  # fmt: skip
    if version_spec is None or version_spec.loader is None:
        return "unknown"
    try:
        module = importlib.util.module_from_spec(version_spec)
        version_spec.loader.exec_module(module)
    except Exception:  # whatever it is, `import nixl` then decides, as it always did
        return "unknown"
    return getattr(module, "cuda", None)


def _nixl_package() -> ModuleType:
    """NIXL's Python package: the backend wheel `import nixl` would choose, without its slow step.

    The `nixl` package picks its backend wheel by the CUDA version of the process's stack. With
    nothing CUDA imported yet and a CPU-only torch on disk it learns nothing, imports torch to
    ask again (~2-3 s here, in every process that imports us: each test peer, each CLI call),
    then takes the first wheel installed. We take that wheel at once in that case only; in any
    other (torch, CUDA or nixl already imported, a CUDA torch on disk, an unreadable one) `nixl` chooses.
    """
    if any(name in sys.modules for name in ("nixl", "torch", "cuda.bindings", "cupy")) or _torch_cuda_on_disk():
        return importlib.import_module("nixl")
    for name in _NIXL_WHEELS:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
    return importlib.import_module("nixl")  # none installed: its own error says so


_nixl = _nixl_package()
_bindings: Any = importlib.import_module(f"{_nixl.__name__}._bindings")
nixl_agent: Any = _nixl.nixl_agent
nixl_agent_config: Any = _nixl.nixl_agent_config

if not os.environ.get("NIXL_LOG_LEVEL"):  # NIXL logs every agent at INFO; keep it quiet by default
    logging.getLogger("nixl").setLevel(logging.WARNING)

log = logging.getLogger(__name__)

# NIXL's bindings raise their own exception classes (nixlBackendError, nixlRemoteDisconnectError,
# ...), each derived from Exception directly. Catch exactly those, so our own bugs stay visible.
NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    cls for name, cls in vars(_bindings).items() if name.startswith("nixl") and name.endswith("Error")
) or (Exception,)

XferHandle = int  # NIXL's own request handle, as its bindings give it
DlistHandle = Any
_OPS = {"READ": _bindings.NIXL_READ, "WRITE": _bindings.NIXL_WRITE}
_STATES = {_bindings.NIXL_SUCCESS: "DONE", _bindings.NIXL_IN_PROG: "PROC"}  # anything else: "ERR"


class RegisteredMemory:
    """Memory registered with the agent; `deregister()` it (the engine does on close)."""

    __slots__ = ("descs", "mem_type", "reg_list")

    def __init__(self, reg_list: Any, descs: DescArray, mem_type: MemType) -> None:
        self.reg_list = reg_list
        self.descs = descs
        self.mem_type = mem_type

    @property
    def total_bytes(self) -> int:
        return int(self.descs[:, 1].sum())


class OwnedAgent:
    """A NIXL agent that only its creating thread may call."""

    def __init__(
        self,
        name: str,
        backends: tuple[str, ...],
        backend_params: Mapping[str, Mapping[str, str]],
        *,
        progress_thread: bool = False,
    ) -> None:
        """`backend_params`: each backend's parameters (none for a backend it does not name).

        `progress_thread=True` exists only so benchmarks can measure NIXL's default mode.
        """
        self._owner = threading.get_ident()
        self.name = name
        config = nixl_agent_config(enable_prog_thread=progress_thread, enable_listen_thread=False, backends=[])
        self._agent = nixl_agent(name, config)
        self._bind = self._agent.agent  # the bindings' agent: the per-transfer calls skip the wrapper
        plugins = self._agent.get_plugin_list()
        for backend in backends:
            if backend not in plugins:  # (NIXL's own answer is a bare NIXL_ERR_NOT_FOUND)
                raise ValueError(f"NIXL has no plugin for backend {backend!r} here; it found {sorted(plugins)}")
            try:
                self._agent.create_backend(backend, dict(backend_params.get(backend, {})))
            except Exception as exc:  # NIXL's bindings raise their own classes, per wheel
                hint = backend_start_hint(backend, os.environ, nvidia_gpus())
                raise BackendStartError(
                    f"NIXL could not start its {backend} backend ({exc}){': ' + hint if hint else ''}"
                ) from exc
        self.live: Counter[str] = Counter()
        self._remotes: set[str] = set()  # remote agents loaded (NIXL loads one again in place)

    def _check(self) -> None:
        if threading.get_ident() != self._owner:
            raise WrongThreadError(
                f"NIXL agent {self.name!r} is owned by thread {self._owner}; "
                f"called from {threading.get_ident()}. Hand the work to the engine's loop instead."
            )

    # -- memory ---------------------------------------------------------------------------
    def register(self, descs: DescArray, mem_type: MemType) -> RegisteredMemory:
        self._check()
        reg = self._agent.register_memory(np.ascontiguousarray(descs, dtype=np.uint64), str(mem_type))
        self.live["registrations"] += 1
        return RegisteredMemory(reg, descs, mem_type)

    def deregister(self, mem: RegisteredMemory) -> None:
        self._check()
        self._agent.deregister_memory(mem.reg_list)
        self.live["registrations"] -= 1

    def metadata(self) -> bytes:
        self._check()
        return bytes(self._agent.get_agent_metadata())

    # -- remote agents --------------------------------------------------------------------
    def add_remote(self, metadata: bytes) -> str:
        self._check()
        loaded = self._agent.add_remote_agent(metadata)
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name not in self._remotes:
            self._remotes.add(name)
            self.live["remote_agents"] += 1
        return name

    def remove_remote(self, agent_name: str) -> None:
        self._check()
        self._agent.remove_remote_agent(agent_name)
        if agent_name in self._remotes:  # (once NIXL let go: one it kept still counts)
            self._remotes.discard(agent_name)
            self.live["remote_agents"] -= 1

    # -- descriptor lists -----------------------------------------------------------------
    def prep_view(self, agent_name: str, view: BlockView) -> DlistHandle:
        """Prepare a view's descriptors, local (`agent_name` "") or of a remote agent."""
        self._check()
        handle = self._agent.prep_xfer_dlist(agent_name, view.strided_rows(), str(view.layout.mem_type))
        self.live["dlists"] += 1
        return handle

    def release_dlist(self, handle: DlistHandle) -> None:
        self._check()
        self._agent.release_dlist_handle(handle)
        self.live["dlists"] -= 1

    # -- transfers ------------------------------------------------------------------------
    # Requests are plain int handles from NIXL's bindings, not `nixl_xfer_handle` objects: with
    # 10 k transfers in flight every object the garbage collector tracks lengthens its passes, and
    # a handle we lost is never released behind our back (the wrapper's finalizer would release,
    # i.e. cancel, a request whose memory NIXL may still be writing).
    def make_xfer(
        self,
        op: str,
        local: DlistHandle,
        local_ids: DescIds,
        remote: DlistHandle,
        remote_ids: DescIds,
        notif: bytes = b"",
    ) -> XferHandle:
        self._check()
        handle: int = self._bind.makeXferReq(_OPS[op], local._handle, local_ids, remote._handle, remote_ids, notif,
                                             [], False)  # fmt: skip
        self.live["xfers"] += 1
        return handle

    def post(self, handle: XferHandle) -> str:
        """Post a transfer: "DONE" (finished inside the call), "PROC" or "ERR"."""
        self._check()
        return _STATES.get(self._bind.postXferReq(handle, b""), "ERR")

    def state(self, handle: XferHandle) -> str:
        self._check()
        return _STATES.get(self._bind.getXferStatus(handle), "ERR")

    def release_xfer(self, handle: XferHandle) -> bool:
        """Release (cancelling if in flight). False when NIXL could not release it yet."""
        self._check()
        try:
            self._bind.releaseXferReq(handle)
        except NIXL_ERRORS as exc:
            log.debug("xfer handle release deferred: %s", exc)
            return False
        self.live["xfers"] -= 1
        return True

    @property
    def public(self) -> Any:
        """The `nixl_agent` itself, for baselines written against NIXL's public Python API."""
        self._check()
        return self._agent

    # -- notifications --------------------------------------------------------------------
    def notifications(self) -> dict[str, list[bytes]]:
        """Drain new notifications (this also progresses the UCX worker)."""
        self._check()
        return self._agent.get_new_notifs()

    def send_notification(self, agent_name: str, message: bytes) -> None:
        self._check()
        self._agent.send_notif(agent_name, message)

    def live_handles(self) -> dict[str, int]:
        return {k: v for k, v in self.live.items() if v}
