"""Worker side: vLLM's per-step calls translated into work for the engine's loop.

vLLM calls `start_load_kv` and `get_transfer_results` from its worker thread once per step.
Neither may wait on transfers, so:

- `start_load_kv` hands each request to the loop (`SyncEngine.submit`) and returns;
- the request's coroutine (`_receive`, run on the loop) handshakes with the producer ranks it
  needs, plans the reads from their layouts (`tp_mapping`), reads and notifies;
- `get_transfer_results` drains what finished (`SyncEngine.get_finished`) and the producer's
  notifications (`SyncEngine.feed_notifications`) without waiting, and counts readers.

On the producer side a finished request's blocks are held until every reader notified
``"{request_id}:{readers}"`` or the lease expires; readers whose request still waits renew the
lease through acknowledged calls (`leases`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import math
import queue
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from nixl_async import (
    BlockLayout,
    EngineClosedError,
    FinishedRequests,
    HandshakeError,
    LayoutError,
    LeaseExpired,
    MemType,
    Notification,
    NotificationFailed,
    Peer,
    SyncEngine,
    Transfer,
    TransferEngine,
    TransferResult,
    ViewSpec,
)

from . import cpu_quirks
from .block_pairs import (
    GroupBlocks,
    full_pages_of_prompt,
    in_kernel_pages,
    kernel_pages,
    pair_blocks,
    window_pages_of_prompt,
)
from .kv_layout import CacheLayout, describe_cache, no_head_window, packing_class, packing_name
from .leases import LEASE_TOPIC, LearnedLeases, RequestLease, answer_renewal, heartbeat
from .push_book import PUSH_FAILED_PREFIX, PUSH_PREFIX
from .send_book import SendBook
from .settings import AdapterSettings, UnsupportedSetting, connect_rank, rank_engine_id
from .tp_mapping import RankRead, expected_consumers, plan_reads, remote_ranks, split_for_block_ratio

__all__ = [
    "IDLE_POKE_S",
    "ConnectorWorker",
    "IdleWait",
    "KVGeometry",
    "RecvJob",
    "RequestPlan",
    "connect_job_rank",
    "idle_step_wait",
    "plan_request",
    "receive",
    "tokens_per_block",
    "transfer_groups",
]

log = logging.getLogger(f"vllm.{__name__}")  # under "vllm", so it shows in vLLM's log

LAYOUT = "kv"
# kv_buffer_device values per device the KV caches live on (vLLM's NixlConnector takes the same for CUDA and CPU):
# "cpu" with CUDA caches stages them through host copies.
_BUFFER_DEVICES = {"cuda": ("cuda", "cpu"), "cpu": ("cpu",)}


@dataclass(frozen=True)
class KVGeometry:
    """This rank's KV cache as the transfer planner sees it."""

    tp_size: int
    tp_rank: int
    block_size: int  # tokens per block
    part_len: int  # bytes of one block part (one layer's block, or its K or V half)
    run_len: int | None  # bytes of one run a block-size ratio cuts (see kv_layout); None when token-major
    mla: bool
    kv_heads: int  # the model's KV heads, all ranks together (vLLM shards or replicates them across TP)
    head_window: bool = True  # a rank's heads are one byte range of a block (heterogeneous TP can read it)
    ratio_refusal: str | None = None  # why smaller remote blocks cannot be placed, if they cannot
    pages_per_block: int = 1  # kernel pages vLLM split each logical block into (block_size is a page's)
    group_kinds: tuple[str, ...] = ("full",)  # vLLM's KV cache groups that transfer, in order (see block_pairs)
    bytes_meaning: tuple[tuple[str, str], ...] = ()  # what a block's bytes mean here (`check_bytes_meaning`)
    compat_enforced: bool = True  # the compatibility hash, which covers `bytes_meaning` too, is enforced


@dataclass(frozen=True)
class RecvJob:
    """One request to pull: everything `_receive` needs, copied out of vLLM's metadata."""

    request_id: str
    remote_request_id: str
    remote_engine_id: str
    host: str
    port: int
    remote_tp: int
    groups: tuple[GroupBlocks, ...]  # per KV cache group that transfers, in vLLM's order
    expires_at: float | None  # producer's wall clock
    num_tokens: int | None = None  # the prompt tokens the producer computed, if it said

    @property
    def local_blocks(self) -> list[int]:
        """Every local block the request receives into, all groups together."""
        return [b for group in self.groups for b in group.local]


def _kv_regions(
    kv_caches: dict[str, Any], num_blocks: int, state_layers: frozenset[str] = frozenset()
) -> tuple[list[Any], int, int]:
    """(per-layer tensors, bytes per kernel page, kernel pages per block) of vLLM's caches.

    When the attention kernel takes smaller blocks than the scheduler's, vLLM views each layer
    as ``pages_per_block`` times more pages of ``block_size / pages_per_block`` tokens; logical
    block b is pages ``b * k ... b * k + k - 1`` (as NixlConnector maps them). We then register
    and read pages.

    vLLM 0.32 hands one ``[blocks, heads, tokens, content]`` view per attention layer (see
    `kv_layout`), each block dense. Layers sharing a cache alias the same memory: registered
    once. With the hybrid allocator, `state_layers` (Mamba, linear attention) view the same
    pages with their state at the start of each page and padding after it: their pages are
    registered (and read) whole.
    """
    attention = {name: t for name, t in kv_caches.items() if name not in state_layers}
    sizes = sorted({int(tensor.shape[0]) for tensor in attention.values()})
    if len(sizes) != 1 or sizes[0] % num_blocks:
        raise LayoutError(f"KV caches of {sizes} blocks: expected {num_blocks} blocks, or kernel pages of them")
    num_pages = sizes[0]
    if state_layers and num_pages != num_blocks:
        raise LayoutError("kernel pages smaller than the block beside state (Mamba) layers are not supported")
    # Heads, head windows and token runs are planned from one layer: every attention layer must
    # pack its blocks alike (vLLM 0.32 lets layers differ in KV heads or head size, evening out
    # their page bytes with other block sizes, e.g. Gemma 4's per-layer configs).
    first_name, first = next(iter(attention.items()))
    for name, tensor in attention.items():
        if tuple(tensor.shape[1:]) != tuple(first.shape[1:]) or tensor.dtype != first.dtype:
            raise LayoutError(f"layer {name}'s KV blocks are {tuple(tensor.shape[1:])} of {tensor.dtype}, layer "
                              f"{first_name}'s {tuple(first.shape[1:])} of {first.dtype}: layers with other KV "
                              "heads or head sizes are not supported by the nixl_async adapter")  # fmt: skip
    regions: list[Any] = []
    seen: set[int] = set()
    page_len = 0
    for name, tensor in [*attention.items(), *((name, kv_caches[name]) for name in sorted(state_layers))]:
        page_len = page_len or tensor.stride(0) * tensor.element_size()
        content = tensor[0].numel() * tensor.element_size()
        padded = name in state_layers and content <= page_len
        if tensor.stride(0) * tensor.element_size() != page_len or not (content == page_len or padded):
            raise LayoutError(f"KV cache blocks must be dense and of equal size in every layer ({name} is not)")
        if int(tensor.shape[0]) != num_pages:
            raise LayoutError(f"layer {name} has {tensor.shape[0]} blocks, the others {num_pages}")
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            regions.append(tensor)
    return regions, page_len, num_pages // num_blocks


