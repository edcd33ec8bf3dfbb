"""`PushBook`: prefill's matching of decode registrations and finished requests (pure logic)."""

from __future__ import annotations

import math
import os

import msgspec
import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")

from nixl_async import ViewSpec
from nixl_async_vllm.push_book import (
    PushBook,
    PushGroup,
    PushRegistration,
    base_request_id,
    decode_registration,
    encode_registration,
)

BLOCKS = ([3, 4, 5],)
NOW = 50.0  # wall clock; registrations' write_by is 100 by default


def _reg(request_id: str, decode: str = "d/tp0", write_by: float = 100.0) -> PushRegistration:
    return PushRegistration(
        request_id=request_id, decode_request_id=f"{request_id}-decode", decode_engine_id=decode,
        decode_host="10.0.0.2", decode_port=5600, decode_tp=1, decode_pages=1,
        groups=[PushGroup("full", [7, 8, 9], None)], write=True, write_by=write_by,
    )  # fmt: skip


def test_registration_round_trips_on_the_wire():
    reg = msgspec.structs.replace(_reg("r"), decode_view=ViewSpec(chunk_offset=64, chunk_len=64))
    assert decode_registration(encode_registration(reg)) == reg


def test_suffix_stripping_matches_vllm_ids_only():
    assert base_request_id("cmpl-abc-0-1a2b3c4d") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-0") == "cmpl-abc-0"
    assert base_request_id("cmpl-abc-0-xyz12345") == "cmpl-abc-0-xyz12345"  # not hex: kept


def test_a_registration_before_the_request_finishes_waits_for_it():
    book = PushBook()
    assert book.register(_reg("cmpl-a-0"), NOW) is None
    assert book.waiting() == 1
    matched = book.finished("cmpl-a-0-0badf00d", BLOCKS)  # prefill's id carries vLLM's suffix
    assert [r.request_id for r in matched] == ["cmpl-a-0"] and book.waiting() == 0


def test_a_registration_after_the_request_finished_is_pushed_at_once():
    book = PushBook()
    assert book.finished("cmpl-a-0-0badf00d", BLOCKS) == []
    assert book.register(_reg("cmpl-a-0"), NOW) == ("cmpl-a-0-0badf00d", BLOCKS, _reg("cmpl-a-0"))
    assert book.register(_reg("cmpl-b-0"), NOW) is None, "another request does not match"


def test_blocks_are_not_released_while_a_push_reads_them():
    book = PushBook(grace_s=5.0)
    book.finished("r-0badf00d", BLOCKS)
    assert book.register(_reg("r", "d/tp0"), NOW) is not None
    assert book.register(_reg("r", "d/tp1"), NOW) is not None  # two decode ranks read this prefill rank
    assert not book.release("r-0badf00d", NOW), "two pushes run"
    assert book.closing() == ["r-0badf00d"]
    assert book.register(_reg("r", "d/tp2"), NOW) is None, "a request being freed takes no new registration"
    book.ended("r-0badf00d")
    assert not book.release("r-0badf00d", NOW), "one push still runs"
    book.ended("r-0badf00d")
    assert book.release("r-0badf00d", NOW) and book.closing() == []
    assert book.expire(NOW + 5.0).doubted == [_reg("r", "d/tp2")], "told once no retry came"


def test_a_registration_for_a_released_request_is_doubted_then_told():
    """Before, it was answered "gone" at once, and so was a retry under the same id (vLLM's serves it)."""
    book = PushBook(grace_s=5.0)
    book.finished("r-0badf00d", BLOCKS)
    assert book.release("r-0badf00d", NOW)  # lease ran out, no decode came
    assert book.register(_reg("r"), NOW) is None and book.waiting() == 1
    assert book.next_doubt() == NOW + 5.0
    assert book.expire(NOW + 4.9) == ([], []), "waits for a retry"
    assert book.expire(NOW + 5.0) == ([], [_reg("r")])
    assert book.waiting() == 0 and book.next_doubt() is None


def test_a_retry_under_a_freed_request_s_id_gets_its_registration():
    book = PushBook(grace_s=5.0)
    book.finished("r-0badf00d", BLOCKS)
    assert book.release("r-0badf00d", NOW)
    assert book.register(_reg("r"), NOW) is None  # decode's leg of the retry came first
    assert book.finished("r-0feedbee", BLOCKS) == [_reg("r")], "the retry, computed, takes it"
    assert book.next_doubt() is None and book.expire(NOW + 10.0) == ([], [])
    assert book.register(_reg("r", "d/tp1"), NOW) is not None, "and the retry is not gone"


