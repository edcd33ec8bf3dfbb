"""`AdapterPushScheduler`'s own bookkeeping (pure logic; vLLM's push scheduler underneath is stubbed).

What it adds to vLLM's: decode's registrations carry its prefix hit, decode's metadata names the
requests vLLM finished while they waited for their push (`push_withdrawn`), and with progressive
push prefill's metadata carries, per step, each request for decode it computes (`PrefillStep`).
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from nixl_async_vllm.progressive import PrefillFollower, PrefillStep
from nixl_async_vllm.scheduler import AdapterPushScheduler

PROMPT = 300  # tokens: 3 blocks of 128


@pytest.fixture
def scheduler(monkeypatch) -> AdapterPushScheduler:
    def stage(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """What vLLM's does for decode: stage a registration with no prefix hit."""
        if request.kv_transfer_params.get("do_remote_prefill") and num_external_tokens > 0:
            unhashed = [[b.block_id for b in group if b.block_hash is None] for group in blocks.blocks]
            self._reqs_need_recv[request.request_id] = (request, unhashed, (), False)

    monkeypatch.setattr(NixlPushConnectorScheduler, "update_state_after_alloc", stage)
    monkeypatch.setattr(NixlPushConnectorScheduler, "build_connector_meta", lambda self, out: SimpleNamespace())
    monkeypatch.setattr(NixlPushConnectorScheduler, "request_finished", lambda self, request, blocks: (True, {}))
    monkeypatch.setattr(NixlPushConnectorScheduler, "update_connector_output", lambda self, output: None)
    sched = object.__new__(AdapterPushScheduler)
    spec = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=8, dtype=torch.float16)
    sched.kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                                          kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])  # fmt: skip
    sched.settings = SimpleNamespace(push_progressive=True)
    sched._reqs_need_recv = {}
    sched._computing = PrefillFollower()
    sched._saving = PrefillFollower()
    sched._reqs_need_save = {}
    sched._awaiting_push = set()
    sched._to_withdraw = []
    sched._held_after_abort = []
    return sched


def _block(block_id: int, cached: bool = False) -> KVCacheBlock:
    block = KVCacheBlock(block_id)
    if cached:
        block._block_hash = b"hash"  # type: ignore[assignment]
    return block


def _request(request_id: str, **params: Any) -> SimpleNamespace:
    return SimpleNamespace(request_id=request_id, kv_transfer_params=params, num_prompt_tokens=PROMPT,
                           num_computed_tokens=PROMPT)  # fmt: skip


def _output(new=(), cached=(), scheduled=None, resumed=()) -> SimpleNamespace:
    ids, blocks, computed = zip(*cached, strict=True) if cached else ((), (), ())
    steps = SimpleNamespace(req_ids=list(ids), new_block_ids=list(blocks), num_computed_tokens=list(computed),
                            resumed_req_ids=set(resumed))  # fmt: skip
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=b, num_computed_tokens=n) for r, b, n in new],
        scheduled_cached_reqs=steps,
        num_scheduled_tokens=scheduled or {},
        total_num_scheduled_tokens=sum((scheduled or {}).values()),
    )


def test_decode_registrations_carry_the_prefix_hit(scheduler):
    blocks = SimpleNamespace(blocks=([_block(5, cached=True), _block(6, cached=True), _block(7)],))
    scheduler.update_state_after_alloc(_request("d", do_remote_prefill=True), blocks, 100)
    assert scheduler._reqs_need_recv["d"][1:3] == ([[7]], (2,))


def test_each_step_of_a_request_for_decode_is_followed_chunk_by_chunk(scheduler):
    scheduler.update_state_after_alloc(_request("p", do_remote_decode=True), SimpleNamespace(blocks=([],)), 0)
    first = scheduler.build_connector_meta(_output(new=[("p", ([3, 4],), 0)], scheduled={"p": 192}))
    assert first.push_steps == {"p": PrefillStep(([3, 4],), 0, 192, PROMPT)} and not first.idle_step
    assert first.push_steps["p"].done_blocks(128) == 1, "the second block is only half computed"
    second = scheduler.build_connector_meta(_output(cached=[("p", ([9],), 192)], scheduled={"p": 108}))
    assert second.push_steps == {"p": PrefillStep(([3, 4, 9],), 192, PROMPT, PROMPT)}
    assert second.push_steps["p"].done_blocks(128) == 3, "the prompt's last block counts once the prompt is done"
    resumed = scheduler.build_connector_meta(_output(cached=[("p", ([1, 2, 8],), 0)], scheduled={"p": 300},
                                                     resumed=["p"]))  # fmt: skip
    assert resumed.push_steps["p"] == PrefillStep(([1, 2, 8],), 0, PROMPT, PROMPT, resumed=True)
    scheduler.request_finished(_request("p", do_remote_decode=True), ([1, 2, 8],))
    idle = scheduler.build_connector_meta(_output(cached=[("p", None, 300)]))
    assert not hasattr(idle, "push_steps") and idle.idle_step, "nothing scheduled: the workers may wait"


def test_requests_not_for_decode_are_not_followed(scheduler):
    scheduler.update_state_after_alloc(_request("x"), SimpleNamespace(blocks=([],)), 0)
    assert not hasattr(scheduler.build_connector_meta(_output(new=[("x", ([1],), 0)], scheduled={"x": 9})),
                       "push_steps")  # fmt: skip