def host_mirror(caches: dict[str, Any]) -> dict[str, Any]:
    """Host copies of `caches` that alias one another where the device views do.

    Layers sharing a cache (KV sharing; one layer of each hybrid group per page tensor) are
    registered once on the device: their host copies must share memory too, or a staging side
    announces more regions than a side reading its device memory, and the reads are refused.

    Not pinned: torch's pinned allocator rounds a request up to a power of two, and vLLM 0.32 backs
    every layer with one buffer, so a 65 GiB cache pinned 128 GiB per rank; vLLM's copy ops go
    through a pageable gather anyway (and NixlConnector's host buffers are not pinned either).
    """
    storages: dict[int, Any] = {}
    mirror = {}
    for name, tensor in caches.items():
        storage = tensor.untyped_storage()
        host = storages.get(storage.data_ptr())
        if host is None:
            host = storages[storage.data_ptr()] = torch.empty(storage.nbytes(), dtype=torch.uint8)
        mirror[name] = host.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
    return mirror


def tokens_per_block(kv_cache_config: Any, configured: int) -> int:
    """Tokens of one logical block, from the KV cache groups that transfer (their least common multiple, as
    vLLM's worker reads it; state groups aside), else `configured`. (vLLM 0.32 updates
    ``cache_config.block_size`` in the engine core's process only: a TP worker's copy may keep the value asked
    for, while its groups hold the one chosen, e.g. a hybrid model's enlarged attention blocks.)"""
    from vllm.v1.kv_cache_interface import MambaSpec

    sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.transfer_groups
             if not isinstance(g.kv_cache_spec, MambaSpec)]  # fmt: skip
    return math.lcm(*sizes) if sizes else configured


def transfer_groups(kv_cache_config: Any) -> tuple[tuple[str, ...], frozenset[str]]:
    """(kind of each KV cache group that transfers, in vLLM's order; names of its state layers).

    Kinds are `block_pairs.KINDS`; a group of any other spec is refused by name, since we would
    not know which of its blocks hold what.
    """
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    kinds: list[str] = []
    state: set[str] = set()
    for group in kv_cache_config.transfer_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec) and not spec.tp_replicated:
            kinds.append("state")
            state.update(group.layer_names)
        elif isinstance(spec, SlidingWindowSpec):
            kinds.append("window")
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):  # not their subclasses (sinks, RSWA...)
            kinds.append("full")
        else:
            raise LayoutError(f"KV cache group of {type(spec).__name__} ({group.layer_names[:2]}...): not supported "
                              "by the nixl_async adapter")  # fmt: skip
    return tuple(kinds), frozenset(state)


@dataclass(frozen=True)
class AttentionChoice:
    """The attention backend and KV cache layout vLLM chose (and, for the CPU backend, its ISA)."""

    backend: str
    layout: str
    isa: str | None

    @classmethod
    def of(cls, vllm_config: Any, layers: list[str] | None = None) -> AttentionChoice:
        """The choice for attention `layers` (all by default; state layers have backends of their own)."""
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        names = sorted({packing_name(b) for b in get_current_attn_backends(vllm_config, layers)})
        if len(names) != 1:
            raise LayoutError(f"attention layers use backends {names}: the adapter reads one cache packing")
        backend = names[0]
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout().name
        isa = None
        if backend == "CPU_ATTN":  # its block packing depends on the ISA it picks
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            model, cache = vllm_config.model_config, vllm_config.cache_config
            isa = _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
        return cls(backend, layout, isa)

    def describe(self, vllm_config: Any, tensor: Any) -> CacheLayout:
        """What one layer's view means (refuses a packing the adapter cannot read correctly)."""
        model = vllm_config.model_config
        return describe_cache(
            self.backend, self.layout, tuple(tensor.shape), tuple(tensor.stride()), tensor.element_size(),
            num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config), mla=bool(model.use_mla), isa=self.isa,
        )  # fmt: skip


