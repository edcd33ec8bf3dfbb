"""Building and preparing descriptors for 1 M blocks x 2 regions, and posting over them.

The engine prepares a view from one strided (addr, len, device, stride, count) row per region,
so what it builds is those rows. Side by side: vLLM 0.32's own code where it is installed
(`NixlBaseConnectorWorker._build_fa_local`, called on a stand-in holding the attributes it reads,
then `get_xfer_descs` + `prep_xfer_dlist` on the Nx3 array, as its `register_local_xfer_handler`
does), and the seed worker's per-block (addr, len, device) tuples. Each is timed to a prepared
local descriptor list, and on its own. The engine's expansion of the same rows to 2 M Nx3 rows
(`BlockView.descriptors()`, the reference form its tests check the strided rows against; no
engine path builds it) is timed too, against the same baselines, without a goal.

Posting (issue #13: NIXL's strided rows against Nx3 for prep *and* post): READs of 1, 32 and
1,024 random blocks between the two regions (loopback, one agent), made and posted over a list
prepared from strided rows and over one prepared from the Nx3 array, alternating.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from nixl_async._agent import OwnedAgent, _bindings
from nixl_async.layout import BlockLayout, BlockView

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


def _post_times(agent: OwnedAgent, layout: BlockLayout, repeats: int) -> dict[int, tuple[float, float]]:
    """Per READ size: median seconds to make, post and finish it over strided-prepared and Nx3-prepared lists."""
    bind, ops, mem = agent._bind, agent._agent.nixl_ops, str(layout.mem_type)
    dst, src = layout.view(regions=(0, 1)), layout.view(regions=(1, 2))
    strided = (agent.prep_view("", dst), agent.prep_view(agent.name, src))
    try:
        nx3 = (agent._agent.prep_xfer_dlist("", dst.descriptors(), mem),
               agent._agent.prep_xfer_dlist(agent.name, src.descriptors(), mem))  # fmt: skip
        try:
            return _post_each(bind, ops["READ"], layout, (dst, src), {"strided": strided, "nx3": nx3}, repeats)
        finally:
            for handle in nx3:
                agent._agent.release_dlist_handle(handle)
    finally:
        for handle in strided:
            agent.release_dlist(handle)


def _post_each(bind: Any, read: Any, layout: BlockLayout, views: tuple[BlockView, BlockView],
               lists: dict[str, tuple[Any, Any]], repeats: int) -> dict[int, tuple[float, float]]:  # fmt: skip
    """Each READ size in turn, made, posted and waited for over each (local, remote) pair of `lists`, alternating."""
    dst, src = views
    rng = np.random.default_rng(0)
    out: dict[int, tuple[float, float]] = {}
    for count, reps in ((1, 40 * repeats), (32, 20 * repeats), (1024, 2 * repeats)):
        lidx, ridx = (v.descriptor_ids(rng.choice(layout.num_blocks, count, replace=False)) for v in (dst, src))
        seconds: dict[str, list[float]] = {"strided": [], "nx3": []}
        for rep in range(reps):
            for name in ("strided", "nx3") if rep % 2 else ("nx3", "strided"):
                local, remote = lists[name]
                started = time.perf_counter()
                handle = bind.makeXferReq(read, local._handle, lidx, remote._handle, ridx, b"", [], False)
                state = bind.postXferReq(handle, b"")
                while state == _bindings.NIXL_IN_PROG:
                    state = bind.getXferStatus(handle)
                seconds[name].append(time.perf_counter() - started)
                bind.releaseXferReq(handle)
                if state != _bindings.NIXL_SUCCESS:
                    raise RuntimeError(f"loopback READ of {count} blocks ended in NIXL state {state}")
        out[count] = (float(np.median(seconds["strided"])), float(np.median(seconds["nx3"])))
    return out


def run(quick: bool) -> Result:
    repeats = 2 if quick else 5
    regions = [np.zeros(BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in range(2)]
    layout = BlockLayout.from_regions("kv", [r.ctypes.data for r in regions], num_blocks=BLOCKS, block_len=BLOCK_LEN)
    agent = OwnedAgent("bench-descriptors", ("UCX",), {})
    memory = agent.register(layout.region_descriptors(), layout.mem_type)
    try:
        build_np, _ = _timed(lambda: layout.view().strided_rows(), 20 * repeats)  # tens of us: more tries
        expand_np, _ = _timed(lambda: layout.view().descriptors(), repeats)
        build_list, tuples = _timed(lambda: _per_block_tuples(layout), repeats)

        def prep_engine() -> None:
            agent.release_dlist(agent.prep_view("", layout.view()))

        def prep_list() -> None:
            handle = agent._agent.prep_xfer_dlist("", _per_block_tuples(layout), "DRAM")
            agent._agent.release_dlist_handle(handle)

        nx3_rows = layout.view().descriptors()  # built beforehand: only NIXL's prepare of 2 M rows is timed

        def prep_nx3() -> None:
            agent._agent.release_dlist_handle(agent._agent.prep_xfer_dlist("", nx3_rows, str(layout.mem_type)))

        prep_np, _ = _timed(prep_engine, 20 * repeats)
        prep_nx3_s, _ = _timed(prep_nx3, repeats)
        prep_tuples, _ = _timed(prep_list, repeats)
        del tuples
        posts = _post_times(agent, layout, repeats)
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
    metrics = {"engine_build_ms": build_np * 1e3, "engine_expand_ms": expand_np * 1e3,
               "tuples_build_ms": build_list * 1e3, "engine_prep_ms": prep_np * 1e3,
               "tuples_prep_ms": prep_tuples * 1e3, "nx3_prep_only_ms": prep_nx3_s * 1e3}  # fmt: skip
    ratios = {
        "tuples_over_engine_build_time_higher_is_better": build_list / build_np,
        "tuples_over_engine_prep_time_higher_is_better": prep_tuples / prep_np,
        "tuples_over_nx3_expansion_time_higher_is_better": build_list / expand_np,
        # NIXL's prepare alone, strided rows (built and prepared) against Nx3 rows built beforehand (#13)
        "nx3_prep_only_over_strided_prep_time_higher_is_better": prep_nx3_s / prep_np,
    }
    rows = [
        ["build what the engine prepares (2 strided rows)", build_np * 1e3, build_list * 1e3, build_list / build_np],
        ["build + prepare local list", prep_np * 1e3, prep_tuples * 1e3, prep_tuples / prep_np],
        ["expand to 2 M Nx3 rows (tests' reference form)", expand_np * 1e3, build_list * 1e3, build_list / expand_np],
        [
            "prepare: strided rows (built too) / 2 M Nx3 rows built beforehand",
            prep_np * 1e3,
            prep_nx3_s * 1e3,
            prep_nx3_s / prep_np,
        ],
    ]
    notes = ["goal: >= 20x faster", "baselines: the seed worker's per-block tuples, and vLLM 0.32's own builder"]
    if vllm_build is not None:
        metrics |= {"vllm_build_ms": build_vllm * 1e3, "vllm_prep_ms": prep_vllm_s * 1e3}
        ratios |= {"vllm_over_engine_build_time_higher_is_better": build_vllm / build_np,
                   "vllm_over_engine_prep_time_higher_is_better": prep_vllm_s / prep_np,
                   "vllm_over_nx3_expansion_time_higher_is_better": build_vllm / expand_np}  # fmt: skip
        rows += [
            ["vLLM 0.32 _build_fa_local (Nx3 numpy)", build_np * 1e3, build_vllm * 1e3, build_vllm / build_np],
            ["vLLM 0.32 build + get_xfer_descs + prep", prep_np * 1e3, prep_vllm_s * 1e3, prep_vllm_s / prep_np],
            ["(the engine's Nx3 expansion against it)", expand_np * 1e3, build_vllm * 1e3, build_vllm / expand_np],
        ]
    else:
        notes.append("vLLM is not installed: its builder was not measured")
    for count, (strided, nx3) in posts.items():
        metrics |= {f"post_{count}_blocks_strided_us": strided * 1e6, f"post_{count}_blocks_nx3_us": nx3 * 1e6}
        ratios[f"nx3_over_strided_post_time_{count}_blocks_higher_is_better"] = nx3 / strided
        rows.append([f"make, post, finish a READ of {count} block(s): strided / Nx3 list", strided * 1e3, nx3 * 1e3,
                     nx3 / strided])  # fmt: skip
    notes.append(
        "post rows: loopback READs of random blocks between the two regions, until done; medians of"
        " alternating runs; engine column: over a list prepared from strided rows, baseline: from Nx3"
    )
    return Result("descriptors", ["step", "engine ms", "baseline ms", "speed-up"], rows, metrics=metrics,
                  ratios=ratios, notes=notes)  # fmt: skip
