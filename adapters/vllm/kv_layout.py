"""How a vLLM attention backend packs one layer's KV block: pure translation, no I/O.

vLLM 0.32 hands the connector one view per layer with the logical shape ``[blocks, H, tokens,
C]`` (H head slots, C bytes per slot and token); the memory order comes from the model-wide
`KVCacheLayout` and shows only in the strides. What those bytes mean inside a block depends on
the backend, and that decides which reads are correct:

=========================  ====================================================  ===============  ==============
backend (vLLM name)        one block of one layer                                TP head window   block-size cut
=========================  ====================================================  ===============  ==============
FlashAttention, Triton,    LBHNC: ``[heads, tokens, K|V]`` (K and V side by      yes              by head slab
FlashInfer, Flex, ...      side per token); LBNHC: ``[tokens, heads, K|V]``      no (LBNHC)       whole block
CPU_ATTN                   LBHNC, each head ``[K (N*D), V (N*D)]`` with K stored yes              refused
                           per ISA (transposed on "vec", VNNI tiles on "amx")
ROCM_ATTN, B12X, ...       two planes ``[K|V, tokens, heads*D]`` (and ROCm's     refused          refused
                           paged kernels re-tile each plane)
MLA backends               ``[1, tokens, latent]``: token-major                  (replicated)     whole block
any other packing          (a new backend, FlashInfer's nvfp4 K-then-V heads)    refused          refused
=========================  ====================================================  ===============  ==============

A *head window* is a TP rank's share of a block (heterogeneous TP reads it as one byte range);
it is one range only when heads are outermost inside the block. A *block-size cut* fills one
local block from ``ratio`` smaller remote blocks: remote block k's tokens must land at token
offset ``k * remote_block_size`` in every *run* (a head's slab, tokens outermost inside it), so
it is only possible where tokens are outermost within a run. Anything else is refused by name
rather than read into the wrong place; whole blocks between two ranks of one packing are always right.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from nixl_async.exceptions import LayoutError

__all__ = ["SHUFFLED_AITER_FA", "CacheLayout", "describe_cache", "no_head_window", "packing_class", "packing_name"]

# Backends whose (head, token) slot is ``[K|V]`` alike: for one element type and layout a block of one reads right
# into another's cache (as vLLM's connector allows with its compat check off). (Triton's per-token-head quantized
# types pad scales into the slot: only Triton has them, and their dtype names them apart.)
_PLAIN_SLOT = frozenset({
    "FLASH_ATTN", "TRITON_ATTN", "TRITON_FLASH_ATTN", "FLASHINFER", "TRITON_FLASHINFER", "FLEX_ATTENTION", "HPC_ATTN",
    "ROCM_AITER_FA", "ROCM_AITER_UNIFIED_ATTN",
})  # fmt: skip
# Backends whose C is one head's K then V (or a quantized slot) for one token: those, and some of their own.
_PER_TOKEN_SLOT = _PLAIN_SLOT | {"FLASH_ATTN_DIFFKV", "TRITON_ATTN_DIFFKV", "TURBOQUANT", "ULTRAQUANT"}
# ROCm AITER FA calls itself FLASH_ATTN; with the shuffled KV cache its blocks hold two planes.
SHUFFLED_AITER_FA = "ROCM_AITER_FA_SHUFFLED"
# Backends that keep K and V as two planes of all heads.
_TWO_PLANES = frozenset({"ROCM_ATTN", "ROCM_SEGMENTED_ATTN", "B12X", SHUFFLED_AITER_FA})
_CPU = "CPU_ATTN"
_SUPPORTED_LAYOUTS = ("LBHNC", "LBNHC")


@dataclass(frozen=True)
class CacheLayout:
    """One layer's block, as the read planner needs it."""

    backend: str
    layout: str  # vLLM's KVCacheLayout name
    isa: str | None  # the CPU backend's packing depends on it
    block_len: int  # bytes of one block of one layer
    head_window: bool  # a TP rank's heads are one contiguous byte range of the block
    run_len: int | None  # bytes of one run cut by a block-size ratio; None: the whole block is token-major
    ratio_refusal: str | None  # why a block-size ratio cannot be read, or None