class ConnectorWorker:
    TRANSFER_MODE = "pull"  # vLLM's compatibility hash keeps pull and push instances apart
    IDLE_POKES_FOR_OWN_REQUESTS = True  # our reads, in an idle step's wait (see `idle_step_wait`)

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        cpu_quirks.prepare_process()  # before our agent's UCX threads exist
        self.settings = AdapterSettings.from_vllm(vllm_config)
        self.settings.apply_switch_interval()  # only if the deployment asked for it (settings docstring)
        self.engine_id = engine_id
        self.kv_cache_config = kv_cache_config
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = get_tensor_model_parallel_rank()
        self.use_mla = bool(vllm_config.model_config.use_mla)
        self.block_size = tokens_per_block(kv_cache_config, vllm_config.cache_config.block_size)
        self.buffer_device = vllm_config.kv_transfer_config.kv_buffer_device
        self.vllm_config = vllm_config
        self.group_kinds, self.state_layers = transfer_groups(kv_cache_config)
        attention_layers = [name for group in kv_cache_config.transfer_groups for name in group.layer_names
                            if name not in self.state_layers]  # fmt: skip
        self.attention = AttentionChoice.of(vllm_config, attention_layers or None)
        compat = _compat(vllm_config, self.attention, self.TRANSFER_MODE, has_state="state" in self.group_kinds)
        self._bytes_meaning = (*((key, compat[key]) for key in BYTES_MEANING_KEYS if key in compat),
                               *_packing_meaning(vllm_config, self.attention))  # fmt: skip
        self.sync = SyncEngine(self.settings.engine_config(rank_engine_id(engine_id, self.tp_rank), compat))
        self._notifications: queue.SimpleQueue[Notification] = self.sync.feed_notifications()
        self.geometry: KVGeometry | None = None
        self.address: tuple[str, int] = ("", 0)  # where this rank's engine answers handshakes
        self._regions: list[Any] = []  # vLLM's tensors; the engine does not own them, so keep them referenced
        self._device_caches: dict[str, Any] = {}
        self._sync_direct_receives = False  # set at registration: see get_transfer_results
        self._host_caches: dict[str, Any] = {}
        self._copy_blocks: Any = None
        # reader side
        self._awaiting: dict[str, list[int]] = {}  # request -> local blocks, for requests vLLM parked
        self._invalid_blocks: set[int] = set()
        self._results: queue.SimpleQueue[TransferResult] = queue.SimpleQueue()
        self._loop_failures: queue.SimpleQueue[str] = queue.SimpleQueue()  # stats series, counted on the loop
        # Handshake failures counted lately: the requests that shared one handshake fail with its one error (the
        # engine hands every caller of a shared connect its outcome), and vLLM counts a failed handshake once,
        # not once per request waiting on it.
        self._counted_handshake_errors: collections.deque[BaseException] = collections.deque(maxlen=256)
        self._sends = SendBook()  # producer side
        self._leases = LearnedLeases()  # reader side: renewals producers acknowledged (loop thread)
        self._lease_extension_s = self.settings.lease_s * 2 / 3  # per renewal, as NixlConnector
        self._lease_margin_s = min(LEASE_MARGIN_S, self.settings.lease_s / 10)
        self._heartbeating: set[str] = set()  # producer engines with a renewal round under way
        self.sync.handle_calls(LEASE_TOPIC, self._answer_renewal)
        self._stats: Any = None
        self._step_idle = False  # the step being run scheduled nothing (see _wait_if_idle)

    # -- registration ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        num_blocks = self.kv_cache_config.num_blocks
        attention = [t for name, t in kv_caches.items() if name not in self.state_layers]
        if not attention:
            raise LayoutError("a model with state layers only (no attention) is not supported by the adapter")
        cache = self.attention.describe(self.vllm_config, attention[0])  # first: it names a packing refused
        regions, block_len, pages = _kv_regions(kv_caches, num_blocks, self.state_layers)
        if self.block_size % pages:
            raise LayoutError(f"{pages} kernel pages do not divide a block of {self.block_size} tokens")
        page_size = self.block_size // pages
        first = regions[0]
        if first.device.type not in ("cpu", "cuda"):  # (ROCm's tensors say "cuda" too)
            raise UnsupportedSetting(
                f"KV caches on {first.device.type!r} devices are not supported by the adapter "
                "(CPU, CUDA and ROCm only): their memory would be registered as host memory"
            )
        if self.buffer_device not in _BUFFER_DEVICES[first.device.type]:
            # (as vLLM's NixlConnector: "CPU" or "host" on a GPU registered the device caches, unstaged)
            raise UnsupportedSetting(f"kv_buffer_device {self.buffer_device!r} with KV caches on {first.device.type!r}"
                                     f": use one of {_BUFFER_DEVICES[first.device.type]}")  # fmt: skip
        if first.device.type == "cuda" and self.buffer_device == "cpu":
            if self.state_layers:
                raise LayoutError("kv_buffer_device 'cpu' (host staging) with state (Mamba) layers is not supported")
            # Host staging: NIXL moves host copies; `wait_for_save` / receive copy to and from the device.
            self._device_caches = kv_caches
            self._host_caches = host_mirror(kv_caches)
            regions, block_len, pages = _kv_regions(self._host_caches, num_blocks)
            first = regions[0]
        mem_type, device = (MemType.VRAM, first.device.index or 0) if first.device.type == "cuda" else (MemType.DRAM, 0)
        self._sync_direct_receives = mem_type is MemType.VRAM and bool(self.state_layers) and _on_rocm()
        layout = BlockLayout.from_regions(
            LAYOUT, [r.data_ptr() for r in regions], num_blocks=num_blocks * pages, block_len=block_len,
            mem_type=mem_type, device_id=device, block_size=page_size,
        )  # fmt: skip
        self.sync.register_layout(layout)
        self._regions = regions
        self.geometry = KVGeometry(
            self.tp_size, self.tp_rank, page_size, layout.part_len, cache.run_len, self.use_mla,
            self.vllm_config.model_config.get_total_num_kv_heads(), cache.head_window, cache.ratio_refusal, pages,
            self.group_kinds, self._bytes_meaning, self.settings.enforce_compat,
        )  # fmt: skip
        self.sync.set_extra(block_size=str(page_size), pages_per_block=str(pages), tp_size=str(self.tp_size),
                            tp_rank=str(self.tp_rank), **dict(self._bytes_meaning))  # fmt: skip
        host, port = self.address = self._serve(self.settings.bind_host(), self.settings.side_channel_port)
        if self.settings.etcd is not None:
            self.sync.publish()  # readers find this rank by engine id (DiscoveryUnavailable: vLLM fails to start)
        log.info("nixl_async worker %s rank %d: %d layers x %d blocks of %d bytes, KV cache groups %s, serving %s:%d",
                 self.engine_id, self.tp_rank, len(regions), num_blocks, block_len, ",".join(self.group_kinds), host,
                 port)  # fmt: skip

    def _serve(self, host: str, base_port: int) -> tuple[str, int]:
        """Serve this rank's side channel at base + rank; a taken port says what to change."""
        try:
            return cast(tuple[str, int], self.sync.serve(host, base_port + self.tp_rank))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            raise OSError(exc.errno, _port_taken_hint(base_port, self.tp_size, self.tp_rank)) from exc

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self._copy_blocks = copy_operation

    # -- per step ---------------------------------------------------------------------------
    def start_load_kv(self, metadata: Any) -> None:
        """Hand this step's work to the loop; returns without waiting for any of it."""
        self._step_idle = metadata is not None and bool(getattr(metadata, "idle_step", False))
        if metadata is None:
            return
        self._track_sends(metadata)
        for request_id, req in metadata.reqs_to_recv.items():
            self._start_receive(request_id, req)
        for engine_id, info in getattr(metadata, "heartbeat_by_engine", {}).items():
            self._start_heartbeat(engine_id, info)

    def _track_sends(self, metadata: Any) -> None:
        """Producer side: which requests are computed for readers, and until when their blocks are held."""
        now = time.perf_counter()
        for request_id, deadline in metadata.reqs_to_send.items():  # the scheduler's clock, rebased on ours
            self._sends.hold(request_id, now + (deadline - metadata.scheduler_clock))
        self._sends.in_batch(metadata.reqs_in_batch)
        for request_id in metadata.reqs_not_processed:
            self._sends.drop(request_id)

    def _start_heartbeat(self, engine_id: str, info: Any) -> None:
        """Renew the leases of requests still waiting to read from `engine_id` (on the loop)."""
        try:
            ranks = remote_ranks(local_tp=self.tp_size, local_rank=self.tp_rank, remote_tp=int(info.tp_size))
        except Exception as exc:  # its reads fail the same way; never fail vLLM's step
            log.warning("no lease renewal with %s: %s", engine_id, exc)
            return
        port = int(info.port) if info.port else 0  # unset when producers are found through etcd
        addresses = [(info.host, port + rank if port else 0, rank_engine_id(engine_id, rank)) for rank in ranks]
        if engine_id in self._heartbeating:
            return  # the last round is still waiting on a slow or dead producer: no pile-up of rounds
        self._heartbeating.add(engine_id)
        self.sync.spawn(self._heartbeat_round, engine_id, addresses, sorted(info.req_ids))

    async def _heartbeat_round(self, engine: TransferEngine, engine_id: str, addresses: Any, ids: list[str]) -> None:
        def failed(exc: BaseException) -> None:
            log.warning("lease renewal with %s failed (%s): its requests keep the last acknowledged lease",
                        engine_id, exc)  # fmt: skip

        try:
            await heartbeat(engine, self._leases, engine_id, addresses, ids, on_failure=failed)
        finally:
            self._heartbeating.discard(engine_id)  # set.add/discard are atomic: no lock with the worker thread

    def _answer_renewal(self, _sender: str, payload: bytes) -> bytes:
        return answer_renewal(self._sends, payload, self._lease_extension_s)

    def _recv_job(self, request_id: str, req: Any, expires_at: float | None) -> RecvJob:
        """What a coroutine on the loop needs of vLLM's metadata for one request (`req.remote` set)."""
        remote = req.remote
        return RecvJob(
            request_id=request_id,
            remote_request_id=remote.request_id,
            remote_engine_id=remote.engine_id,
            host=remote.host or "",
            port=int(remote.port or 0),  # unset when producers are found through etcd
            remote_tp=int(req.tp_size),
            groups=self._group_blocks(req),
            expires_at=expires_at,
            num_tokens=None if remote.num_tokens is None else int(remote.num_tokens),
        )

    def _start_receive(self, request_id: str, req: Any) -> None:
        if req.remote is None:
            return
        job = self._readable_job(request_id, req, req.remote.blocks_expiry_time, req.awaiting_kvs)
        if job is not None:
            self._hand_over(job, req.awaiting_kvs, self._receive)

    def _readable_job(self, request_id: str, req: Any, expires_at: float | None,
                      awaited: bool | None) -> RecvJob | None:  # fmt: skip
        """`_recv_job`, or None once a job that cannot be read was handed over to fail alone: a client's
        kv_transfer_params the scheduler let through must fail that load, not vLLM's step (and engine).
        `awaited` None: vLLM awaits it if it has blocks."""
        try:
            return self._recv_job(request_id, req, expires_at)
        except Exception as exc:
            log.warning("request %s: its transfer parameters are unusable (%s: %s)", request_id, type(exc).__name__,
                        exc)  # fmt: skip
            local = tuple(GroupBlocks("full", [int(b) for b in ids], [], None) for ids in req.local_block_ids or ())
            job = RecvJob(request_id, "", "", "", 0, 1, local, None)
            self._hand_over(job, bool(job.local_blocks) if awaited is None else awaited, _unusable, exc)
            return None

    def _hand_over(self, job: RecvJob, awaited: bool, receive: Callable[..., Coroutine[Any, Any, None]],
                   *args: Any) -> bool:  # fmt: skip
        """Run ``receive(engine, job, *args)`` on the loop; once the facade took it, note the blocks vLLM waits on.

        False if it was not taken (the same request is still being received, or its outcome is not
        reported yet: the repeat's blocks would be taken for the first run's).
        """
        if job.request_id in self._awaiting:
            log.warning("request %s is already being received; ignoring the repeat", job.request_id)
            return False
        try:
            self.sync.submit(job.request_id, receive, job, *args)
        except ValueError:  # the same request is still in flight (vLLM re-sent it): keep the first, and its blocks
            log.warning("request %s is already being received; ignoring the repeat", job.request_id)
            return False
        if awaited:  # (read only by this thread's get_transfer_results: the outcome cannot come first)
            self._awaiting[job.request_id] = job.local_blocks
        return True

    def _group_blocks(self, req: Any) -> tuple[GroupBlocks, ...]:
        """Each transfer group's blocks of `req` (empty lists for a full prefix hit)."""
        local, remote = req.local_block_ids or (), req.remote.block_ids or ()
        hits = req.local_num_computed_blocks  # per KV cache group, transferring or not
        group_ids = self.kv_cache_config.transfer_group_ids
        return tuple(
            GroupBlocks(
                kind, [int(b) for b in local[i]] if local else [], [int(b) for b in remote[i]] if remote else [],
                int(hits[group_ids[i]]) if hits else None,
            )
            for i, kind in enumerate(self.group_kinds)
        )  # fmt: skip

    async def _receive(self, engine: TransferEngine, job: RecvJob) -> None:
        if self.geometry is None:
            raise LayoutError("register_kv_caches() has not run")
        lease = self._leases.reading(job.remote_engine_id, job.remote_request_id, job.expires_at,
                                     self._lease_margin_s)  # fmt: skip
        try:
            results = await receive(engine, self.geometry, job, lease=lease, notice_failed=self._notice_failed)
            for result in results:
                self._results.put(result)
        finally:
            self._leases.forget(job.remote_engine_id, job.remote_request_id)

    def _notice_failed(self, error: NotificationFailed) -> None:
        """(On the loop) a producer rank was not told we are done: counted as vLLM counts it."""
        self._loop_failures.put("num_failed_notifications")

    def wait_for_save(self, metadata: Any) -> None:
        """Host staging only: copy the blocks a producer just computed to the registered host copy."""
        if not self._host_caches:
            return
        copy = self._staging_copy()
        for req in metadata.reqs_to_save.values() if metadata is not None else ():
            ids = self._staged_pages([int(b) for group in req.local_block_ids for b in group])
            if ids:
                copy(self._device_caches, self._host_caches, ids, ids, "d2h")

    def _staging_copy(self) -> Any:
        """vLLM's block copy op, which host staging needs (without it a reader would get stale host bytes,
        or vLLM stale device KV, reported received)."""
        if self._copy_blocks is None:
            raise RuntimeError("host staging (kv_buffer_device='cpu' with CUDA caches) needs vLLM's block copy op, "
                               "and set_host_xfer_buffer_ops() was never called by this model runner")  # fmt: skip
        return self._copy_blocks

    def _staged_pages(self, blocks: list[int]) -> list[int]:
        """The cache rows of logical `blocks`: vLLM's copy op indexes kernel pages, as NixlConnector maps them."""
        return kernel_pages(blocks, self.geometry.pages_per_block if self.geometry else 1)

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving) since the last step."""
        recving, failed = set(), set()
        copy = self._staging_copy() if self._host_caches else None  # (raises before any outcome is taken)
        self._wait_if_idle()
        finished = self._own_finished(self.sync.get_finished())
        for request_id in finished.done:
            blocks = self._awaiting.pop(request_id, None)
            if blocks is not None:
                if copy is not None and blocks:
                    pages = self._staged_pages(blocks)
                    copy(self._host_caches, self._device_caches, pages, pages, "h2d")
                recving.add(request_id)
        for request_id, error in finished.fenced.items():
            # NIXL still holds a read into this request's blocks: keep them out of vLLM's hands
            # (the request stays "receiving") until the facade reports it failed, once quiet.
            log.warning("KV load for request %s ended (%s) but its blocks are fenced until NIXL lets go",
                        request_id, type(error).__name__)  # fmt: skip
        for request_id, error in finished.failed.items():
            log.warning("KV load for request %s failed: %s: %s", request_id, type(error).__name__, error)
            self._record_failure(error)
            blocks = self._awaiting.pop(request_id, None)
            if blocks is not None:
                if len(self.kv_cache_config.kv_cache_groups) == 1:
                    # Block ids are unique only within a group: with several, vLLM takes the
                    # request alone (failed_recving) and stops its engine on block ids.
                    self._invalid_blocks.update(blocks)
                recving.add(request_id)
                failed.add(request_id)
        if self._sync_direct_receives and recving - failed:
            # ROCm with state (Mamba) layers: NIXL's writes into device memory are made visible to the
            # next step's kernels only by a device synchronize (vLLM's worker does the same)
            torch.accelerator.synchronize()
        return self._finished_sending(), recving, failed

    def _wait_if_idle(self) -> None:
        """A step that scheduled nothing, while transfers are under way: wait for one to end (or a reader's
        notification) instead of returning at once. vLLM steps such an engine back to back; on a machine
        whose cores are shared, that spinning takes the CPU the transfer or the other server needs."""
        plan = idle_step_wait(self.settings.idle_step_wait_s, step_idle=self._step_idle,
                              serving=self._sends.expecting_readers, in_flight=bool(self.sync.in_flight),
                              poke_for_ours=self.IDLE_POKES_FOR_OWN_REQUESTS)  # fmt: skip
        if plan is not None:
            with contextlib.suppress(EngineClosedError):  # (shutting down: nothing to wait for)
                self.sync.wait_activity(plan.seconds, poke_every=plan.poke_every_s)

    def _own_finished(self, finished: FinishedRequests) -> FinishedRequests:
        """The requests this worker receives (a subclass takes out work of its own)."""
        return finished

    def _release(self, request_id: str, expired: bool) -> bool:
        """Whether a read (or, `expired`, lease-expired) request's blocks may go back to vLLM now (a subclass may
        hold them)."""
        return True

    def _finished_sending(self) -> set[str]:
        if self._sends.expecting_readers:
            # Readers' operations can wait on our UCX worker (it acknowledges their notifications):
            # progress it once per step while anyone may read from us, as vLLM's own worker does.
            self.sync.poke()
        for note in _drain(self._notifications):
            if note.message.startswith((PUSH_PREFIX, PUSH_FAILED_PREFIX)):
                continue  # a push's completion or failure: its request's waiter took it
            if not self._sends.notified(note.message):
                log.warning("ignoring notification %r from %s: no such request is held", note.message, note.sender)
                self._record("num_notifications_after_expiry", 1)
        read, expired = self._sends.collect(time.perf_counter(), release=self._release)
        for request_id in expired:
            log.warning("request %s: reader did not finish within the lease; freeing its blocks", request_id)
            self._record("num_kv_expired_reqs", 1)
        return read | expired

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks, self._invalid_blocks = self._invalid_blocks, set()
        return blocks

    # -- stats -------------------------------------------------------------------------------
    def _stats_object(self) -> Any:
        if self._stats is None:
            from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

            self._stats = NixlKVConnectorStats()
        return self._stats

    def _record(self, key: str, value: float) -> None:
        self._stats_object().data[key].append(value)

    def _record_failure(self, error: BaseException) -> None:
        kind = _failure_kind(error)
        if kind == "num_failed_handshakes":
            if any(error is counted for counted in self._counted_handshake_errors):
                return
            self._counted_handshake_errors.append(error)
        self._record(kind, 1)

    def get_kv_connector_stats(self) -> Any:
        stats = self._stats_object()
        for result in _drain(self._results):
            stats.data["transfer_duration"].append(result.wire_seconds)  # NIXL's time, not queueing
            stats.data["post_duration"].append(result.post_seconds)
            stats.data["bytes_transferred"].append(result.nbytes)
            stats.data["num_descriptors"].append(result.descriptors)
        for series in _drain(self._loop_failures):
            stats.data[series].append(1)
        return None if stats.is_empty() else stats.clone_and_reset()

    def shutdown(self) -> None:
        self.sync.close()


LEASE_MARGIN_S = 2.0  # at most: a read must be done this long before the producer's lease ends


# While an idle step waits: progress our UCX worker this often (see `idle_step_wait`).
IDLE_POKE_S = 0.00025


_T = TypeVar("_T")


def _drain(items: queue.SimpleQueue[_T]) -> Iterator[_T]:
    """What another thread put in `items` so far."""
    while True:
        try:
            yield items.get_nowait()
        except queue.Empty:
            return


@dataclass(frozen=True)
class IdleWait:
    """How long an idle step waits for transfers, and how often it has the loop progress NIXL meanwhile."""

    seconds: float
    poke_every_s: float | None  # None: the poller's own pace


def idle_step_wait(
    wait_s: float, *, step_idle: bool, serving: bool, in_flight: bool, poke_for_ours: bool = True
) -> IdleWait | None:
    """How a step's end waits for transfers, or None: return to vLLM at once.

    Only a step that scheduled nothing waits (`AdapterSettings.idle_step_wait_s`), and only while
    transfers may move: requests of ours in flight, or readers' operations on our memory
    (`serving`). Meanwhile the loop is poked every `IDLE_POKE_S`. The model thread has nothing
    to do then, so progressing NIXL briskly takes nothing from it; the poller alone checks an
    in-flight read only every `PollConfig.busy_interval_s` (1 ms), and a reader's operation over
    TCP waits for our worker to be progressed. Measured on two hosts (network namespaces, UCX
    over TCP, README scenario 9, 60 prompts at c=1): decode's KV load (the step handing a request
    over -> the step reporting it) p50 2.0 -> 1.24-1.40 ms in five runs of six, against
    NixlConnector's 2.0-2.1 ms; the full benchmark showed it in two runs of four (median 0.98x).
    `poke_for_ours=False` waits for our own requests at the poller's pace (push mode: not measured).
    """
    if not (wait_s and step_idle and (serving or in_flight)):
        return None
    return IdleWait(wait_s, IDLE_POKE_S if serving or poke_for_ours else None)


async def _unusable(_engine: TransferEngine, _job: RecvJob, error: Exception) -> None:
    """A load whose parameters could not be read: it fails (its request is then recomputed or failed, by policy)."""
    raise error


async def _start_leased_read(
    engine: TransferEngine, lease: RequestLease, peer: Peer, local_blocks: Any, remote_blocks: Any, **options: Any
) -> Transfer:
    """Start a read under the request's lease. A renewal reaches reads once started; one that came
    while this read waited for room (backpressure) and outran the lease it was given, lets it wait again."""
    while True:
        read_by = lease.read_by
        try:
            transfer = await engine.start_read(peer, local_blocks, remote_blocks, lease_expires_at=read_by, **options)
        except LeaseExpired:
            renewed = lease.read_by
            if read_by is None or renewed is None or renewed <= read_by or renewed <= time.time():
                raise
            continue
        if read_by is not None and (renewed := lease.read_by) is not None and renewed != read_by:
            engine.renew_lease([transfer], renewed)  # renewed while it waited: the next round may come too late
        return transfer


def _failure_kind(error: BaseException) -> str:
    """The NixlKVConnectorStats series a failed load counts in (vLLM's names)."""
    if isinstance(error, HandshakeError):
        return "num_failed_handshakes"
    if isinstance(error, NotificationFailed):
        return "num_failed_notifications"
    if isinstance(error, LeaseExpired):
        return "num_kv_expired_reqs"
    return "num_failed_transfers"


@dataclass(frozen=True)
class RequestPlan:
    """How one request's blocks move between this rank and its producer's ranks."""

    steps: list[RankRead]  # per producer rank
    ratio: int  # producer blocks per local block
    paged: bool  # block ids are kernel pages
    groups: tuple[GroupBlocks, ...]  # the request's blocks per KV cache group (in kernel pages when paged)


# What a block's bytes mean beyond vLLM's hash (see `_compat`): compared even with the hash's opt-out.
# (The state dtypes stay in the hash alone: published as configured, "auto" and the dtype it stands for differ.)
BYTES_MEANING_KEYS = ("kv_cache_layout", "cpu_attn_isa", "ssm_conv_state_layout")
# Published since session 40 (outside the compatibility hash, which they would change for older peers): compared
# when the peer publishes them. A FlashAttention block and a two-plane one can be the same size in the same layout,
# as can fp8 e4m3 and e5m2, or bf16 and fp16 blocks. (FlashAttention and Triton blocks are the same bytes: one class.)
LATER_MEANING_KEYS = ("attention_packing", "kv_cache_dtype")
_DTYPE_SPELLINGS = {"fp8": "fp8_e4m3", "half": "float16", "float": "float32"}  # (vLLM's aliases, one name each)


def _packing_meaning(vllm_config: Any, attention: AttentionChoice) -> tuple[tuple[str, str], ...]:
    """The attention packing's class and the KV cache's element type, as `LATER_MEANING_KEYS`: spelled one way
    for one meaning ("auto" is the model's dtype, "torch.bfloat16" and "bfloat16" one type, "fp8" vLLM's e4m3)."""
    model = vllm_config.model_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    dtype = (str(model.dtype) if cache_dtype == "auto" else cache_dtype).removeprefix("torch.")
    dtype = _DTYPE_SPELLINGS.get(dtype, dtype)
    return ("attention_packing", packing_class(attention.backend, bool(model.use_mla))), ("kv_cache_dtype", dtype)


def _on_rocm() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_rocm())


