"""The notification mailbox as a pure state machine (no NIXL)."""

import asyncio
import contextlib

import pytest

from nixl_async.exceptions import NotificationsLost, NotificationTimeout
from nixl_async.notifications import Lease, Notification, NotificationBox


async def test_message_before_wait_is_kept():
    box = NotificationBox(100)
    box.deliver("p1", b"req-1")
    assert await box.wait(b"req-1", timeout=0.1) == ["p1"]
    assert box.unclaimed == 0


async def test_fan_in_counts_senders_across_early_and_late_arrivals():
    box = NotificationBox(100)
    box.deliver("rank0", b"r")
    waiter = asyncio.ensure_future(box.wait(b"r", count=3, timeout=1))
    await asyncio.sleep(0)
    box.deliver("rank1", b"r")
    assert not waiter.done()
    box.deliver("rank2", b"r")
    assert await waiter == ["rank0", "rank1", "rank2"]


async def test_timeout_puts_collected_notifications_back():
    box = NotificationBox(100)
    box.deliver("a", b"m")
    with pytest.raises(NotificationTimeout, match="1 of 2"):
        await box.wait(b"m", count=2, timeout=0.02)
    assert box.unclaimed == 1
    assert not box.has_waiters
    box.deliver("b", b"m")
    assert await box.wait(b"m", count=2, timeout=0.1) == ["a", "b"]
    long = b"push:" + b"r" * 3000
    with pytest.raises(NotificationTimeout) as timed_out:  # (before: all 3 KB of it in the text, and every log line)
        await box.wait(long, timeout=0.01)
    assert len(str(timed_out.value)) < 200 and "3005 B" in str(timed_out.value)
    assert timed_out.value.message == long


async def test_cancelled_waiter_loses_nothing():
    box = NotificationBox(100)
    task = asyncio.ensure_future(box.wait(b"m", count=2))
    await asyncio.sleep(0)
    box.deliver("a", b"m")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert box.unclaimed == 1


async def test_a_waiter_cancelled_after_its_count_was_met_loses_nothing():
    """The notification came, then the waiting task was cancelled before it resumed (a TaskGroup sibling
    failed, a timeout fired in the same loop pass): the notification is kept for the next waiter."""
    box = NotificationBox(100)
    task = asyncio.ensure_future(box.wait(b"m"))
    await asyncio.sleep(0)
    box.deliver("a", b"m")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await box.wait(b"m", timeout=0.1) == ["a"]


async def test_notifications_given_back_go_to_the_waiters_behind():
    box = NotificationBox(100)
    pair = asyncio.ensure_future(box.wait(b"m", count=2, timeout=0.05))
    await asyncio.sleep(0)
    single = asyncio.ensure_future(box.wait(b"m", count=1, timeout=5))
    await asyncio.sleep(0)
    box.deliver("a", b"m")  # the first waiter takes it, and then times out
    with pytest.raises(NotificationTimeout):
        await pair
    assert await asyncio.wait_for(single, 1) == ["a"]
    assert box.unclaimed == 0


async def test_waiters_are_served_in_order_and_other_messages_untouched():
    box = NotificationBox(100)
    first = asyncio.ensure_future(box.wait(b"m"))
    second = asyncio.ensure_future(box.wait(b"m"))
    await asyncio.sleep(0)
    box.deliver("x", b"other")
    box.deliver("a", b"m")
    box.deliver("b", b"m")
    assert (await first, await second) == (["a"], ["b"])
    assert box.unclaimed == 1


async def test_a_subscription_sees_what_arrives_before_its_first_read_and_ends_when_dropped():
    box = NotificationBox(100)
    subscription = box.subscribe(claim=True)
    box.deliver("a", b"early")  # before anyone iterates
    assert await anext(subscription) == Notification("a", b"early")
    assert box.unclaimed == 0, "claimed from the moment it was made"
    reader = asyncio.ensure_future(anext(subscription))
    await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    box.deliver("a", b"after")
    assert box.unclaimed == 1, "a cancelled iteration ended the subscription"
    unread = box.subscribe()
    del unread
    await asyncio.sleep(0)  # (it leaves on the loop: the garbage collector may drop it on any thread)
    box.deliver("a", b"later")
    assert not box._subscribers, "a subscription dropped unread leaves"
    ended = box.subscribe()
    reader = asyncio.ensure_future(anext(ended, None))
    await asyncio.sleep(0)
    await ended.aclose()
    assert await asyncio.wait_for(reader, 1) is None, "a task reading it when it is closed ends too"


async def test_unclaimed_notifications_are_bounded():
    box = NotificationBox(3)
    for i in range(5):
        box.deliver("p", f"m{i}".encode())
    assert box.unclaimed == 3 and box.dropped == 2
    with pytest.raises(NotificationTimeout):
        await box.wait(b"m0", timeout=0.01)
    assert await box.wait(b"m4", timeout=0.01) == ["p"]


async def test_unclaimed_notifications_are_bounded_in_bytes_too():
    """NIXL takes notifications of a MiB: 65,536 distinct ones kept would be 64 GiB (before: bounded by count only)."""
    budget = (3 << 20) + 3  # (three messages and their one-letter sender)
    box = NotificationBox(100, max_unclaimed_bytes=budget)
    for i in range(5):
        box.deliver("p", bytes([i]) * (1 << 20))
    assert box.unclaimed == 3 and box.dropped == 2 and box._unclaimed_bytes == budget
    assert await box.wait(bytes([4]) * (1 << 20), timeout=0.01) == ["p"]
    assert box._unclaimed_bytes == (2 << 20) + 2, "a claimed message's bytes leave the budget"
    box.deliver("p", b"x" * (4 << 20))  # larger than the whole budget: kept by nobody
    assert box._unclaimed_bytes <= budget
    for _ in range(3):
        box.deliver("q", b"small")  # the same message from many senders counts its bytes once
    assert box._unclaimed_bytes <= budget and box.unclaimed >= 3


