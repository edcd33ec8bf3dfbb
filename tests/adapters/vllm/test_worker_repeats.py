"""A request vLLM hands the worker again while its first receive is still in flight."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from nixl_async import EngineConfig
from nixl_async.sync import SyncEngine
from nixl_async_vllm.push_worker import PushConnectorWorker
from nixl_async_vllm.worker import ConnectorWorker


@pytest.mark.parametrize(("worker_class", "receive_name"),
                         [(ConnectorWorker, "_receive"), (PushConnectorWorker, "_receive_pushed")])  # fmt: skip
def test_the_repeat_is_ignored_and_the_blocks_in_flight_stay_the_requests(worker_class, receive_name):
    """The blocks recorded are those the running receive writes into: on its failure they are the ones
    reported invalid (and, with host staging, copied), not the repeat's."""
    release = threading.Event()

    async def receive(engine, job, *args):
        while not release.is_set():
            await asyncio.sleep(0.005)

    worker = worker_class.__new__(worker_class)  # only the receive bookkeeping runs here: no vLLM config
    worker.sync = SyncEngine(EngineConfig(engine_id="repeat"))
    worker._awaiting = {}
    worker._withdrawals = {}
    worker.settings = SimpleNamespace(push_registration_timeout_s=10.0)
    worker._recv_job = lambda request_id, req, expiry: SimpleNamespace(request_id=request_id, local_blocks=req.blocks)
    setattr(worker, receive_name, receive)
    remote = SimpleNamespace(blocks_expiry_time=None)
    try:
        worker._start_receive("req-1", SimpleNamespace(remote=remote, awaiting_kvs=True, blocks=[1, 2]))
        worker._start_receive("req-1", SimpleNamespace(remote=remote, awaiting_kvs=True, blocks=[7, 8]))
        assert worker._awaiting == {"req-1": [1, 2]}
    finally:
        release.set()
        worker.sync.close()


def test_a_repeat_after_the_first_receive_ended_but_before_it_was_reported_is_ignored():
    """The first receive failed; vLLM handed the request again before the step that reports it. Before,
    the repeat was taken (the facade had freed the id), its blocks replaced the first's, and vLLM heard
    "failed" with those blocks invalid while the repeat still received into them."""
    release = threading.Event()
    runs: list[list[int]] = []

    async def receive(engine, job, *args):
        runs.append(job.local_blocks)
        if len(runs) == 1:
            raise RuntimeError("the producer refused")
        while not release.is_set():
            await asyncio.sleep(0.005)

    worker = ConnectorWorker.__new__(ConnectorWorker)
    worker.sync = SyncEngine(EngineConfig(engine_id="repeat-after-end"))
    worker._awaiting = {}
    worker._recv_job = lambda request_id, req, expiry: SimpleNamespace(request_id=request_id, local_blocks=req.blocks)
    worker._receive = receive
    remote = SimpleNamespace(blocks_expiry_time=None)
    try:
        worker._start_receive("req-1", SimpleNamespace(remote=remote, awaiting_kvs=True, blocks=[1, 2]))
        deadline = time.monotonic() + 5
        while worker.sync.in_flight and time.monotonic() < deadline:  # it ended, not reported yet
            time.sleep(0.005)
        worker._start_receive("req-1", SimpleNamespace(remote=remote, awaiting_kvs=True, blocks=[7, 8]))
        assert worker._awaiting == {"req-1": [1, 2]} and runs == [[1, 2]]
        assert worker.sync.in_flight == 0
    finally:
        release.set()
        worker.sync.close()


@pytest.mark.parametrize("worker_class", [ConnectorWorker, PushConnectorWorker])
def test_transfer_parameters_the_worker_cannot_read_fail_that_load_not_vllms_step(worker_class):
    """Before: `int("48 tokens")` raised out of `start_load_kv`, inside vLLM's `execute_model`: the engine stopped."""
    worker = worker_class.__new__(worker_class)
    worker.sync = SyncEngine(EngineConfig(engine_id="unusable"))
    worker._awaiting = {}
    worker.group_kinds = ("full",)
    worker.kv_cache_config = SimpleNamespace(transfer_group_ids=[0])
    remote = SimpleNamespace(blocks_expiry_time=None, request_id="p-r", engine_id="prefill", host="h", port=1,
                             num_tokens="48 tokens", block_ids=([1, 2],))  # fmt: skip
    req = SimpleNamespace(remote=remote, awaiting_kvs=True, local_block_ids=([7, 8],), local_num_computed_blocks=None,
                          tp_size=1)  # fmt: skip
    try:
        worker._start_receive("req-1", req)  # returns: nothing raised into vLLM's step
        assert worker._awaiting == {"req-1": [7, 8]}
        deadline = time.monotonic() + 5
        finished = worker.sync.get_finished()
        while not finished and time.monotonic() < deadline:
            time.sleep(0.01)
            finished = worker.sync.get_finished()
        assert isinstance(finished.failed["req-1"], ValueError)
    finally:
        worker.sync.close()