def test_registrations_for_a_request_aborted_before_it_finished_are_told():
    """Prefill dropped the request (client gone): before, its decode waited out its whole deadline."""
    book = PushBook(grace_s=5.0)
    assert book.register(_reg("r"), NOW) is None
    assert book.release("r-0badf00d", NOW + 1.0), "aborted: nothing was computed, nothing runs"
    assert book.next_doubt() == NOW + 6.0
    assert book.expire(NOW + 6.0).doubted == [_reg("r")]
    assert book.register(_reg("r", "d/tp1"), NOW + 7.0) is None and book.next_doubt() == NOW + 12.0


def test_unclaimed_registrations_expire_at_their_write_by():
    book = PushBook()
    book.register(_reg("early", write_by=10.0), 0.0)
    book.register(_reg("late", write_by=20.0), 0.0)
    assert [r.request_id for r in book.expire(15.0).unclaimed] == ["early"]
    assert book.finished("early", BLOCKS) == [], "an expired registration is never pushed"
    assert [r.request_id for r in book.finished("late", BLOCKS)] == ["late"]


def test_a_request_still_computing_is_claimed_by_registrations_already_there():
    """Progressive push: registrations present while prefill computes are pushed layer by layer."""
    book = PushBook()
    assert book.register(_reg("r", "d/tp0"), NOW) is None
    assert [x.decode_engine_id for x in book.claim("r-0badf00d")] == ["d/tp0"]
    assert book.register(_reg("r", "d/tp1"), NOW) is None, "not computed yet: waits for the next claim or the end"
    assert book.claim("r-0badf00d") and book.claim("r-0badf00d") == []
    assert book.register(_reg("r", "d/tp2"), NOW) is None
    assert [x.decode_engine_id for x in book.finished("r-0badf00d", BLOCKS)] == ["d/tp2"]
    assert book.register(_reg("r", "d/tp3"), NOW) is not None, "computed: pushed whole at once"
    assert not book.release("r-0badf00d", NOW), "four pushes run"
    for _ in range(4):
        book.ended("r-0badf00d")
    assert book.closing() == [] and book.register(_reg("r", "d/tp4"), NOW) is None, "forgotten once the last push ended"
    assert book.next_doubt() is not None


def test_an_abandoned_request_takes_no_registration_and_is_forgotten_after_its_pushes():
    book = PushBook()
    book.register(_reg("r"), NOW)
    assert book.claim("r") and not book.release("r", NOW), "prefill aborted it while its layers were pushed"
    assert book.register(_reg("r", "d/tp1"), NOW) is None and book.claim("r") == []
    book.ended("r")
    assert book.closing() == [] and book.release("r", NOW)


def _attempt(request_id: str, decode_request_id: str, decode: str = "d/tp0") -> PushRegistration:
    return msgspec.structs.replace(_reg(request_id, decode), decode_request_id=decode_request_id)


def test_a_retry_s_registration_supersedes_its_earlier_attempt_s_from_the_same_decode_rank():
    """Both attempts' registrations waited under one id: the push went to the first (attempt 1's decode,
    the push id being per rank) and the retry's decode waited out its watchdog. Now attempt 1's is told."""
    book = PushBook(grace_s=5.0)
    assert book.register(_attempt("r", "r-try1"), NOW) is None
    assert book.release("r-0badf00d", NOW), "prefill aborted attempt 1"
    assert book.register(_attempt("r", "r-try2"), NOW + 1.0) is None
    assert book.register(_attempt("r", "r-other", "d/tp1"), NOW + 1.0) is None, "another rank's stays"
    assert book.next_doubt() == -math.inf, "attempt 1's decode is told at once"
    assert book.expire(NOW + 1.0).doubted == [_attempt("r", "r-try1")]
    taken = book.finished("r-0feedbee", BLOCKS)
    assert sorted(r.decode_request_id for r in taken) == ["r-other", "r-try2"]


def test_a_retry_prefill_computes_is_not_doubted():
    """The retry's decode registered first and the earlier attempt's id was gone: its registration must
    wait for the retry's prefill, however long it computes, instead of being told after the grace."""
    book = PushBook(grace_s=5.0)
    book.finished("r-0badf00d", BLOCKS)
    assert book.release("r-0badf00d", NOW)
    assert book.register(_reg("r"), NOW) is None and book.next_doubt() == NOW + 5.0
    book.computing({"r-0feedbee"})  # vLLM's step: the retry is in prefill's batch
    assert book.next_doubt() is None and book.expire(NOW + 40.0) == ([], []), "long after the grace"
    assert book.finished("r-0feedbee", BLOCKS) == [_reg("r")]


def test_a_registration_waiting_while_a_progressive_push_runs_is_told_when_prefill_aborts():
    """A claim took rank 0's registration; rank 1's came later and waited. Prefill aborted the request:
    rank 1's was kept until its write_by, and its decode waited out the watchdog."""
    book = PushBook(grace_s=5.0)
    assert book.register(_reg("r", "d/tp0"), NOW) is None
    assert book.claim("r-0badf00d") == [_reg("r", "d/tp0")]
    assert book.register(_reg("r", "d/tp1"), NOW) is None
    assert not book.release("r-0badf00d", NOW), "rank 0's push still runs"
    assert book.expire(NOW + 5.0).doubted == [_reg("r", "d/tp1")]


