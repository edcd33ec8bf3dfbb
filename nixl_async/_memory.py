"""What this engine registered with NIXL, and the descriptor lists prepared over it.

A `MemoryRegistry` owns the registered layouts (with the Python objects that keep their memory
alive), the local and remote descriptor lists prepared per view, and the view cache. It calls
the agent it is handed but never decides *when*: the engine asks it to deregister only memory no
live transfer uses (a fenced transfer pins its layout), and to drop a peer's lists only once that
peer's transfers are quiet.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._agent import NIXL_ERRORS, OwnedAgent, RegisteredMemory
from ._peers import pick_layout
from .exceptions import LayoutError
from .layout import BlockLayout, BlockView, LayoutKind, MemType, ViewSpec

__all__ = ["MemoryRegistry", "ViewLike", "layout_of_memory"]

ViewLike = BlockView | ViewSpec | str | None
_MAX_CACHED_VIEWS = 1024


def _regions(memory: Any) -> tuple[list[int], int, MemType, int, list[Any]]:
    """(addresses, bytes per region, mem type, device id, objects to keep alive) of tensors/arrays."""
    items = list(memory) if isinstance(memory, list | tuple) else [memory]
    if not items:
        raise LayoutError("no memory given")
    addrs: list[int] = []
    sizes: set[int] = set()
    kinds: set[tuple[MemType, int]] = set()
    for item in items:
        if isinstance(item, np.ndarray):
            if not item.flags.c_contiguous:
                raise LayoutError("numpy arrays must be C-contiguous to be registered")
            if not item.flags.writeable:  # a READ, or a peer's WRITE, would change it all the same
                raise LayoutError("read-only numpy arrays cannot be registered (reads and peers' writes change them)")
            if item.dtype.hasobject:  # bytes landing there would be taken for object pointers
                raise LayoutError("numpy arrays of Python objects cannot be registered")
            addrs.append(item.ctypes.data)
            sizes.add(item.nbytes)
            kinds.add((MemType.DRAM, 0))
        elif hasattr(item, "data_ptr") and hasattr(item, "is_contiguous"):  # torch.Tensor
            if not item.is_contiguous():
                raise LayoutError("tensors must be contiguous to be registered")
            if item.is_conj() or item.is_neg():  # lazily conjugated or negated: the bytes say otherwise
                raise LayoutError("conjugate or negative views cannot be registered (resolve_conj/resolve_neg first)")
            addrs.append(item.data_ptr())
            sizes.add(item.numel() * item.element_size())
            if item.device.type == "cuda":
                kinds.add((MemType.VRAM, item.device.index or 0))
            elif item.device.type == "cpu":
                kinds.add((MemType.DRAM, 0))
            else:
                raise LayoutError(f"cannot register memory on device {item.device}")
        else:
            raise LayoutError(f"cannot register {type(item).__name__}: pass tensors, arrays or a BlockLayout")
    if len(sizes) != 1:
        raise LayoutError(f"every region must have the same size, got {sorted(sizes)}")
    if len(kinds) != 1:
        raise LayoutError(f"every region must be on the same device, got {sorted(kinds)}")
    ((mem_type, device),) = kinds
    return addrs, sizes.pop(), mem_type, device, items


def layout_of_memory(
    name: str,
    memory: Any,
    *,
    num_blocks: int | None,
    block_len: int | None,
    kind: LayoutKind,
    block_size: int,
) -> tuple[BlockLayout, list[Any]]:
    """The layout of tensors/arrays (one region each, equal sizes), and the objects to keep alive."""
    addrs, region_bytes, mem_type, device, keepalive = _regions(memory)
    if (num_blocks is None) == (block_len is None):
        raise LayoutError("give exactly one of num_blocks and block_len")
    if num_blocks is not None:
        if num_blocks <= 0 or region_bytes % num_blocks:
            raise LayoutError(f"a {region_bytes}-byte region does not hold {num_blocks} equal blocks")
        block_len = region_bytes // num_blocks
    assert block_len is not None
    if block_len <= 0 or region_bytes % block_len:
        raise LayoutError(f"a {region_bytes}-byte region is not a whole number of {block_len}-byte blocks")
    layout = BlockLayout.from_regions(
        name,
        addrs,
        num_blocks=region_bytes // block_len,
        block_len=block_len,
        kind=kind,
        mem_type=mem_type,
        device_id=device,
        block_size=block_size,
    )
    return layout, keepalive


class _Registered:
    __slots__ = ("exposed", "keepalive", "layout", "memory")

    def __init__(self, layout: BlockLayout, memory: RegisteredMemory, keepalive: list[Any]) -> None:
        self.layout = layout
        self.memory = memory
        self.keepalive = keepalive
        self.exposed = False  # our metadata went out (a handshake answered, a record published) while registered


class MemoryRegistry:
    """Registered layouts, prepared descriptor lists and cached views of one engine."""

    def __init__(self) -> None:
        self._registered: dict[str, _Registered] = {}
        # Deregistered memory stays referenced until the engine closes: a peer holding our older
        # metadata may still reach it (UCX over TCP checks no keys), and must not reach freed memory.
        # Where it lay is kept too: memory whose keys went out is not registered again.
        self._deregistered: list[_Registered] = []
        self.layouts: dict[str, BlockLayout] = {}  # name -> layout, what peers see
        self._views: dict[tuple[int, ViewSpec | None], BlockView] = {}
        self._local_dlists: dict[tuple[str, int, int, int], Any] = {}
        self._remote_dlists: dict[tuple[str, tuple[str, int, int, int]], Any] = {}

    def register(self, agent: OwnedAgent, layout: BlockLayout, keepalive: list[Any]) -> BlockLayout:
        if layout.name in self._registered:
            raise LayoutError(f"a layout named {layout.name!r} is already registered")
        for other in self._registered.values():
            if layout.overlaps(other.layout):
                raise LayoutError(f"layout {layout.name!r} overlaps registered layout {other.layout.name!r}")
        for old in (r.layout for r in self._deregistered if r.exposed):
            if layout.overlaps(old):
                # A peer holding our older metadata would write into it as layout `old` (UCX over TCP checks
                # no keys), and its bytes would land among this layout's data: silent corruption.
                raise LayoutError(f"layout {layout.name!r} overlaps memory deregistered from layout {old.name!r}: "
                                  "peers holding this engine's older metadata may still reach it, so it is not "
                                  "registered again while this engine runs (register other memory)")  # fmt: skip
        try:
            memory = agent.register(layout.region_descriptors(), layout.mem_type)
        except NIXL_ERRORS as exc:
            raise LayoutError(f"NIXL refused to register layout {layout.name!r} ({layout.mem_type.name} on device "
                              f"{layout.device_id}): {exc}") from exc  # fmt: skip
        self._registered[layout.name] = _Registered(layout, memory, keepalive)
        self.layouts[layout.name] = layout
        return layout

    def mark_exposed(self) -> None:
        """Our metadata, with the keys to every layout registered now, is going out to peers."""
        for registered in self._registered.values():
            registered.exposed = True

    def local_dlists_of(self, name: str) -> list[Any]:
        """The prepared local descriptor lists over layout `name` (a transfer holding one pins it)."""
        if name not in self._registered:
            raise LayoutError(f"no layout named {name!r} is registered")
        return [h for k, h in self._local_dlists.items() if k[0] == name]

    def deregister(self, agent: OwnedAgent, name: str) -> None:
        """Release the layout's descriptor lists and deregister it. The engine checked it is unused.

        If NIXL refuses, the layout stays registered, offered to peers and referenced (`LayoutError`).
        """
        registered = self._registered[name]
        try:
            for key in [k for k in self._local_dlists if k[0] == name]:
                agent.release_dlist(self._local_dlists[key])
                del self._local_dlists[key]  # (released: prepared again if the layout stays)
            agent.deregister(registered.memory)
        except NIXL_ERRORS as exc:
            raise LayoutError(f"NIXL refused to deregister layout {name!r}: it stays registered ({exc})") from exc
        del self._registered[name]
        del self.layouts[name]
        self._views.clear()
        self._deregistered.append(registered)  # (not exposed: no peer had its keys, it may be registered again)

    def view(self, spec: ViewLike, layouts: dict[str, BlockLayout], owner: str) -> BlockView:
        """Resolve a view of one of `layouts` (ours or a peer's); resolved views are cached."""
        if isinstance(spec, BlockView):
            if layouts.get(spec.layout.name) != spec.layout:
                raise LayoutError(f"view of layout {spec.layout.name!r} does not belong to {owner}")
            return spec
        name, window = (spec.layout, spec) if isinstance(spec, ViewSpec) else (spec, None)
        layout = pick_layout(layouts, name, owner)
        key = (id(layout), window)  # their index tables are reused by every submit
        view = self._views.get(key)
        if view is None or view.layout is not layout:
            view = window.resolve(layout) if window is not None else layout.view()
            if len(self._views) > _MAX_CACHED_VIEWS:
                self._views.clear()
            self._views[key] = view
        return view

    def local_dlist(self, agent: OwnedAgent, view: BlockView) -> Any:
        handle = self._local_dlists.get(view.key)
        if handle is None:
            handle = self._local_dlists[view.key] = agent.prep_view("", view)
        return handle

    def remote_dlist(self, agent: OwnedAgent, agent_name: str, view: BlockView) -> Any:
        key = (agent_name, view.key)
        handle = self._remote_dlists.get(key)
        if handle is None:
            handle = self._remote_dlists[key] = agent.prep_view(agent_name, view)
        return handle

    def drop_remote(self, agent: OwnedAgent, agent_name: str, keep: set[int] | None = None) -> list[Any]:
        """Forget the lists prepared over a remote agent's memory; release those not in use.

        `keep` holds ids of handles live transfers still use: they are returned, not released
        (the caller releases them once those transfers are quiet).
        """
        kept = []
        for key in [k for k in self._remote_dlists if k[0] == agent_name]:
            handle = self._remote_dlists.pop(key)
            if keep is not None and id(handle) in keep:
                kept.append(handle)
            else:
                agent.release_dlist(handle)
        return kept

    def keepalives(self) -> list[list[Any]]:
        return [r.keepalive for r in (*self._registered.values(), *self._deregistered)]

    def release_all(self, agent: OwnedAgent) -> None:
        """Release every local list and deregister everything (no transfer may be alive)."""
        for handle in self._local_dlists.values():
            agent.release_dlist(handle)
        self._local_dlists.clear()
        for registered in self._registered.values():
            agent.deregister(registered.memory)
        self.forget()

    def forget(self) -> None:
        """Drop every reference without calling NIXL (the memory is kept alive elsewhere)."""
        self._registered.clear()
        self._deregistered.clear()
        self.layouts.clear()
        self._views.clear()
        self._local_dlists.clear()