def test_a_request_finished_while_it_waits_for_its_push_is_withdrawn_once(scheduler):
    blocks = SimpleNamespace(blocks=([_block(7)],))
    for request_id in ("aborted", "received"):
        scheduler.update_state_after_alloc(_request(request_id, do_remote_prefill=True), blocks, 100)
    scheduler.update_connector_output(SimpleNamespace(finished_recving={"received"}))
    for request_id in ("aborted", "received", "never-registered"):
        scheduler.request_finished(_request(request_id), ([7],))
    assert scheduler.build_connector_meta(_output()).push_withdrawn == ["aborted"]
    assert not hasattr(scheduler.build_connector_meta(_output()), "push_withdrawn"), "named once"


def test_a_request_aborted_while_followed_keeps_its_blocks_until_the_workers_free_them(scheduler, monkeypatch):
    """vLLM's push scheduler frees an aborted request's blocks at once, while a progressive push may still
    read them (its layer WRITEs end only once cancelled and settled): the blocks then held another request's
    KV as the WRITEs read them. Held now, the workers report the request sent once no push of theirs reads them."""
    monkeypatch.setattr(NixlPushConnectorScheduler, "request_finished", lambda self, request, blocks: (False, None))
    scheduler.update_state_after_alloc(_request("p", do_remote_decode=True), SimpleNamespace(blocks=([],)), 0)
    scheduler.build_connector_meta(_output(new=[("p", ([3, 4],), 0)], scheduled={"p": 192}))
    assert scheduler.request_finished(_request("p", do_remote_decode=True), ([3, 4],)) == (True, None)
    assert scheduler.build_connector_meta(_output()).push_held_after_abort == ["p"]
    assert not hasattr(scheduler.build_connector_meta(_output()), "push_held_after_abort"), "said once"
    # Not followed, or no blocks: vLLM's answer stands.
    assert scheduler.request_finished(_request("q", do_remote_decode=True), ([5],)) == (False, None)
    scheduler.update_state_after_alloc(_request("r", do_remote_decode=True), SimpleNamespace(blocks=([],)), 0)
    assert scheduler.request_finished(_request("r", do_remote_decode=True), ([],)) == (False, None)


def test_a_finished_request_is_no_longer_followed_for_host_staging(scheduler):
    scheduler._saving.follow("p", PROMPT)
    scheduler.request_finished(SimpleNamespace(request_id="p", kv_transfer_params={}), ([1, 2, 3],))
    assert "p" not in scheduler._saving


def _decode_scheduler() -> AdapterPushScheduler:
    """A decode-side push scheduler with what vLLM 0.32's own `on_new_request` and `update_state_after_alloc` read."""
    sched = object.__new__(AdapterPushScheduler)
    spec = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=8, dtype=torch.float16)
    sched.kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                                          kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])  # fmt: skip
    sched.settings = SimpleNamespace(push_progressive=False, etcd=None)
    sched.engine_id, sched.side_channel_host, sched.side_channel_port = "decode", "127.0.0.1", 5600
    sched.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1))
    sched.use_host_buffer, sched._is_hma_required = False, False
    sched.blocks_per_sw, sched._ssm_spec_blocks = [0], [None]
    sched._push_pending_registrations, sched._push_registration_deadlines = {}, {}
    sched._push_registration_timeout = 480.0
    sched._heartbeat_by_engine, sched._heartbeat_req_engine = {}, {}
    sched._reqs_need_recv, sched._reqs_need_save, sched._reqs_in_batch = {}, {}, set()
    sched._computing, sched._saving, sched._awaiting_push = PrefillFollower(), PrefillFollower(), set()
    return sched


def _decode_blocks() -> SimpleNamespace:
    return SimpleNamespace(blocks=([_block(1), _block(2)],), get_unhashed_block_ids_all_groups=lambda: [[1, 2]])


WELL_FORMED = {"do_remote_prefill": True, "remote_engine_id": "prefill", "remote_request_id": "p-1",
               "remote_host": "10.0.0.2", "remote_port": 5600, "tp_size": 1}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"remote_engine_id": None}, "remote_engine_id"),
        ({"tp_size": None}, "tp_size"),
        ({"remote_port": "abc"}, "remote_port"),  # vLLM's worker took int("abc") outside its try
        ({"remote_host": None}, "remote_host/remote_port"),  # no etcd to find prefill by id
    ],
)
def test_a_decode_request_whose_params_name_no_usable_prefill_is_computed_locally(change, named, caplog):
    """Before session 37 vLLM's push scheduler raised KeyError inside schedule() (or its worker a
    ValueError), stopping the engine and every request in it."""
    sched = _decode_scheduler()
    merged = {**WELL_FORMED, **change}
    params = {key: value for key, value in merged.items() if value is not None or key == "remote_host"}
    request = SimpleNamespace(request_id="d-1", num_prompt_tokens=PROMPT, kv_transfer_params=params)
    sched.on_new_request(request)
    sched.update_state_after_alloc(request, _decode_blocks(), 256)
    assert params["do_remote_prefill"] is False and named in caplog.text
    assert not sched._push_pending_registrations and not sched._heartbeat_req_engine


def test_a_well_formed_decode_request_registers_with_prefill():
    sched = _decode_scheduler()
    request = SimpleNamespace(request_id="d-1", num_prompt_tokens=PROMPT, kv_transfer_params=dict(WELL_FORMED))
    sched.on_new_request(request)
    sched.update_state_after_alloc(request, _decode_blocks(), 256)
    assert sched._push_pending_registrations["d-1"]["remote_engine_id"] == "prefill"
    assert "d-1" in sched._awaiting_push and sched._heartbeat_req_engine["d-1"] == ("prefill", "p-1")
