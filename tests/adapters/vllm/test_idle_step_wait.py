"""When a vLLM step that scheduled nothing waits for transfers, and how often it has NIXL progressed meanwhile."""

from __future__ import annotations

import itertools

import pytest

from nixl_async import PollConfig
from nixl_async_vllm.worker import IDLE_POKE_S, IdleWait, idle_step_wait


@pytest.mark.parametrize(("serving", "reading"), [(True, False), (False, True), (True, True)])
def test_an_idle_step_with_transfers_under_way_waits_and_keeps_nixl_progressed(serving, reading):
    plan = idle_step_wait(0.002, step_idle=True, serving=serving, reading=reading)
    # A read of ours is polled as often as a reader's operation on our memory: the model thread
    # has nothing to do, and the poller alone would look only every busy interval.
    assert plan == IdleWait(0.002, IDLE_POKE_S)
    assert PollConfig().busy_interval_s > IDLE_POKE_S


@pytest.mark.parametrize(("step_idle", "serving", "reading"), list(itertools.product([True, False], repeat=3)))
def test_no_wait_for_a_step_with_work_nothing_under_way_or_the_wait_turned_off(step_idle, serving, reading):
    if step_idle and (serving or reading):
        assert idle_step_wait(0.0, step_idle=step_idle, serving=serving, reading=reading) is None  # turned off
    else:
        assert idle_step_wait(0.002, step_idle=step_idle, serving=serving, reading=reading) is None
