"""A batch's state machine, driven by events alone (no NIXL, no loop)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nixl_async._batch_state import BatchCore
from nixl_async._state import Complete, Fenced, Finish, Quiet, Release, TransferState
from nixl_async.exceptions import BatchRowsFailed, TransferCancelled, TransferFenced, TransferTimeout


def batch(rows=4, grace=1.0):
    return BatchCore(rows, grace_s=grace, op="READ", peer="p", transfer_id=3)


def test_every_row_may_be_in_flight_and_completes_once_all_are_released():
    c = batch(4)
    assert c.to_post(3) == [0, 1, 2] and c.can_post_now
    assert [c.posted(i, "PROC") for i in (0, 1, 2)] == [[], [], []]
    assert c.to_post(10) == [3] and not c.can_post_now and c.to_post(10) == []
    assert c.posted(3, "DONE") == [Release(3)] and c.released(3) == []
    for i in (2, 0, 1):
        assert c.checked(i, "DONE") == [Release(i)]
    assert c.released(2) == [] and c.released(0) == []
    assert c.released(1) == [Complete()]
    assert c.succeed() == [Finish(None)]
    assert c.state is TransferState.DONE and c.quiet and list(c.arrived) == [1, 1, 1, 1]


def test_a_failed_row_fails_alone_and_the_batch_names_it():
    c = batch(3)
    for i in c.to_post(3):
        c.posted(i, "PROC")
    assert c.checked(1, "ERR") == [Release(1)] and c.released(1) == []
    assert c.state is TransferState.POSTING  # the other rows go on
    c.checked(0, "DONE"), c.released(0)
    c.checked(2, "DONE")
    assert c.released(2) == [Complete()]
    [finish] = c.succeed()
    assert isinstance(finish, Finish) and isinstance(finish.error, BatchRowsFailed)
    assert finish.error.failed_rows == {1: "NIXL state ERR"} and "1 of 3 rows" in str(finish.error)
    assert c.state is TransferState.FAILED and list(c.arrived) == [1, 0, 1] and c.slices_done == 2
    assert c.slices_errored == 1


def test_a_row_whose_post_raised_holds_no_handle_and_fails_alone():
    c = batch(2)
    assert c.to_post(2) == [0, 1]
    assert c.post_failed(0, "bad descriptor") == []
    assert c.posted(1, "DONE") == [Release(1)]
    assert c.released(1) == [Complete()]
    assert c.failed_rows == {0: "posting failed: bad descriptor"} and c.slices_errored == 1
    last = batch(2)  # the row whose post raises is the last to end: it completes the batch
    last.to_post(2), last.posted(0, "DONE"), last.released(0)
    assert last.post_failed(1, "gone") == [Complete()]


def test_running_rows_are_released_only_after_they_end_when_the_batch_is_ended():
    c = batch(5)
    for i in c.to_post(3):  # rows 3 and 4 are never posted
        c.posted(i, "PROC")
    c.checked(2, "DONE")  # ended, its release not done yet
    error = TransferTimeout("late", transfer_id=3)
    assert c.end(error, now=10.0) == [Release(2)]  # only the row that ended
    assert c.to_post(10) == [] and not c.wants_post
    assert c.released(2) == []
    assert c.checked(0, "ERR") == [Release(0)] and c.released(0) == []
    assert c.checked(1, "DONE") == [Release(1)]
    assert c.released(1) == [Finish(error)]
    assert c.state is TransferState.TIMED_OUT and c.quiet


def test_past_the_grace_the_batch_is_fenced_then_quiet():
    c = batch(2, grace=0.5)
    for i in c.to_post(2):
        c.posted(i, "PROC")
    cancel = TransferCancelled("stop")
    assert c.end(cancel, now=None) == []
    assert c.tick(100.0) == []  # the grace starts at the first tick
    [fenced] = c.tick(100.5)
    assert isinstance(fenced, Fenced) and isinstance(fenced.error, TransferFenced)
    assert fenced.error.reason is cancel and fenced.error.slices == 2
    assert c.state is TransferState.FENCED
    c.checked(0, "DONE"), c.released(0)
    c.checked(1, "DONE")
    assert c.released(1, ok=False) == [] and c.to_release() == [1]  # NIXL refused: retried later
    assert c.released(1) == [Quiet()] and c.quiet


def test_a_row_still_in_flight_moves_behind_those_not_checked_yet():
    c = batch(4)
    for i in c.to_post(4):
        c.posted(i, "PROC")
    assert c.checked(0, "PROC") == [] and c.checked(1, "PROC") == []
    assert c.running_list() == [2, 3, 0, 1]  # a sweep out of time starts with 2 next


def test_an_empty_batch_is_refused():
    with pytest.raises(ValueError, match="at least one row"):
        batch(0)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["post", "check", "release", "refuse", "end", "tick"]), st.integers(0, 5)),
             max_size=60),
    st.lists(st.sampled_from(["DONE", "PROC", "ERR", "RAISE"]), min_size=6, max_size=6),
)  # fmt: skip
def test_the_caller_is_told_exactly_once_and_only_when_quiet_or_fenced(events, answers):
    """Whatever happens (rows posted or not, their posts raising, checks, refused releases, the batch ended,
    time passing), one Finish or Fenced comes out in the end, a Finish only once no row holds a handle, and a
    fenced batch turns Quiet once NIXL lets go of everything."""
    c = batch(6, grace=1.0)
    told: list = []
    now = 0.0

    def take(actions):
        for action in actions:
            if isinstance(action, Complete):
                take(c.succeed())
            elif not isinstance(action, Release):  # releases happen as "release" events
                told.append(action)
                if isinstance(action, Finish):
                    assert c.quiet, "the caller was told while a row still holds a handle"

    def post_one():
        for row in c.to_post(1):
            take(c.post_failed(row, "raised") if answers[row] == "RAISE" else c.posted(row, "PROC"))

    for kind, row in events:
        now += 0.3
        if kind == "post":
            post_one()
        elif kind == "check":
            take(c.checked(row, "DONE" if answers[row] == "RAISE" else answers[row]))
        elif kind in ("release", "refuse"):
            take(c.released(row, ok=kind == "release") if row in c.to_release() else [])
        elif kind == "end":
            take(c.end(TransferCancelled("stop"), now))
        else:
            take(c.tick(now))
    # NIXL finishes everything and lets go: each row left is posted (unless ended), ends and is released
    # before the next one is posted, so a row whose post raises may be the last to end
    while c.wants_post or c.running_list() or c.to_release():
        post_one()
        for row in c.running_list():
            take(c.checked(row, "DONE"))
        for row in c.to_release():
            take(c.released(row))
    take(c.tick(now + 10.0))
    outcomes = [a for a in told if isinstance(a, Finish | Fenced)]
    assert len(outcomes) == 1, told
    assert c.quiet and (isinstance(outcomes[0], Finish) or told[-1] == Quiet())


def test_a_budget_below_zero_posts_nothing_and_hands_out_no_row_twice():
    core = batch(4)
    assert core.to_post(2) == [0, 1]
    assert core.to_post(-1) == []
    assert core.to_post(10) == [2, 3]
