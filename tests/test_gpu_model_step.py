"""The model-step check's model of vLLM's posting pattern (pure logic: NIXL's calls are stand-ins here;
the check itself runs over real NIXL in tests/test_gpu_check_dry_run.py and on the GPU)."""

import time

import pytest
import torch

from nixl_async_benchmarks.gpu_model_step import ModelThread, StepLoad


class FakeReader:
    """A READ that stays PROC for `checks` state checks, then ends in `end`."""

    def __init__(self, checks: int, end: str = "DONE") -> None:
        self.checks, self.end = checks, end
        self.posted = self.released = 0
        self.closed = False
        self._left = 0

    def open(self):
        return self.post, self.state, self.release, self.close

    def post(self):
        self.posted += 1
        self._left = self.checks
        return object(), ("PROC" if self._left else self.end)

    def state(self, handle):
        self._left -= 1
        return "PROC" if self._left > 0 else self.end

    def release(self, handle):
        self.released += 1

    def close(self):
        self.closed = True


def test_one_read_in_flight_at_a_time_checked_once_per_step_and_counted_when_done():
    reader = FakeReader(checks=2)
    load = StepLoad(reader.open, nbytes=100)
    load.start()
    for _ in range(6):  # post, check, check (done) ; post, check, check (done)
        load()
    assert (reader.posted, reader.released, load.moved, load.failed) == (2, 2, 200, [])


def test_a_read_completing_inside_the_post_is_released_at_once():
    reader = FakeReader(checks=0)
    load = StepLoad(reader.open, nbytes=10)
    load.start()
    for _ in range(3):
        load()
    assert (reader.posted, reader.released, load.moved) == (3, 3, 30)


def test_stop_waits_out_the_read_in_flight_without_counting_it_and_closes():
    reader = FakeReader(checks=3)
    load = StepLoad(reader.open, nbytes=10)
    load.start()
    load()  # posted, in flight
    load.stop()
    assert reader.released == 1 and reader.closed and load.moved == 0


def test_failed_reads_are_recorded_not_counted():
    reader = FakeReader(checks=1, end="ERR")
    load = StepLoad(reader.open, nbytes=10)
    load.start()
    load()
    load()
    assert load.failed == ["ERR"] and load.moved == 0 and reader.released == 1


def test_the_model_thread_runs_its_hooks_in_its_own_thread_and_reports_their_failure():
    seen = []

    class Hooks:
        def start(self):
            seen.append("start")

        def __call__(self):
            raise RuntimeError("boom")

        def stop(self):
            seen.append("stop")

    with pytest.raises(RuntimeError, match="model thread failed") as failed, \
            ModelThread(torch.device("cpu"), Hooks()) as model:  # fmt: skip
        deadline = time.monotonic() + 30
        while model.error is None and time.monotonic() < deadline:  # its first step ends in the hook
            time.sleep(0.01)
    assert "boom" in repr(failed.value.__cause__)
    assert seen == ["start", "stop"]