def _port_taken_hint(base: int, tp_size: int, rank: int) -> str:
    """Why a rank's side-channel port may be taken: vLLM's NixlConnector listens once per instance, at
    base + dp_index, so its docs put two instances on one host one port apart; we listen once per rank."""
    return (f"port {base + rank} (VLLM_NIXL_SIDE_CHANNEL_PORT {base} + TP rank {rank}) is taken: nixl_async serves "
            f"one side channel per TP rank, ports {base}..{base + tp_size - 1} here, so instances on one host need "
            f"VLLM_NIXL_SIDE_CHANNEL_PORT values at least their TP size apart (NixlConnector's 1 apart is not enough "
            "from TP 2 on)")  # fmt: skip


def check_bytes_meaning(geometry: KVGeometry, first: Peer) -> None:
    """`LayoutError` unless peer rank `first`'s blocks mean here what they mean there: cache layout (not
    with MLA, whose one latent "head" makes LBHNC and LBNHC the same bytes), CPU ISA, state layout, attention
    packing and KV element type.
    ``enforce_handshake_compat: false`` skips vLLM's hash; vLLM still compares the layout after it, and
    so do we, these too: an LBHNC block read into an LBNHC cache holds tokens and heads transposed."""
    if geometry.compat_enforced and not any(key in first.extra for key, _ in geometry.bytes_meaning):
        return  # (an adapter from before these were published: the enforced hash compared them)
    for key, ours in geometry.bytes_meaning:
        if key == "kv_cache_layout" and geometry.mla:
            continue
        theirs = first.extra.get(key)
        if theirs is None and key in LATER_MEANING_KEYS:
            continue  # (an adapter from before they were published)
        if theirs != ours:
            said = "is not published" if theirs is None else f"is {theirs!r}"
            raise LayoutError(f"engine {first.engine_id!r}'s {key} {said}, ours is {ours!r}: its blocks cannot be "
                              "used here (checked even with enforce_handshake_compat off)")  # fmt: skip