def packing_name(backend: type) -> str:
    """vLLM's name for an attention backend class, or ours where one name covers two packings."""
    name: str = backend.get_name()  # type: ignore[attr-defined]
    if backend.__module__.endswith(".rocm_aiter_fa"):
        from vllm._aiter_ops import rocm_aiter_ops

        if rocm_aiter_ops.is_shuffle_kv_cache_enabled():  # K and V re-tiled as two planes, not per token
            return SHUFFLED_AITER_FA
    return name


def packing_class(backend: str, mla: bool) -> str:
    """What a block's bytes mean, as far as the backend decides it: backends that store them alike share a class
    (the element type, layout and ISA are published beside it); any other packing goes by its own name."""
    if mla:
        return "mla"  # one latent slot per token (a quantized latent shows in the cache's element type)
    if backend in _PLAIN_SLOT:
        return "kv_per_token_slot"
    return backend


def describe_cache(
    backend: str,
    layout: str,
    shape: tuple[int, ...],
    stride: tuple[int, ...],
    element_size: int,
    *,
    num_kv_heads: int,
    mla: bool,
    isa: str | None = None,
) -> CacheLayout:
    """The packing of a layer view `shape`/`stride` (elements) from `backend` under `layout`.

    Raises `LayoutError` naming the backend or layout when the adapter cannot read it correctly.
    """
    where = f"attention backend {backend} with KV cache layout {layout}"
    if layout not in _SUPPORTED_LAYOUTS:
        raise LayoutError(
            f"{where}: only the layer-compact layouts {_SUPPORTED_LAYOUTS} are supported "
            "(set VLLM_KV_CACHE_LAYOUT=LBHNC, NixlConnector's choice)"
        )
    if len(shape) != 4 or len(stride) != 4:
        raise LayoutError(f"{where}: expected one [blocks, heads, tokens, content] view per layer, got {shape}")
    _, heads, tokens, content = shape
    block_len = prod(shape[1:]) * element_size
    dense = _dense(shape, layout)
    if any(size > 1 and got != want for size, got, want in zip(shape, stride, dense, strict=True)):
        raise LayoutError(f"{where}: a view of shape {shape} and strides {stride} is not made of dense blocks")
    head_major = layout == "LBHNC"
    if mla:
        if heads != 1:
            raise LayoutError(f"{where}: an MLA cache has one latent slot per token, got {heads} head slots")
        return CacheLayout(backend, layout, None, block_len, True, None, None)
    if backend in _PER_TOKEN_SLOT and heads == num_kv_heads:
        run = tokens * content * element_size if head_major else None
        return CacheLayout(backend, layout, None, block_len, head_major, run, None)
    if backend == _CPU:
        if not head_major:
            raise LayoutError(f"{where}: the CPU backend is known only head-major (LBHNC)")
        why = (f"the CPU backend packs each head's K per ISA ({isa or 'unknown'}: transposed or tiled), "
               "so smaller remote blocks cannot be placed by tokens")  # fmt: skip
        return CacheLayout(backend, layout, isa, block_len, True, None, why)
    if backend in _TWO_PLANES:
        why = f"{backend} keeps K and V as two planes of all heads, re-tiled by its kernels"
        return CacheLayout(backend, layout, None, block_len, False, None, why)
    # A packing not known here (a new backend; FlashInfer's nvfp4 keeps all K heads, then all V: 2x the head
    # slots): a whole block is still the same bytes on both sides of one backend (the compatibility check), so
    # whole blocks are read; a TP rank's heads or a smaller block's tokens cannot be placed.
    slots = f"{heads} head slots for {num_kv_heads} KV heads" if backend in _PER_TOKEN_SLOT else "packing not known"
    return CacheLayout(backend, layout, None, block_len, False, None, f"{backend} ({slots}): only whole blocks")


def no_head_window(remote_tp: int, local_tp: int) -> LayoutError:
    """The refusal of heterogeneous TP where a rank's heads are not one byte range of a block."""
    return LayoutError(f"TP {remote_tp} -> {local_tp}: a rank's heads are not one byte range of a block in this "
                       "cache packing (heterogeneous TP needs the head-major layout, LBHNC, of a backend that keeps "
                       "each head's K and V together)")  # fmt: skip


def _dense(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Element strides of dense ``[B, H, N, C]`` blocks stored in `layout`'s order."""
    _, heads, tokens, content = shape
    if layout == "LBHNC":
        return (heads * tokens * content, tokens * content, content, 1)
    return (heads * tokens * content, content, heads * content, 1)  # LBNHC