def _withdrawal(registration: PushRegistration) -> PushRegistration:
    return msgspec.structs.replace(registration, write=False)  # what decode sends to withdraw


def test_a_withdrawn_registration_that_waited_writes_nothing_and_lets_prefill_free_the_request():
    """Decode gave up on the request (its client went away) before prefill computed it. Before, prefill
    knew nothing of it: it computed and wrote the request into blocks decode held for nobody."""
    book = PushBook()
    assert book.register(_reg("r", "d/tp0"), NOW) is None
    assert book.register(_reg("r", "d/tp1"), NOW) is None
    assert book.withdraw(_withdrawal(_reg("r", "d/tp0"))), "it was waiting"
    taken = book.finished("r-0badf00d", BLOCKS)
    assert [(r.decode_engine_id, r.write) for r in taken] == [("d/tp0", False), ("d/tp1", True)]


def test_a_registration_overtaken_by_its_withdrawal_writes_nothing():
    book = PushBook()
    book.finished("r-0badf00d", BLOCKS)
    assert not book.withdraw(_withdrawal(_reg("r"))), "not here: a push of it may run, or it never came"
    # matched, to let the request be freed, but never to write (another rank's is untouched)
    assert book.register(_reg("r"), NOW) == ("r-0badf00d", BLOCKS, _withdrawal(_reg("r")))
    assert book.register(_reg("r", "d/tp1"), NOW) == ("r-0badf00d", BLOCKS, _reg("r", "d/tp1"))
    book2 = PushBook()
    book2.withdraw(_withdrawal(_reg("r")))
    assert book2.register(_reg("r"), NOW) is None
    assert [r.write for r in book2.finished("r-0badf00d", BLOCKS)] == [False], "waiting, too"


def test_withdrawals_are_remembered_until_their_write_by():
    book = PushBook()
    book.withdraw(_withdrawal(_reg("r", write_by=10.0)))
    book.expire(9.0)
    book.register(_reg("r", write_by=10.0), 9.0)
    assert [r.write for r in book.claim("r")] == [False]
    book.expire(10.0)
    book.register(_reg("s", write_by=30.0), 10.0)
    book.withdraw(_withdrawal(_reg("s", write_by=30.0)))
    assert book.expire(30.0).unclaimed == [_withdrawal(_reg("s", write_by=30.0))]
    assert book.register(_reg("r", write_by=40.0), 30.0) is None
    assert [r.write for r in book.claim("r")] == [True], "a later registration of the same ids writes again"


def test_a_registration_superseded_by_vllm_s_stub_is_withdrawn_without_being_told():
    """When its client goes away, vLLM's decode also registers a stub that reads nothing under the client's
    own id: it supersedes the waiting registration, which, withdrawn next, was never written and needs no notice."""
    book = PushBook()
    assert book.register(_attempt("r", "cmpl-r-0-0badf00d"), NOW) is None
    assert book.register(_withdrawal(_attempt("r", "r")), NOW) is None  # the stub
    assert book.next_doubt() == -math.inf
    assert book.withdraw(_withdrawal(_attempt("r", "cmpl-r-0-0badf00d")))
    assert book.expire(NOW) == ([], []) and book.next_doubt() is None, "nobody to tell"
    assert [r.decode_request_id for r in book.finished("r-0feedbee", BLOCKS)] == ["r"], "the stub lets it be freed"


@pytest.mark.parametrize(
    "registration, renewal",
    [(b"\x81\xb0decode_engine_id\xa2\xff\xfe", b"\x91\xa2\xff\xfe"),  # a string that is not UTF-8
     (b"\x81\xa1x" + b"\x91" * 1000 + b"\xc0", None)],  # an unknown field nested ~1000 deep
    ids=["not_utf8", "deep"],
)  # fmt: skip
def test_registrations_and_renewals_msgspec_raises_oddly_on_are_decode_errors(registration, renewal):
    """A string that is not UTF-8, or nesting ~1000 deep: msgspec raises `UnicodeDecodeError` / `RecursionError`,
    not `DecodeError`, so the adapter's handlers logged a traceback per call and a renewal round skipped telling
    its caller (found by a review)."""
    import msgspec

    from nixl_async_vllm.leases import answer_renewal
    from nixl_async_vllm.send_book import SendBook

    with pytest.raises(msgspec.DecodeError):
        decode_registration(registration)
    if renewal is not None:
        with pytest.raises(msgspec.DecodeError):
            answer_renewal(SendBook(), renewal, 30.0)