def plan_request(geometry: KVGeometry, job: RecvJob, first: Peer) -> RequestPlan:
    """Plan `job` from the layout of one producer rank (`first`; every rank has the same geometry).

    Raises `LayoutError` for what cannot be read correctly (block sizes that do not divide,
    head windows of a packing that has none, state groups across unequal TP...).
    """
    check_bytes_meaning(geometry, first)
    remote_pages = int(first.extra.get("pages_per_block", "1"))
    paged = geometry.pages_per_block > 1 or remote_pages > 1
    groups = job.groups
    remote_block_size = int(first.extra.get("block_size", geometry.block_size))  # (a kernel page's tokens)
    if paged:  # read kernel pages: block sizes, ratios and head windows below are a page's
        # Pages of other token counts on each side, no prefix hit: pairable from the end once each side is cut to
        # its prompt pages, which needs the prompt's length (refused without it).
        same = remote_block_size == geometry.block_size or job.num_tokens is not None
        groups = tuple(in_kernel_pages(g, geometry.pages_per_block, remote_pages, same_page_tokens=same)
                       for g in groups)  # fmt: skip
        if remote_block_size != geometry.block_size and job.num_tokens is not None and remote_block_size > 0:
            groups = tuple(
                full_pages_of_prompt(g, job.num_tokens, geometry.block_size, remote_block_size,
                                     geometry.pages_per_block, remote_pages)
                if g.kind == "full" and g.local_hit is None else g
                for g in groups
            )  # fmt: skip
        groups = tuple(
            window_pages_of_prompt(g, job.num_tokens, geometry.block_size, geometry.pages_per_block, remote_pages)
            if g.kind == "window" else g
            for g in groups
        )  # fmt: skip
    remote_layout = first.layout(LAYOUT)
    if remote_block_size <= 0 or geometry.block_size % remote_block_size:
        raise LayoutError(f"remote block size {remote_block_size} does not divide ours ({geometry.block_size})")
    ratio = geometry.block_size // remote_block_size
    if ratio > 1 and geometry.ratio_refusal:
        raise LayoutError(f"remote blocks of {remote_block_size} tokens cannot fill ours of {geometry.block_size}: "
                          f"{geometry.ratio_refusal}")  # fmt: skip
    if ratio > 1 and len(groups) > 1:
        raise LayoutError(f"remote blocks of {remote_block_size} tokens cannot fill ours of {geometry.block_size} "
                          "with several KV cache groups (hybrid models need equal block sizes)")  # fmt: skip
    if "state" in geometry.group_kinds and job.remote_tp != geometry.tp_size:
        raise LayoutError(f"TP {job.remote_tp} -> {geometry.tp_size}: state (Mamba / linear attention) groups need "
                          "equal TP on both sides, as vLLM requires")  # fmt: skip
    plan = plan_reads(
        local_tp=geometry.tp_size, local_rank=geometry.tp_rank, remote_tp=job.remote_tp, mla=geometry.mla,
        kv_heads=geometry.kv_heads, local_part_len=geometry.part_len, remote_part_len=remote_layout.part_len * ratio,
    )  # fmt: skip
    if not geometry.head_window and any(s.local != ViewSpec() or s.remote != ViewSpec() for s in plan if s.read):
        raise no_head_window(job.remote_tp, geometry.tp_size)
    return RequestPlan(plan, ratio, paged, groups)


