"""The transfer state machine, driven by events alone (no NIXL, no loop)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nixl_async._state import Complete, Fenced, Finish, Quiet, Release, TransferCore, TransferState
from nixl_async.exceptions import LeaseExpired, TransferCancelled, TransferFailed, TransferFenced, TransferTimeout


def core(n=3, running=2, grace=1.0, chain_last=False):
    return TransferCore(
        n, max_running=running, grace_s=grace, chain_last=chain_last, op="READ", peer="p", transfer_id=7
    )


def post_all(c, state="PROC"):
    actions = []
    for i in c.to_post(10):
        actions += c.posted(i, state)
    return actions


def test_success_path_releases_each_slice_then_completes():
    c = core(n=3, running=2)
    assert c.to_post(10) == [0, 1]  # at most two running
    assert c.posted(0, "PROC") == [] and c.posted(1, "DONE") == [Release(1)]
    assert c.released(1) == []
    assert c.to_post(10) == [2]
    assert c.posted(2, "PROC") == []
    assert c.checked(0, "PROC") == []
    assert c.checked(0, "DONE") == [Release(0)] and c.released(0) == []
    assert c.checked(2, "DONE") == [Release(2)]
    assert c.released(2) == [Complete()]
    assert c.succeed() == [Finish(None)]
    assert c.state is TransferState.DONE and c.quiet


def test_running_slices_are_never_released_on_error_only_after_they_end():
    c = core(n=4, running=2)
    post_all(c)
    error = TransferTimeout("late", transfer_id=7)
    assert c.end(error, now=10.0) == []  # both slices still running: nothing released, nobody told
    assert c.state is TransferState.RELEASING and c.to_post(10) == []
    assert c.checked(0, "DONE") == [Release(0)]
    assert c.released(0) == []
    assert c.checked(1, "ERR") == [Release(1)]  # an error while releasing adds no second outcome
    assert c.released(1) == [Finish(error)]
    assert c.state is TransferState.TIMED_OUT and c.quiet
    assert c.slices_errored == 1  # (an error while releasing still says bytes of slice 1 may land)


def test_end_with_nothing_in_flight_finishes_at_once():
    c = core()
    error = TransferCancelled("stop")
    assert c.end(error, now=0.0) == [Finish(error)]
    assert c.state is TransferState.CANCELLED
    assert c.end(TransferCancelled("again"), now=0.0) == []  # idempotent


def test_grace_passes_then_fenced_then_quiet():
    c = core(n=2, running=2, grace=0.5)
    post_all(c)
    c.end(TransferCancelled("stop"), now=1.0)
    assert c.tick(1.4) == []
    (fenced,) = c.tick(1.5)
    assert isinstance(fenced, Fenced) and isinstance(fenced.error, TransferFenced)
    assert isinstance(fenced.error.reason, TransferCancelled) and fenced.error.slices == 2
    assert c.state is TransferState.FENCED and not c.quiet
    assert c.tick(99.0) == []  # told once
    assert c.checked(0, "DONE") == [Release(0)] and c.released(0) == []
    assert c.checked(1, "DONE") == [Release(1)] and c.released(1) == [Quiet()]
    assert c.state is TransferState.CANCELLED and c.quiet
    assert c.slices_errored == 0  # cancelled, yet every slice posted ended DONE


def test_refused_release_is_retried_and_keeps_the_transfer_unquiet():
    c = core(n=1, running=1)
    c.to_post(1)
    assert c.posted(0, "PROC") == []
    c.end(TransferCancelled("stop"), now=0.0)
    assert c.checked(0, "DONE") == [Release(0)]
    assert c.released(0, ok=False) == [] and not c.quiet
    assert c.to_release() == [0]
    assert c.released(0) == [Finish(c.error)]


def test_nixl_error_on_a_slice_fails_the_transfer_after_siblings_end():
    c = core(n=3, running=2)
    post_all(c)
    actions = c.checked(1, "ERR")
    assert actions == [Release(1)]  # slice 0 is still running: nobody is told yet
    assert c.state is TransferState.RELEASING and c.to_post(5) == []
    assert c.released(1) == []
    assert c.checked(0, "DONE") == [Release(0)]
    (finish,) = c.released(0)
    assert isinstance(finish.error, TransferFailed) and "ERR" in str(finish.error)
    assert c.state is TransferState.FAILED and c.slices_errored == 1


def test_grace_starts_at_first_tick_when_failure_had_no_clock():
    c = core(n=2, running=2, grace=1.0)
    post_all(c)
    c.checked(0, "ERR")
    assert c.release_by is None
    assert c.tick(100.0) == [] and c.release_by == 101.0
    assert isinstance(c.tick(101.0)[0], Fenced)


def test_post_failure_without_a_handle():
    c = core(n=2, running=1)
    (i,) = c.to_post(5)
    (finish,) = c.post_failed(i, "boom")
    assert isinstance(finish, Finish) and isinstance(finish.error, TransferFailed)
    assert c.slices_errored == 1  # (a post that failed part way may have sent some bytes)


def test_chained_notification_goes_alone_last():
    c = core(n=3, running=3, chain_last=True)
    assert c.to_post(10) == [0, 1]  # the last one waits for the others
    c.posted(0, "PROC")
    c.posted(1, "DONE")
    c.released(1)
    assert c.to_post(10) == []
    c.checked(0, "DONE")
    c.released(0)
    assert c.to_post(10) == [2]


@pytest.mark.parametrize("n", [1, 3])
def test_a_write_whose_notifying_slice_is_out_completes_if_it_lands_whatever_ended_it(n):
    """Cancelled (or past its deadline) with the last slice, carrying the notification, already posted:
    the target is told the data landed once every slice ends DONE, so the caller is told it completed.
    Before, the caller heard `TransferCancelled` while the target had the bytes and the notice."""
    c = TransferCore(n, max_running=n, grace_s=1.0, chain_last=True, op="WRITE", peer="p", transfer_id=7)
    for i in range(n - 1):  # the others first, then the notifying one alone
        post_all(c, "DONE")
        assert c.released(i) == []
    assert c.to_post(10) == [n - 1] and c.posted(n - 1, "PROC") == []
    assert c.end(TransferCancelled("stop"), now=0.0) == []
    assert c.checked(n - 1, "DONE") == [Release(n - 1)]
    assert c.released(n - 1) == [Complete()]  # the engine checks it as any completion...
    assert c.succeed() == [Finish(None)]
    assert c.state is TransferState.DONE and c.quiet and c.slices_errored == 0
    # ... and refuses it past a lease that ran out meanwhile
    c = TransferCore(1, max_running=1, grace_s=1.0, chain_last=True, op="WRITE", peer="p", transfer_id=7)
    post_all(c)
    c.end(TransferCancelled("stop"), now=0.0)
    c.checked(0, "DONE")
    assert c.released(0) == [Complete()]
    late = LeaseExpired("late")
    assert c.end(late, now=1.0) == [Finish(late)] and c.state is not TransferState.DONE and c.error is late
    # A caller told it is fenced keeps that outcome when it lands later
    c = TransferCore(1, max_running=1, grace_s=1.0, chain_last=True, op="WRITE", peer="p", transfer_id=7)
    post_all(c)
    c.end(TransferCancelled("stop"), now=0.0)
    assert isinstance(c.tick(2.0)[0], Fenced)
    c.checked(0, "DONE")
    assert c.released(0) == [Quiet()] and c.state is TransferState.CANCELLED
    # A notification alone (no slice: a full prefix hit) whose sending failed is no WRITE that landed
    c = TransferCore(0, max_running=1, grace_s=1.0, chain_last=True, op="WRITE", peer="p", transfer_id=7)
    failed = TransferFailed("notify failed")
    assert c.end(failed, now=0.0) == [Finish(failed)] and c.state is TransferState.FAILED
    # ... not if a slice ended in error, nor before the notifying slice went out, nor past a lease
    for fault in ("err", "unposted", "lease"):
        c = TransferCore(2, max_running=2, grace_s=1.0, chain_last=True, op="WRITE", peer="p", transfer_id=7)
        post_all(c, "PROC")  # slice 0 only: the notifying one waits for it
        error = LeaseExpired("late") if fault == "lease" else TransferCancelled("stop")
        if fault != "unposted":
            assert c.checked(0, "DONE") == [Release(0)] and c.released(0) == []
            assert c.to_post(10) == [1] and c.posted(1, "PROC") == []
        assert c.end(error, now=0.0) == []
        last = 0 if fault == "unposted" else 1
        assert c.checked(last, "ERR" if fault == "err" else "DONE") == [Release(last)]
        assert c.released(last) == [Finish(error)], fault


def test_succeed_before_all_slices_is_a_bug():
    c = core(n=2)
    with pytest.raises(RuntimeError):
        c.succeed()


def test_zero_slices_is_a_notification_only_transfer():
    c = TransferCore(0, max_running=1, grace_s=0.0)
    assert c.to_post(5) == []
    assert c.succeed() == [Finish(None)]


# -- every order of events keeps the contract -------------------------------------------------
EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["post", "check_done", "check_err", "check_proc", "release_ok", "release_refused", "end",
                         "tick"]),
        st.integers(0, 5),
    ),
    max_size=60,
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(n=st.integers(1, 5), running=st.integers(1, 3), events=EVENTS, notifies=st.booleans())
def test_any_event_order_keeps_the_contract(n, running, events, notifies):
    """One outcome for the caller; told only when quiet (or fenced); Quiet only after Fenced;
    a running slice is never released; nothing is posted after an end. `notifies`: a WRITE whose
    last slice carries its notification."""
    c = core(n=n, running=running, grace=1.0, chain_last=notifies)
    holders: set[int] = set()  # slices with a handle in "NIXL"
    running_now: set[int] = set()
    pending_release: list[int] = []
    told: list[object] = []
    errored = 0  # slices seen ending in ERR, whatever the transfer's state then
    now = 0.0

    def apply(actions):
        for a in actions:
            if isinstance(a, Release):
                assert a.index not in running_now, "released a running slice"
                assert a.index in holders
                pending_release.append(a.index)
            elif isinstance(a, Complete):
                apply(c.succeed())
            elif isinstance(a, Finish):
                assert not holders, "caller told while NIXL still holds a handle"
                told.append(a)
            elif isinstance(a, Fenced):
                assert holders, "fenced with nothing held"
                told.append(a)
            elif isinstance(a, Quiet):
                assert not holders and told and isinstance(told[-1], Fenced)
                told.append(a)

    for kind, k in events:
        now += 0.3
        if kind == "post":
            for i in c.to_post(k + 1):
                assert c.state is TransferState.POSTING
                holders.add(i)
                running_now.add(i)
                apply(c.posted(i, "PROC"))
        elif kind.startswith("check") and running_now:
            i = sorted(running_now)[k % len(running_now)]
            state = {"check_done": "DONE", "check_err": "ERR", "check_proc": "PROC"}[kind]
            if state != "PROC":
                running_now.discard(i)
            errored += state == "ERR"
            apply(c.checked(i, state))
        elif kind.startswith("release") and pending_release:
            i = pending_release.pop(0)
            if i not in holders:
                continue  # asked twice (end() repeats releases still owed): already done
            ok = kind == "release_ok"
            if ok:
                holders.discard(i)
            apply(c.released(i, ok))
            if not ok:
                assert i in c.to_release()
                pending_release.append(i)
        elif kind == "end":
            apply(c.end(TransferCancelled("x"), now))
        elif kind == "tick":
            apply(c.tick(now))
    outcomes = [t for t in told if isinstance(t, Finish | Fenced)]
    assert len(outcomes) <= 1
    assert c.slices_errored == errored
    assert (c.state in (TransferState.RELEASING, TransferState.FENCED)) == (bool(holders) and c.error is not None)


def test_slice_indices_beyond_a_machine_word_are_tracked_and_released_in_order():
    # Running/unreleased slices are bit masks: indices past 64 must behave like small ones.
    c = core(n=130, running=4)
    for _ in range(31):
        for i in c.to_post(4):
            assert c.posted(i, "PROC") == []
        running = c.running_list()
        assert running == sorted(running) and len(running) == 4
        for i in running[:2]:
            assert c.checked(i, "DONE") == [Release(i)]
        c.released(running[1])
        c.released(running[0], ok=False)  # refused once: retried via to_release
        assert c.to_release() == [running[0]]
        c.released(running[0])
        for i in running[2:]:
            c.checked(i, "DONE")
            c.released(i)
    assert c.slices_done == 124 and c.to_post(10) == [124, 125, 126, 127]
    for i in [124, 125, 126, 127]:
        c.posted(i, "DONE")
        c.released(i)
    assert c.to_post(1) == [128]
    c.posted(128, "DONE")
    c.released(128)
    assert c.to_post(10) == [129]
    c.posted(129, "PROC")
    actions = c.end(TransferCancelled("stop"), 0.0)
    assert actions == [] and not c.quiet and c.running_list() == [129]
    assert c.checked(129, "DONE") == [Release(129)] and c.released(129) == [Finish(c.error)]
