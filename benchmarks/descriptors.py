"""Building and preparing descriptors for 1 M blocks x 2 regions.

The engine builds descriptor arrays with numpy and prepares a view from one strided row per
region. Side by side: vLLM 0.32's own code where it is installed (`NixlBaseConnectorWorker.
_build_fa_local`, called on a stand-in holding the attributes it reads, then `get_xfer_descs` +
`prep_xfer_dlist` on the Nx3 array, as its `register_local_xfer_handler` does), and the seed
worker's per-block (addr, len, device) tuples. Each is timed to a prepared local descriptor list,
and on its own.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable

import numpy as np

from nixl_async._agent import OwnedAgent
from nixl_async.layout import BlockLayout

from .common import Result

BLOCKS = 1 << 20
BLOCK_LEN = 16  # small blocks keep the registered memory small; descriptor counts are what matter


def _per_block_tuples(layout: BlockLayout) -> list[tuple[int, int, int]]:
    out = []
    for base in layout.region_addrs:
        for block_id in range(layout.num_blocks):
            out.append((base + block_id * layout.block_len, layout.block_len, layout.device_id))
    return out


def _vllm_fa_local(layout: BlockLayout) -> Callable[[], np.ndarray] | None:
    """vLLM 0.32's local descriptor builder over `layout`'s regions, or None without vLLM."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker
    except ImportError:
        return None
    n = len(layout.region_addrs)
    worker = types.SimpleNamespace(  # what _build_fa_local reads from the worker
        transfer_topo=object(), device_id=layout.device_id, _transfer_layer_region_indices=None,
        block_len_per_layer=[layout.block_len] * n, block_stride_per_layer=[layout.block_len] * n,
        region_num_blocks=[layout.num_blocks] * n, _stack_descs=NixlBaseConnectorWorker._stack_descs,
    )  # fmt: skip
    build = NixlBaseConnectorWorker._build_fa_local
    return lambda: build(worker, list(layout.region_addrs), 1)  # type: ignore[arg-type]


def _timed(fn, repeats: int) -> tuple[float, object]:
    best, value = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t)
    return best, value


def run(quick: bool) -> Result:
    repeats = 2 if quick else 5
    regions = [np.zeros(BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in range(2)]
    layout = BlockLayout.from_regions("kv", [r.ctypes.data for r in regions], num_blocks=BLOCKS, block_len=BLOCK_LEN)
    agent = OwnedAgent("bench-descriptors", ("UCX",), {})
    memory = agent.register(layout.region_descriptors(), layout.mem_type)
    try:
        build_np, _ = _timed(lambda: layout.view().descriptors(), repeats)
        build_list, tuples = _timed(lambda: _per_block_tuples(layout), repeats)

        def prep_engine() -> None:
            agent.release_dlist(agent.prep_view("", layout.view()))

        def prep_list() -> None:
            handle = agent._agent.prep_xfer_dlist("", _per_block_tuples(layout), "DRAM")
            agent._agent.release_dlist_handle(handle)

        prep_np, _ = _timed(prep_engine, repeats)
        prep_tuples, _ = _timed(prep_list, repeats)
        del tuples
        vllm_build = _vllm_fa_local(layout)
        if vllm_build is not None:
            build_vllm, blocks_data = _timed(vllm_build, repeats)
            assert np.array_equal(np.asarray(blocks_data), layout.view().descriptors())  # the same 2 M rows

            def prep_vllm() -> None:
                descs = agent._agent.get_xfer_descs(vllm_build(), str(layout.mem_type))
                agent._agent.release_dlist_handle(agent._agent.prep_xfer_dlist("", descs))

            prep_vllm_s, _ = _timed(prep_vllm, repeats)
    finally:
        agent.deregister(memory)
    metrics = {"engine_build_ms": build_np * 1e3, "tuples_build_ms": build_list * 1e3,
               "engine_prep_ms": prep_np * 1e3, "tuples_prep_ms": prep_tuples * 1e3}  # fmt: skip
    ratios = {
        "tuples_over_engine_build_time_higher_is_better": build_list / build_np,
        "tuples_over_engine_prep_time_higher_is_better": prep_tuples / prep_np,
    }
    rows = [
        ["build descriptors (2 M rows)", build_np * 1e3, build_list * 1e3, build_list / build_np],
        ["build + prepare local list", prep_np * 1e3, prep_tuples * 1e3, prep_tuples / prep_np],
    ]
    notes = ["goal: >= 20x faster", "baselines: the seed worker's per-block tuples, and vLLM 0.32's own builder"]
    if vllm_build is not None:
        metrics |= {"vllm_build_ms": build_vllm * 1e3, "vllm_prep_ms": prep_vllm_s * 1e3}
        ratios |= {"vllm_over_engine_build_time_higher_is_better": build_vllm / build_np,
                   "vllm_over_engine_prep_time_higher_is_better": prep_vllm_s / prep_np}  # fmt: skip
        rows += [
            ["vLLM 0.32 _build_fa_local (Nx3 numpy)", build_np * 1e3, build_vllm * 1e3, build_vllm / build_np],
            ["vLLM 0.32 build + get_xfer_descs + prep", prep_np * 1e3, prep_vllm_s * 1e3, prep_vllm_s / prep_np],
        ]
    else:
        notes.append("vLLM is not installed: its builder was not measured")
    return Result("descriptors", ["step", "engine ms", "baseline ms", "speed-up"], rows, metrics=metrics,
                  ratios=ratios, notes=notes)  # fmt: skip