async def receive(
    engine: TransferEngine,
    geometry: KVGeometry,
    job: RecvJob,
    *,
    lease_margin_s: float = LEASE_MARGIN_S,
    notice_failed: Callable[[NotificationFailed], None] | None = None,
    lease: RequestLease | None = None,
) -> list[TransferResult]:
    """Pull one request on the engine's loop: handshake, plan from the producer's layout, read, notify.

    Every producer rank this rank reads (or, for MLA siblings and full prefix hits, only
    notifies) hears ``"{remote_request_id}:{readers}"`` once this rank is done with it. If any
    part fails, every other part is cancelled and settled (NIXL holds none of their handles)
    before the error is raised: vLLM may reuse the request's blocks as soon as it hears of it.
    Each producer rank connected and not told yet is then told all the same, also when the
    failure came before any read (nothing reads its blocks any more, and vLLM reads no request
    twice), so it frees them at once instead of at its lease's end; unless that lease has ended
    (it freed them). A notice that cannot be sent fails nothing (the data is here; that rank
    frees its blocks when its lease ends, as with vLLM's connector): it is logged and given to
    `notice_failed`. `lease` (default: ``job.expires_at`` less `lease_margin_s`, never renewed)
    is the request's lease as the worker's heartbeats renew it: reads start within its latest
    word and are kept in it for renewals to reach.
    """
    if lease is None:
        lease = RequestLease(job.expires_at, lease_margin_s)
    notify = f"{job.remote_request_id}:{expected_consumers(remote_tp=job.remote_tp, local_tp=geometry.tp_size)}"
    message = notify.encode()

    def untold(error: NotificationFailed) -> None:
        log.warning("request %s: telling producer %s its blocks are free failed (%s); it frees them when the lease "
                    "ends", job.request_id, error.peer, error)  # fmt: skip
        if notice_failed is not None:
            notice_failed(error)

    told = lease.told  # producer ranks told (or tried): each hears from this rank once
    reached: list[Peer] = []  # producer ranks of the request's plan, connected

    async def tell(peer: Peer) -> None:
        told.add(peer.engine_id)  # (it may free the blocks and answer renewals "gone" from now on)
        try:
            await engine.notify(peer, message)
        except NotificationFailed as error:
            untold(error)

    async def connect_all(ranks: Sequence[int]) -> list[Peer]:
        """Connect to every rank at once; those that answer are `reached` even when another fails."""
        outcomes = await asyncio.gather(*(connect_job_rank(engine, job, r) for r in ranks), return_exceptions=True)
        reached.extend(o for o in outcomes if isinstance(o, Peer))
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return cast(list[Peer], outcomes)

    ranks = remote_ranks(local_tp=geometry.tp_size, local_rank=geometry.tp_rank, remote_tp=job.remote_tp)
    results: list[TransferResult] = []
    started = lease.reads  # (renewals reach them there)
    carries_notice = lease.notice_reads  # producer rank -> its one READ, which notifies it once landed

    async def one_rank(step: RankRead, peer: Peer) -> None:
        if not step.read:  # an MLA sibling: its copy is not read, only freed
            await tell(peer)
            return
        parts = split_for_block_ratio(step, local_blocks, remote_blocks, ratio=ratio,
                                      local_part_len=geometry.part_len, run_len=geometry.run_len)  # fmt: skip
        piggyback = message if len(parts) == 1 else None  # else one notification after all parts
        mine = []
        for p in parts:
            transfer = await _start_leased_read(engine, lease, peer, p.local_blocks, p.remote_blocks, local=p.local,
                                                remote=p.remote, notify=piggyback)  # fmt: skip
            started.append(transfer)
            mine.append(transfer)
        if piggyback is None:
            results.extend(await asyncio.gather(*mine))
            await tell(peer)
            return
        carries_notice[peer.engine_id] = mine[0]
        try:
            results.append(await mine[0])
        except NotificationFailed as error:
            if error.result is None:
                raise
            results.append(error.result)  # the data arrived
            untold(error)

    async def give_up(error: BaseException) -> None:
        """Settle every read, then tell the producer ranks not told yet that their blocks are free."""
        if not await engine.settle(started, timeout=engine.config.release_grace_s + 0.5):
            # The facade reports the request only once these are quiet; the producers hear then too
            # (before, never: each held the blocks until its lease ended).
            log.error("request %s: NIXL still holds reads into its blocks after cancelling them", job.request_id)
            if not all(await asyncio.gather(*(t.wait_quiet() for t in started))):
                return  # the engine closed with NIXL holding some: they stay fenced
        if isinstance(error, LeaseExpired) or (lease.expires_at is not None and time.time() >= lease.expires_at):
            return  # (the producer freed them when the lease ended: a notice now would count as a stray one)
        for engine_id, transfer in carries_notice.items():
            if transfer.done() and isinstance(transfer.exception(), NotificationFailed | None):
                told.add(engine_id)  # it landed, so its notice went (or was tried)
        for peer in reached:
            if peer.engine_id in told:
                continue
            told.add(peer.engine_id)
            try:  # best effort, and no failed notification of its own: the failure is the read's
                await engine.notify(peer, message)
            except Exception as exc:
                log.info("request %s: could not tell producer %s its blocks are free after the failure (%s: %s); "
                         "it frees them when its lease ends", job.request_id, peer.engine_id, type(exc).__name__,
                         exc)  # fmt: skip

    # One rank is connected (a held peer answers at once) and read without a gather or task of its
    # own: each is one more turn of the loop before the post, and at each turn the loop thread may
    # lose the GIL to the model thread (vLLM decode, tiny model over TCP, c=4, two alternating runs
    # each: from the facade running the request to the post 0.37 -> 0.26 ms p50, 0.7-1.1 -> 0.4 p90).
    # A failure before any read (a rank unreachable, a layout refused) still tells the ranks reached.
    try:
        if not job.local_blocks:  # nothing to read (a full prefix hit, an aborted request): only let them free
            for peer in await connect_all(ranks):
                await tell(peer)
            return []
        first = await connect_job_rank(engine, job, ranks[0])  # every producer rank has the same geometry
        reached.append(first)
        plan = plan_request(geometry, job, first)
        ratio, paged = plan.ratio, plan.paged
        local_blocks, remote_blocks = [], []  # every group's pairs; one read per rank carries them all
        for blocks in plan.groups:
            local, remote = pair_blocks(blocks, ratio, paged=paged)
            local_blocks += local
            remote_blocks += remote
        if len(plan.steps) == 1:
            step = plan.steps[0]
            peer = await connect_job_rank(engine, job, step.remote_rank)
            reached.append(peer)
            await one_rank(step, peer)
        else:
            peers = await connect_all([step.remote_rank for step in plan.steps])
            async with asyncio.TaskGroup() as group:
                for step, peer in zip(plan.steps, peers, strict=True):
                    group.create_task(one_rank(step, peer))
    except BaseExceptionGroup as group_error:  # callers want the typed error, not a group
        await give_up(group_error.exceptions[0])
        raise group_error.exceptions[0] from None
    except Exception as error:
        await give_up(error)
        raise
    return results


