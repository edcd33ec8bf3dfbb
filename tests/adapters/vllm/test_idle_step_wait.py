"""When a vLLM step that scheduled nothing waits for transfers, and how often it has NIXL progressed meanwhile."""

from __future__ import annotations

import itertools

import pytest

from nixl_async import PollConfig
from nixl_async_vllm.push_worker import PushConnectorWorker
from nixl_async_vllm.worker import IDLE_POKE_S, ConnectorWorker, IdleWait, idle_step_wait


@pytest.mark.parametrize(("serving", "in_flight"), [(True, False), (False, True), (True, True)])
def test_an_idle_step_with_transfers_under_way_waits_and_keeps_nixl_progressed(serving, in_flight):
    plan = idle_step_wait(0.002, step_idle=True, serving=serving, in_flight=in_flight)
    # A read of ours is polled as often as a reader's operation on our memory: the model thread
    # has nothing to do, and the poller alone would look only every busy interval.
    assert plan == IdleWait(0.002, IDLE_POKE_S)
    assert PollConfig().busy_interval_s > IDLE_POKE_S


def test_push_mode_waits_for_its_own_requests_at_the_pollers_pace_but_pokes_for_readers():
    assert ConnectorWorker.IDLE_POKES_FOR_OWN_REQUESTS and not PushConnectorWorker.IDLE_POKES_FOR_OWN_REQUESTS
    ours = idle_step_wait(0.002, step_idle=True, serving=False, in_flight=True, poke_for_ours=False)
    assert ours == IdleWait(0.002, None), "waits (no back-to-back steps), without the faster pokes"
    served = idle_step_wait(0.002, step_idle=True, serving=True, in_flight=True, poke_for_ours=False)
    assert served == IdleWait(0.002, IDLE_POKE_S)


@pytest.mark.parametrize(("step_idle", "serving", "in_flight"), list(itertools.product([True, False], repeat=3)))
def test_no_wait_for_a_step_with_work_nothing_under_way_or_the_wait_turned_off(step_idle, serving, in_flight):
    if step_idle and (serving or in_flight):
        assert idle_step_wait(0.0, step_idle=step_idle, serving=serving, in_flight=in_flight) is None  # turned off
    else:
        assert idle_step_wait(0.002, step_idle=step_idle, serving=serving, in_flight=in_flight) is None
