"""`kv_layout.describe_cache` on the views vLLM 0.32 itself builds for each attention backend.

The views come from vLLM's own allocator code (`create_kv_cache_views` with each backend's
customized spec and each layout it accepts), so shapes and strides are exactly what a GPU server
hands the connector. Where the adapter claims a head slab is ``[tokens, K|V]``, vLLM's own K/V
accessor (``kv_cache.transpose(1, 2).split(head_size, -1)``) is checked to agree, byte offsets
against the claimed run.
"""

from __future__ import annotations

import os

import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")

import torch
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.worker.utils import customize_attention_spec

from nixl_async import LayoutError
from nixl_async_vllm.kv_layout import SHUFFLED_AITER_FA, describe_cache, packing_name

BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, LAYERS = 8, 32, 4, 64, 2


def _views(backend: str, layout: str, mla: bool = False) -> tuple[str, torch.Tensor]:
    """(vLLM's backend name, layer 0's view) as vLLM allocates it."""
    cls = getattr(AttentionBackendEnum, backend).get_class()
    if mla:
        spec = MLAAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=576, dtype=torch.bfloat16,
                                cache_dtype_str="auto")  # fmt: skip
    else:
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    spec = customize_attention_spec(cls, spec)
    kv_layout = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, BLOCKS, LAYERS, kv_layout,
        fixed_strides=(None, spec.page_size_bytes * LAYERS if kv_layout.is_block_outermost else None, None, None, None),
    )  # fmt: skip
    size = spec.page_size_bytes * BLOCKS * LAYERS
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(LAYERS)], layer_stride=layer_stride,
                           block_stride=block_stride)  # fmt: skip
    views = create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, BLOCKS, kv_layout, tensor)
    return cls.get_name(), next(iter(views.values())) if isinstance(views, dict) else views[0]


def _describe(name: str, view: torch.Tensor, layout: str, mla: bool = False):
    return describe_cache(name, layout, tuple(view.shape), tuple(view.stride()), view.element_size(),
                          num_kv_heads=1 if mla else HEADS, mla=mla, isa="vec")  # fmt: skip


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "ROCM_AITER_UNIFIED_ATTN"])
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
def test_per_token_kv_backends_match_vllms_own_k_and_v(backend, layout):
    name, view = _views(backend, layout)
    cache = _describe(name, view, layout)
    elem = view.element_size()
    assert cache.block_len == HEADS * BLOCK_SIZE * 2 * HEAD_DIM * elem
    key, value = view.transpose(1, 2).split(HEAD_DIM, dim=-1)  # vLLM's accessor: [blocks, tokens, heads, dim]
    base = view[0].data_ptr()
    for h, t in [(0, 0), (1, 5), (3, BLOCK_SIZE - 1)]:
        k_at, v_at = key[0, t, h].data_ptr() - base, value[0, t, h].data_ptr() - base
        assert v_at - k_at == HEAD_DIM * elem  # K then V for one (head, token)
        if layout == "LBHNC":  # head slab h holds its tokens in order: the run the ratio cuts
            assert cache.head_window and k_at == h * cache.run_len + t * 2 * HEAD_DIM * elem
        else:  # token-major: a block's first tokens are its first bytes, heads interleaved
            assert not cache.head_window and cache.run_len is None
            assert k_at == (t * HEADS + h) * 2 * HEAD_DIM * elem


def test_cpu_backend_reads_whole_blocks_and_head_windows_but_refuses_a_block_size_ratio():
    name, view = _views("CPU_ATTN", "LBHNC")
    cache = _describe(name, view, "LBHNC")
    assert name == "CPU_ATTN" and cache.head_window and cache.ratio_refusal and "ISA" in cache.ratio_refusal
    assert cache.isa == "vec"


@pytest.mark.parametrize("backend", ["ROCM_ATTN", "B12X"])
def test_two_plane_backends_refuse_head_windows_and_ratios(backend):
    name, view = _views(backend, "LBHNC")
    assert view.shape[1] == 2  # K and V planes, not heads
    cache = _describe(name, view, "LBHNC")
    assert not cache.head_window and cache.ratio_refusal