async def connect_job_rank(engine: TransferEngine, job: RecvJob, rank: int) -> Peer:
    return await connect_rank(engine, job.host, job.port + rank if job.port else 0,
                              rank_engine_id(job.remote_engine_id, rank))  # fmt: skip


def _compat(vllm_config: Any, attention: AttentionChoice, transfer_mode: str, *, has_state: bool = False
            ) -> dict[str, str]:  # fmt: skip
    """What must agree between producer and reader (TP size and block size may differ).

    vLLM's own hash (model, dtype, KV heads, head size, layers, attention backend, cache dtype,
    hybrid manager, speculative decoding), plus the cache layout and the CPU backend's ISA, which
    change what a block's bytes mean. With Mamba state layers, also the conv state's layout
    (``VLLM_SSM_CONV_STATE_LAYOUT``): state pages are copied as they are, and pages of equal size
    in the other layout hold it transposed. (vLLM's own worker requires DS, so its hash leaves it out.)
    And the state's dtypes (``mamba_cache_dtype``, ``mamba_ssm_cache_dtype``), which vLLM's hash leaves
    out too: a small state padded to the attention page keeps block and page sizes whatever its dtype.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import compute_nixl_compatibility_hash

    vllm_hash = compute_nixl_compatibility_hash(vllm_config, attention.backend, transfer_mode=transfer_mode)
    compat = {"vllm": vllm_hash, "kv_cache_layout": attention.layout, "cpu_attn_isa": attention.isa or ""}
    if has_state:
        from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

        compat["ssm_conv_state_layout"] = str(get_conv_state_layout())
        cache = getattr(vllm_config, "cache_config", None)
        compat["mamba_cache_dtype"] = str(getattr(cache, "mamba_cache_dtype", "auto"))
        compat["mamba_ssm_cache_dtype"] = str(getattr(cache, "mamba_ssm_cache_dtype", "auto"))
    return compat