async def test_senders_ids_count_in_the_byte_bound_and_drops_are_logged(caplog):
    """A notifications audit of session 39: each kept notification holds its sender's id, which the byte bound
    did not count (a peer naming itself with a 50 KB id kept 50 MB against a 1 KiB bound), and notifications
    pushed out by the bound were counted but never logged (a later wait just timed out)."""
    box = NotificationBox(100_000, max_unclaimed_bytes=1 << 10)
    with caplog.at_level("WARNING", logger="nixl_async.engine"):
        for i in range(1000):
            box.deliver("x" * 50_000, f"m{i}".encode())
    assert box._unclaimed_bytes <= 1 << 10 and box.unclaimed <= 1 and box.dropped >= 999
    assert [r.message for r in caplog.records].count(next(r.message for r in caplog.records)) == 1  # once a while
    assert "unclaimed notifications dropped" in caplog.records[0].message
    if box.unclaimed:
        await box.wait(b"m999", timeout=0.01)
    assert box._unclaimed_bytes == 0


async def test_subscription_sees_every_delivery_and_ends_on_close():
    box = NotificationBox(10)
    seen = []

    async def consume():
        async for n in box.subscribe():
            seen.append(n)

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0)
    box.deliver("a", b"1")
    box.deliver("b", b"2")
    box.close(RuntimeError("closed"))
    await asyncio.wait_for(task, 1)
    assert seen == [Notification("a", b"1"), Notification("b", b"2")]


@pytest.mark.parametrize("claim", [False, True])
async def test_a_subscription_too_far_behind_reads_what_it_holds_then_is_told_it_lost_the_rest(claim):
    """Before, a subscription nobody read (or one slower than a flood) held every notification since it
    began: unbounded, where the unclaimed mailbox is bounded in count and bytes."""
    box = NotificationBox(3, max_unclaimed_bytes=1 << 20)
    behind, keeping_up = box.subscribe(claim=claim), box.subscribe()
    for i in range(5):
        box.deliver("p", b"m%d" % i)
        assert (await anext(keeping_up)).message == b"m%d" % i
    assert [(await anext(behind)).message for _ in range(3)] == [b"m0", b"m1", b"m2"]
    with pytest.raises(NotificationsLost):
        await anext(behind)
    with pytest.raises(StopAsyncIteration):
        await anext(behind)
    assert box.lost_subscriptions == 1 and box._claiming == 0 and len(box._subscribers) == 1
    box.deliver("p", b"m5")  # the one keeping up goes on; claiming ended with the lost one: kept unclaimed
    assert (await anext(keeping_up)).message == b"m5" and box.unclaimed == 3  # (claimed: m3, m4, m5)
    big = box.subscribe()
    box.deliver("p", b"x" * (1 << 20))  # fits
    box.deliver("p", b"y")  # over the byte budget with the MiB unread
    assert (await anext(big)).message == b"x" * (1 << 20)
    with pytest.raises(NotificationsLost):
        await anext(big)


async def test_close_fails_waiters():
    box = NotificationBox(10)
    waiter = asyncio.ensure_future(box.wait(b"m"))
    await asyncio.sleep(0)
    box.close(RuntimeError("closed"))
    with pytest.raises(RuntimeError, match="closed"):
        await waiter


async def test_count_must_be_positive():
    with pytest.raises(ValueError):
        await NotificationBox(1).wait(b"m", count=0)


async def test_a_caught_up_subscription_takes_a_message_over_the_byte_budget_and_a_late_one_ends_at_once():
    box = NotificationBox(8, max_unclaimed_bytes=1 << 10)
    subscription = box.subscribe()
    box.deliver("p", b"x" * (4 << 10))  # alone over the budget: nothing unread before it, so it is delivered
    assert (await anext(subscription)).message == b"x" * (4 << 10) and box.lost_subscriptions == 0
    box.close(RuntimeError("closed"))
    late = box.subscribe()  # after the close (a feed resubscribing as the engine closes): ends, never waits
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(late), 1)


@pytest.mark.parametrize("count", [1.5, float("nan"), True, "2"])
async def test_a_count_that_is_not_a_whole_number_is_refused(count):
    """Before, 1.5 or NaN was never met: the wait took every matching message, for ever (no timeout)."""
    box = NotificationBox(10)
    with pytest.raises(ValueError, match="whole number"):
        await box.wait(b"m", count)
    for timeout in (float("nan"), "5", True):
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            await box.wait(b"m", 1, timeout=timeout)


async def test_a_cancelled_lease_awaited_says_false():
    """Before, awaiting it raised `CancelledError` in a task nobody cancelled (a TaskGroup then stopped)."""
    lease = Lease(NotificationBox(10), b"req", readers=1, ttl_s=30)
    lease.cancel()
    assert await asyncio.wait_for(lease.wait(), 1) is False

    async def awaiter() -> bool:  # a task that swallowed an earlier cancellation (without uncancel())
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)
        return await Lease.wait(stopped)

    stopped = Lease(NotificationBox(10), b"req2", readers=1, ttl_s=30)
    stopped.cancel()
    task = asyncio.ensure_future(awaiter())
    await asyncio.sleep(0)
    task.cancel()
    assert await asyncio.wait_for(task, 1) is False
    held = Lease(NotificationBox(10), b"req3", readers=1, ttl_s=30)
    waiting = asyncio.ensure_future(held.wait())
    await asyncio.sleep(0)
    waiting.cancel()  # the awaiting task cancelled: that is its own cancellation, not the lease's
    with pytest.raises(asyncio.CancelledError):
        await waiting
    held.cancel()