def test_rocm_aiter_fa_with_the_shuffled_cache_is_read_as_two_planes(monkeypatch):
    """vLLM names ROCm AITER FA "FLASH_ATTN"; with the shuffled KV cache its block holds K and V planes
    re-tiled by the kernel, which a two-head FLASH_ATTN view looks like: no head windows, no ratio."""
    from vllm._aiter_ops import rocm_aiter_ops

    cls = AttentionBackendEnum.ROCM_AITER_FA.get_class()
    assert cls.get_name() == "FLASH_ATTN" and packing_name(cls) == "FLASH_ATTN"  # shuffle off: vLLM's packing
    monkeypatch.setattr(rocm_aiter_ops, "is_shuffle_kv_cache_enabled", classmethod(lambda _: True))
    _, view = _views("ROCM_AITER_FA", "LBHNC")
    assert view.shape[1] == 2  # K and V planes, not heads
    assert packing_name(cls) == SHUFFLED_AITER_FA
    cache = _describe(packing_name(cls), view, "LBHNC")
    assert not cache.head_window and cache.ratio_refusal


@pytest.mark.parametrize("backend", ["TRITON_MLA", "FLASHMLA"])
def test_mla_backends_are_token_major(backend):
    name, view = _views(backend, "LBHNC", mla=True)
    cache = _describe(name, view, "LBHNC", mla=True)
    assert cache.run_len is None and cache.ratio_refusal is None and cache.block_len == BLOCK_SIZE * 576 * 2


def test_packed_layouts_are_refused_and_unknown_packings_read_whole_blocks_only():
    """Before session 40 an unknown backend, FlashInfer with nvfp4 (2 x heads slots: all K heads, then all V) and
    ULTRAQUANT were refused at registration (vLLM failed to start) though whole blocks of one packing are exact,
    as NixlConnector reads them; now only heterogeneous TP and a block-size ratio are refused, by name."""
    name, view = _views("FLASH_ATTN", "BLHNC")
    with pytest.raises(LayoutError, match="BLHNC"):
        _describe(name, view, "BLHNC")
    name, view = _views("FLASH_ATTN", "LBHNC")
    unknown = _describe("SOME_NEW_BACKEND", view, "LBHNC")
    assert not unknown.head_window and unknown.run_len is None and "SOME_NEW_BACKEND" in unknown.ratio_refusal
    assert unknown.block_len == view[0].numel() * view.element_size()
    nvfp4 = torch.zeros(BLOCKS, 2 * HEADS, BLOCK_SIZE, 36, dtype=torch.uint8)  # (K heads, then V heads) x tokens
    cache = describe_cache("FLASHINFER", "LBHNC", tuple(nvfp4.shape), tuple(nvfp4.stride()), 1, num_kv_heads=HEADS,
                           mla=False)  # fmt: skip
    assert not cache.head_window and "8 head slots for 4 KV heads" in cache.ratio_refusal
    ultra = torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, 144, dtype=torch.uint8).permute(0, 2, 1, 3)  # LBNHC: tokens outer
    cache = describe_cache("ULTRAQUANT", "LBNHC", tuple(ultra.shape), tuple(ultra.stride()), 1, num_kv_heads=HEADS,
                           mla=False)  # fmt: skip
    assert cache.ratio_refusal is None and cache.run_len is None and not cache.head_window


def test_backends_storing_a_slot_alike_share_a_packing_class_and_dtypes_have_one_spelling():
    """What readers compare under ``enforce_handshake_compat: false``: a FlashAttention block reads right into a
    Triton cache (the same bytes, as vLLM allows), a two-plane one or a quantizing one's does not; "auto", "bfloat16"
    and "torch.bfloat16" are one element type, "fp8" vLLM's e4m3 (a review of session 40's first version, which
    compared backend names and dtype strings as given)."""
    from types import SimpleNamespace

    from nixl_async_vllm.kv_layout import packing_class
    from nixl_async_vllm.worker import AttentionChoice, _packing_meaning

    assert packing_class("FLASH_ATTN", False) == packing_class("TRITON_ATTN", False) == "kv_per_token_slot"
    assert packing_class("ROCM_ATTN", False) == "ROCM_ATTN" and packing_class("TURBOQUANT", False) == "TURBOQUANT"
    assert packing_class("TRITON_MLA", True) == packing_class("FLASHMLA", True) == "mla"

    def meaning(cache_dtype: str, backend: str = "FLASH_ATTN") -> dict[str, str]:
        config = SimpleNamespace(cache_config=SimpleNamespace(cache_dtype=cache_dtype),
                                 model_config=SimpleNamespace(dtype=torch.bfloat16, use_mla=False))  # fmt: skip
        return dict(_packing_meaning(config, AttentionChoice(backend, "LBHNC", None)))

    assert meaning("auto") == meaning("bfloat16") == {"attention_packing": "kv_per_token_slot",
                                                      "kv_cache_dtype": "bfloat16"}  # fmt: skip
    assert meaning("fp8")["kv_cache_dtype"] == meaning("fp8_e4m3")["kv_cache_dtype"] == "fp8_e4m3"
    assert meaning("fp8_e5m2")["kv_cache_dtype"] == "fp8_e5m2"
    assert meaning("auto", "TRITON_ATTN") == meaning("auto", "FLASH_ATTN") != meaning("auto", "ROCM_ATTN")


