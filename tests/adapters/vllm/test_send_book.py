"""Producer bookkeeping (pure logic): fan-in counting, early notifications, leases, strays."""

import pytest

from nixl_async_vllm.send_book import SendBook, parse_notification


def test_blocks_are_freed_after_every_reader_notified():
    book = SendBook()
    book.in_batch({"r1"})
    book.hold("r1", deadline=100.0)
    assert book.notified(b"r1:2")
    assert book.collect(now=1.0) == (set(), set()), "one of two readers is not enough"
    assert book.notified(b"r1:2")
    assert book.collect(now=1.0) == ({"r1"}, set())
    assert len(book) == 0 and not book.notified(b"r1:2"), "a reported request is forgotten"


def test_notifications_arriving_before_the_lease_are_kept():
    book = SendBook()
    book.in_batch({"r1"})
    assert book.notified(b"r1:1")  # decode was faster than our scheduler's next step
    assert book.collect(now=1.0) == (set(), set()), "nothing to free before vLLM hands the blocks over"
    book.hold("r1", deadline=100.0)
    assert book.collect(now=1.0) == ({"r1"}, set())


def test_lease_expiry_frees_blocks_of_a_vanished_reader():
    book = SendBook()
    book.hold("r1", deadline=10.0)
    book.hold("r2", deadline=20.0)
    assert book.collect(now=9.9) == (set(), set())
    assert book.collect(now=10.0) == (set(), {"r1"})
    assert book.collect(now=25.0) == (set(), {"r2"})


def test_stray_and_malformed_notifications_free_nothing():
    book = SendBook()
    book.hold("r1", deadline=100.0)
    for message in (b"other:1", b"r1", b"r1:x", b"r1:0", b":1", b"\xff\xfe:1"):
        assert not book.notified(message), message
    assert book.collect(now=1.0) == (set(), set())


def test_aborted_request_is_dropped():
    book = SendBook()
    book.in_batch({"r1"})
    book.drop("r1")
    assert not book.notified(b"r1:1")


def test_parse_notification_keeps_colons_in_request_ids():
    assert parse_notification(b"cmpl-1:a:b:3") == ("cmpl-1:a:b", 3)
    assert parse_notification(b"no-count") is None


@pytest.mark.parametrize("message", ["r1:\u00b2", "r1:\u2460", "r1:" + "9" * 5000, "r1:0", "r1:-1", ":1", "r1:"])
def test_a_malformed_notification_is_refused_not_raised(message):
    """Digits str.isdigit() takes but int() refuses ("²", "①"), or too many for int(): before, the
    ValueError left the producer's get_finished and stopped vLLM's step. A peer may send anything."""
    assert parse_notification(message.encode()) is None
    book = SendBook()
    book.hold("r1", deadline=10.0)
    assert not book.notified(message.encode())


def test_a_renewal_only_moves_a_held_lease_later_and_says_until_when():
    book = SendBook()
    book.hold("r1", deadline=10.0)
    assert book.renew(["r1"], until=15.0) == {"r1": 15.0}
    assert book.renew(["r1"], until=12.0) == {"r1": 15.0}, "a late or reordered heartbeat never shortens it"
    assert book.collect(now=14.9) == (set(), set())
    assert book.collect(now=15.0) == (set(), {"r1"})


def test_renewing_a_request_we_no_longer_hold_answers_nothing_for_it():
    book = SendBook()
    book.hold("r1", deadline=10.0)
    book.hold("r2", deadline=10.0)
    assert book.notified(b"r1:1")
    assert book.collect(now=1.0) == ({"r1"}, set())
    assert book.collect(now=11.0) == (set(), {"r2"})
    assert book.renew(["r1", "r2", "never-seen"], until=20.0) == {}, "the reader must learn the blocks are gone"


def test_a_renewal_while_still_in_batch_is_applied_when_the_lease_starts():
    book = SendBook()
    book.in_batch({"r1"})
    assert book.renew(["r1"], until=30.0) == {"r1": 30.0}
    book.hold("r1", deadline=20.0)
    assert book.collect(now=25.0) == (set(), set()), "the acknowledged renewal holds"
    assert book.collect(now=30.0) == (set(), {"r1"})
    book.in_batch({"r2"})
    book.renew(["r2"], until=5.0)
    book.hold("r2", deadline=20.0)
    assert book.collect(now=19.0) == (set(), set()), "an earlier renewal does not shorten the lease"


def test_push_renewals_match_the_id_the_proxy_gave_prefill():
    """In push mode decode knows prefill's request by the proxy's id; vLLM adds a suffix on prefill.
    Before, such renewals matched nothing and a request queued on decode past the lease lost its blocks."""
    from nixl_async_vllm.push_book import base_request_id

    book = SendBook(base_id=base_request_id)
    book.in_batch({"cmpl-x-0-abcd1234"})
    assert book.renew(["cmpl-x-0"], until=15.0) == {"cmpl-x-0": 15.0}, "still computing: renewed on hold"
    book.hold("cmpl-x-0-abcd1234", deadline=10.0)
    assert book.renew(["cmpl-x-0"], until=20.0) == {"cmpl-x-0": 20.0}
    assert book.collect(now=19.9) == (set(), set())
    assert book.collect(now=20.0) == (set(), {"cmpl-x-0-abcd1234"})
    assert book.renew(["cmpl-x-0"], until=30.0) == {}, "a freed request renews nothing"
    pull = SendBook()
    pull.hold("cmpl-x-0-abcd1234", deadline=10.0)
    assert pull.renew(["cmpl-x-0"], until=30.0) == {}, "pull mode matches exact ids only"