@pytest.mark.parametrize("layout", ["BLHNC", "BHLNC"])
def test_registering_a_block_outermost_layout_names_the_layout(layout):
    """The worker names the layout it refuses; before, its check of dense equal blocks ran first and blamed
    a layer ("blocks must be dense and of equal size"), never saying what to change."""
    from types import SimpleNamespace

    from nixl_async_vllm.worker import AttentionChoice, ConnectorWorker

    name, view = _views("FLASH_ATTN", layout)
    worker = ConnectorWorker.__new__(ConnectorWorker)  # what register_kv_caches reads, without a vLLM server
    worker.kv_cache_config = SimpleNamespace(num_blocks=BLOCKS)
    worker.state_layers = frozenset()
    worker.attention = AttentionChoice(name, layout, None)
    worker.vllm_config = SimpleNamespace(model_config=SimpleNamespace(get_num_kv_heads=lambda _: HEADS, use_mla=False),
                                         parallel_config=None)  # fmt: skip
    with pytest.raises(LayoutError, match=f"KV cache layout {layout}: only the layer-compact layouts"):
        worker.register_kv_caches({"l0": view, "l1": view})


def test_host_staging_mirrors_vllms_one_buffer_once_unpinned_and_aliased_as_the_device_views(monkeypatch):
    """vLLM 0.32 backs every layer with one buffer: the host copy is one allocation of its exact size,
    not pinned (torch's pinned allocator rounds up to a power of two: a 65 GiB cache pinned 128 GiB per
    rank before session 37), and each layer's host view lies where its device view does."""
    from nixl_async_vllm import worker

    cls = AttentionBackendEnum.FLASH_ATTN.get_class()
    spec = customize_attention_spec(
        cls, FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    )
    layer_stride, block_stride, *_ = compute_layout_strides(spec, BLOCKS, LAYERS, KVCacheLayout.LBHNC)
    size = spec.page_size_bytes * BLOCKS * LAYERS
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(LAYERS)], layer_stride=layer_stride,
                           block_stride=block_stride)  # fmt: skip
    views = create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, BLOCKS, KVCacheLayout.LBHNC, tensor)
    views = dict(views) if isinstance(views, dict) else {f"l{i}": v for i, v in enumerate(views)}
    allocations: list[tuple[tuple[int, ...], dict]] = []
    real_empty = torch.empty

    def empty(*shape, **kwargs):
        allocations.append((shape, kwargs))
        return real_empty(*shape, **kwargs)

    monkeypatch.setattr(worker.torch, "empty", empty)
    mirror = worker.host_mirror(views)
    assert allocations == [((size,), {"dtype": torch.uint8})], "one unpinned allocation of the buffer's size"
    assert len({m.untyped_storage().data_ptr() for m in mirror.values()}) == 1
    for name, view in views.items():
        host = mirror[name]
        assert (host.shape, host.stride(), host.storage_offset()) == (view.shape, view.stride(), view.storage_offset())


def test_host_staging_without_vllms_copy_op_fails_loudly_not_with_stale_kv():
    """A model runner that never calls set_host_xfer_buffer_ops (vLLM 0.32's GPU runner does): before session 37
    the producer staged nothing and the reader reported loads received without copying them to the device."""
    from nixl_async_vllm.worker import ConnectorWorker

    worker = ConnectorWorker.__new__(ConnectorWorker)  # only the staging checks run: no vLLM config, no engine
    worker._host_caches, worker._device_caches, worker._copy_blocks = {"l0": torch.zeros(4)}, {}, None
    with pytest.raises(RuntimeError, match="set_host_xfer_buffer_ops"):
        worker.wait_for_save(None)
    with pytest.raises(RuntimeError, match="set_host_xfer_buffer_ops"):
        worker.get_transfer_results()
    worker._host_caches = {}  # no staging: nothing needed
    worker.wait_for_save(None)


def test_a_taken_side_channel_port_says_how_to_space_instances():
    """vLLM's docs put two NixlConnector instances on one host one port apart (it listens once per
    instance); the adapter listens once per TP rank, so from TP 2 on the second instance's port is the
    first one's rank 1. Before, vLLM failed to start with ZMQ's bare "Address already in use"."""
    import errno
    import socket

    from nixl_async import EngineConfig, SyncEngine
    from nixl_async_vllm.worker import ConnectorWorker

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        base = taken.getsockname()[1] - 1  # rank 1's port is the taken one
        worker = ConnectorWorker.__new__(ConnectorWorker)  # only the serving runs: no vLLM config
        worker.tp_rank, worker.tp_size = 1, 2
        worker.sync = SyncEngine(EngineConfig(engine_id="taken-port"))
        try:
            with pytest.raises(OSError, match="at least their TP size apart") as info:
                worker._serve("127.0.0.1", base)
            assert info.value.errno == errno.EADDRINUSE
        finally:
            worker.sync.close()


def test_kv_caches_on_another_accelerator_are_refused_by_name():
    """Tensors on a device that is neither CPU nor CUDA/ROCm (XPU, say; here "meta"): before, registered as host
    memory (vLLM registers XPU caches as device memory, or stages them through the host)."""
    from types import SimpleNamespace

    from nixl_async_vllm.settings import UnsupportedSetting
    from nixl_async_vllm.worker import AttentionChoice, ConnectorWorker

    name, view = _views("FLASH_ATTN", "LBHNC")
    worker = ConnectorWorker.__new__(ConnectorWorker)  # what register_kv_caches reads, without a vLLM server
    worker.kv_cache_config = SimpleNamespace(num_blocks=BLOCKS)
    worker.state_layers = frozenset()
    worker.block_size = BLOCK_SIZE
    worker.attention = AttentionChoice(name, "LBHNC", None)
    worker.vllm_config = SimpleNamespace(model_config=SimpleNamespace(get_num_kv_heads=lambda _: HEADS, use_mla=False),
                                         parallel_config=None)  # fmt: skip
    elsewhere = view.to("meta")
    with pytest.raises(UnsupportedSetting, match="'meta' devices are not supported"):
        worker.register_kv_caches({"l0": elsewhere, "l1": elsewhere})


@pytest.mark.parametrize("buffer_device", ["CPU", "host", "cuda"])
def test_a_kv_buffer_device_the_caches_device_does_not_take_is_refused(buffer_device):
    """An audit of session 39: only an exact "cpu" meant host staging, so "CPU" or "host" on a GPU registered
    the device caches unstaged, and "cuda" on a CPU host was taken (vLLM's NixlConnector refuses all three)."""
    from types import SimpleNamespace

    from nixl_async_vllm.settings import UnsupportedSetting
    from nixl_async_vllm.worker import AttentionChoice, ConnectorWorker

    name, view = _views("FLASH_ATTN", "LBHNC")
    worker = ConnectorWorker.__new__(ConnectorWorker)  # what register_kv_caches reads, without a vLLM server
    worker.kv_cache_config = SimpleNamespace(num_blocks=BLOCKS)
    worker.state_layers = frozenset()
    worker.block_size = BLOCK_SIZE
    worker.buffer_device = buffer_device
    worker.attention = AttentionChoice(name, "LBHNC", None)
    worker.vllm_config = SimpleNamespace(model_config=SimpleNamespace(get_num_kv_heads=lambda _: HEADS, use_mla=False),
                                         parallel_config=None)  # fmt: skip
    with pytest.raises(UnsupportedSetting, match=f"kv_buffer_device '{buffer_device}' with KV caches on 'cpu'"):
        worker.register_kv_caches({"l0": view, "l1": view})


@pytest.mark.parametrize("direct", [True, False])
def test_received_state_on_rocm_is_synchronized_before_vllm_hears(monkeypatch, direct):
    """ROCm with state (Mamba) layers read straight into device memory: vLLM's worker synchronizes the device
    before it reports receives, so the next step's kernels see NIXL's writes; so does the adapter now."""
    from types import SimpleNamespace

    from nixl_async import FinishedRequests
    from nixl_async_vllm.worker import ConnectorWorker

    synchronized: list[bool] = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a: synchronized.append(True))
    worker = ConnectorWorker.__new__(ConnectorWorker)  # only the reporting runs: no vLLM config, no engine
    worker._host_caches, worker._sync_direct_receives, worker._awaiting = {}, direct, {"r": [3]}
    worker.sync = SimpleNamespace(get_finished=lambda: FinishedRequests(done={"r"}))
    worker._wait_if_idle = lambda: None
    worker._own_finished = lambda finished: finished
    worker._finished_sending = set
    assert worker.get_transfer_results() == (set(), {"r"}, set())
    assert synchronized == ([True] if direct else [])
    worker._awaiting = {}
    worker.sync = SimpleNamespace(get_finished=FinishedRequests)
    worker.get_transfer_results()  # nothing received: no synchronize
    assert synchronized == ([True] if direct else [])
