"""Admission: strict FIFO over count and bytes (asyncio only, no NIXL)."""

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nixl_async._admission import Admission


async def settle(ticks: int = 5) -> None:
    for _ in range(ticks):
        await asyncio.sleep(0)


async def grab(adm: Admission, nbytes: int) -> None:
    """An acquire that must not wait."""
    await asyncio.wait_for(adm.acquire(nbytes, None), 1)


async def admitted(*tasks: "asyncio.Future[None]") -> None:
    """Wait (boundedly, so a wrong admission fails instead of hanging) until `tasks` were admitted."""
    await asyncio.wait_for(asyncio.gather(*tasks), 1)


def consistent(adm: Admission, held: list[int]) -> None:
    assert adm.count == len(held) and adm.bytes == sum(held)


async def queued(adm: Admission, nbytes: int, order: list[str], name: str) -> asyncio.Task[None]:
    async def go() -> None:
        await adm.acquire(nbytes, None)
        order.append(name)

    task = asyncio.create_task(go())
    await settle()
    return task


async def test_room_admits_at_once_and_release_gives_back():
    adm = Admission(max_count=2, max_bytes=100)
    await grab(adm, 60)
    await grab(adm, 40)
    consistent(adm, [60, 40])
    adm.release(60)
    adm.release(40)
    consistent(adm, [])
    assert adm.waits == 0 and adm.waiting == 0
    with pytest.raises(ValueError):
        adm.release(1)
    with pytest.raises(ValueError):
        Admission(0, 1)
    with pytest.raises(ValueError):
        await adm.acquire(-1, None)


async def test_fifo_over_count():
    adm = Admission(max_count=1, max_bytes=1 << 30)
    await grab(adm, 1)
    order: list[str] = []
    tasks = [await queued(adm, 1, order, name) for name in "abcd"]
    assert adm.waiting == 4 and adm.waits == 4 and order == []
    for expected in ("a", "b", "c", "d"):
        adm.release(1)
        await settle()
        assert order[-1] == expected and adm.count == 1
    adm.release(1)
    await admitted(*tasks)
    assert order == list("abcd")
    consistent(adm, [])


async def test_fifo_over_bytes_and_several_heads_admitted_at_once():
    adm = Admission(max_count=100, max_bytes=100)
    await grab(adm, 100)
    order: list[str] = []
    tasks = [await queued(adm, n, order, name) for n, name in ((30, "a"), (30, "b"), (50, "c"), (10, "d"))]
    adm.release(100)
    await settle()
    # a and b fit together; c does not fit after them, and d (which would fit) must not overtake c
    assert order == ["a", "b"] and adm.waiting == 2
    consistent(adm, [30, 30])
    await admitted(*tasks[:2])
    adm.release(30)  # 30 + 50 fits: c goes, and then d after it
    await admitted(*tasks)
    assert order == ["a", "b", "c", "d"]
    consistent(adm, [30, 50, 10])


async def test_no_barging_a_newcomer_queues_behind_a_waiter_even_if_it_fits():
    adm = Admission(max_count=10, max_bytes=100)
    await grab(adm, 60)
    order: list[str] = []
    big = await queued(adm, 50, order, "big")
    small = await queued(adm, 10, order, "small")  # 60 + 10 fits, but big is waiting
    assert order == [] and adm.waiting == 2
    adm.release(60)
    await admitted(big, small)
    assert order == ["big", "small"]
    consistent(adm, [50, 10])


async def test_try_acquire_takes_room_only_when_acquire_would_not_wait():
    adm = Admission(max_count=2, max_bytes=100)
    assert adm.try_acquire(60)
    assert not adm.try_acquire(50)  # does not fit: nothing taken
    assert (adm.count, adm.bytes) == (1, 60)
    order: list[str] = []
    big = await queued(adm, 50, order, "big")
    assert not adm.try_acquire(10)  # fits, but a waiter is queued: no barging
    adm.release(60)
    await admitted(big)
    assert adm.try_acquire(10) and not adm.try_acquire(1)  # the count is full
    with pytest.raises(ValueError):
        adm.try_acquire(-1)
    consistent(adm, [50, 10])


async def test_a_large_transfer_is_not_starved_by_a_stream_of_small_ones():
    # The scenario that starved when every waiter re-raced: the budget never empties because a
    # new small transfer starts each time an old one ends, so the large one never fits.
    adm = Admission(max_count=1000, max_bytes=100)
    held = []
    for _ in range(5):
        await grab(adm, 20)
        held.append(20)
    order: list[str] = []
    large = await queued(adm, 100, order, "large")
    smalls = []
    for i in range(20):
        smalls.append(await queued(adm, 20, order, f"small{i}"))
        if held:
            adm.release(held.pop())
        await settle()
        if i < 4:
            assert order == [], "no small one may start while the large one waits"
        elif i == 4:
            assert order == ["large"], "the large one goes as soon as the five ahead of it ended"
    adm.release(100)
    await settle()
    assert order[1:6] == [f"small{i}" for i in range(5)]
    for _ in range(15):  # each small one that ends lets exactly the next one in
        adm.release(20)
        await settle()
    await admitted(large, *smalls)
    assert order == ["large"] + [f"small{i}" for i in range(20)]
    consistent(adm, [20] * 5)


async def test_an_oversized_transfer_goes_alone():
    adm = Admission(max_count=10, max_bytes=100)
    await grab(adm, 500)  # nothing in flight: it goes
    consistent(adm, [500])
    order: list[str] = []
    tiny = await queued(adm, 0, order, "tiny")
    assert order == [], "nothing joins an oversized transfer"
    adm.release(500)
    await admitted(tiny)
    await grab(adm, 50)
    huge = await queued(adm, 500, order, "huge")
    adm.release(0)
    await settle()
    assert order == ["tiny"], "an oversized one waits until nothing is in flight"
    adm.release(50)
    await admitted(huge)
    assert order == ["tiny", "huge"]
    consistent(adm, [500])


async def test_deadline_raises_timeout_and_leaves_state_consistent():
    adm = Admission(max_count=1, max_bytes=100)
    await grab(adm, 10)
    loop = asyncio.get_running_loop()
    order: list[str] = []
    with pytest.raises(TimeoutError):
        await adm.acquire(10, loop.time() + 0.01)
    assert adm.timeouts == 1 and adm.waiting == 0
    consistent(adm, [10])
    # a deadline already passed fails at once when it has to queue, and admits when there is room
    with pytest.raises(TimeoutError):
        await adm.acquire(10, loop.time() - 1)
    first = await queued(adm, 10, order, "first")
    timed = asyncio.create_task(adm.acquire(10, loop.time() + 0.01))
    last = await queued(adm, 10, order, "last")
    with pytest.raises(TimeoutError):
        await timed
    assert adm.waiting == 2
    adm.release(10)
    await admitted(first)
    adm.release(10)
    await admitted(last)
    assert order == ["first", "last"]
    consistent(adm, [10])
    adm.release(10)
    await adm.acquire(10, loop.time() - 1)  # room and nobody queued: admitted whatever the deadline
    consistent(adm, [10])


async def test_timeout_of_the_head_passes_the_turn():
    adm = Admission(max_count=10, max_bytes=100)
    await grab(adm, 60)
    loop = asyncio.get_running_loop()
    order: list[str] = []
    head = asyncio.create_task(adm.acquire(50, loop.time() + 0.02))
    await settle()
    small = await queued(adm, 30, order, "small")
    with pytest.raises(TimeoutError):
        await head
    await asyncio.wait_for(small, 1)  # 60 + 30 fits once the 50 is gone
    consistent(adm, [60, 30])


async def test_cancellation_at_head_passes_the_turn():
    adm = Admission(max_count=10, max_bytes=100)
    await grab(adm, 60)
    order: list[str] = []
    head = await queued(adm, 50, order, "head")
    middle = await queued(adm, 20, order, "middle")
    tail = await queued(adm, 20, order, "tail")
    head.cancel()
    await settle()
    assert head.cancelled() and order == ["middle", "tail"]
    assert adm.cancels == 1 and adm.waiting == 0
    await admitted(middle, tail)
    consistent(adm, [60, 20, 20])


async def test_cancellation_behind_the_head_keeps_the_order():
    adm = Admission(max_count=1, max_bytes=100)
    await grab(adm, 1)
    order: list[str] = []
    tasks = [await queued(adm, 1, order, name) for name in "abc"]
    tasks[1].cancel()
    await settle()
    assert adm.waiting == 2
    adm.release(1)
    await settle()
    adm.release(1)
    await settle()
    assert order == ["a", "c"]
    consistent(adm, [1])


async def test_a_grant_cancelled_in_the_same_tick_is_given_back():
    adm = Admission(max_count=1, max_bytes=100)
    await grab(adm, 10)
    order: list[str] = []
    granted = await queued(adm, 10, order, "granted")
    behind = await queued(adm, 10, order, "behind")
    adm.release(10)  # resolves granted's future; its task has not resumed yet
    assert adm.count == 1 and adm.waiting == 1
    granted.cancel()  # lands before it resumes: the grant must come back, and go to the next
    await settle()
    assert granted.cancelled() and order == ["behind"]
    await admitted(behind)
    consistent(adm, [10])
    assert adm.cancels == 1


async def test_a_grant_racing_the_deadline_is_given_back():
    adm = Admission(max_count=1, max_bytes=100)
    await grab(adm, 10)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 0.02
    waiter = asyncio.create_task(adm.acquire(10, deadline))
    await settle()
    while loop.time() < deadline:  # block the loop past the deadline
        pass
    # Next loop iteration runs the release (resolving the waiter's future) and then the deadline's
    # callback (cancelling the task) before the waiter resumes: granted and timed out in one tick.
    loop.call_soon(adm.release, 10)
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        await waiter
    consistent(adm, [])
    assert adm.timeouts == 1 and adm.waiting == 0


async def test_close_admits_everyone_and_later_acquires_return_at_once():
    adm = Admission(max_count=1, max_bytes=10)
    await grab(adm, 10)
    order: list[str] = []
    tasks = [await queued(adm, 100, order, name) for name in "abc"]
    adm.close()
    await admitted(*tasks)
    assert order == ["a", "b", "c"] and adm.waiting == 0 and adm.closed
    await asyncio.wait_for(adm.acquire(1000, None), 1)
    consistent(adm, [10, 100, 100, 100, 1000])  # every acquire still pairs with a release
    for n in (10, 100, 100, 100, 1000):
        adm.release(n)
    consistent(adm, [])


async def test_many_cancelled_waiters_are_compacted():
    adm = Admission(max_count=1, max_bytes=100)
    await grab(adm, 1)
    order: list[str] = []
    head = await queued(adm, 1, order, "head")
    doomed = [asyncio.create_task(adm.acquire(1, None)) for _ in range(300)]
    tail = await queued(adm, 1, order, "tail")
    for task in doomed:
        task.cancel()
    await settle()
    assert adm.waiting == 2 and len(adm._queue) <= 2 * 64 + 2
    adm.release(1)
    await admitted(head)
    adm.release(1)
    await admitted(tail)
    assert order == ["head", "tail"]


# -- random sequences against a reference model --------------------------------------------

MAX_COUNT, MAX_BYTES = 3, 100

SIZES = st.sampled_from([0, 1, 10, 30, 50, 99, 100, 150])
acquire = st.tuples(st.just("acquire"), SIZES)
ops = st.lists(
    st.one_of(
        acquire,  # listed three times: queues must form for the other steps to matter
        acquire,
        acquire,
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("cancel"), st.integers(0, 50)),
        st.tuples(st.just("cancel"), st.just(0)),  # the head, often
        st.tuples(st.just("release_cancel_head"), st.integers(0, 50)),
    ),
    min_size=4,
    max_size=60,
)


def model_grant(held: dict[int, int], queue: list[tuple[int, int]]) -> list[int]:
    """The reference: admit heads while they fit."""
    granted = []
    while queue:
        ident, nbytes = queue[0]
        if held and (len(held) >= MAX_COUNT or sum(held.values()) + nbytes > MAX_BYTES):
            break
        queue.pop(0)
        held[ident] = nbytes
        granted.append(ident)
    return granted


async def run_ops(steps: list[tuple[str, int]]) -> None:
    adm = Admission(MAX_COUNT, MAX_BYTES)
    held: dict[int, int] = {}  # model: admitted and not released, by id
    queue: list[tuple[int, int]] = []  # model: waiting, in order
    tasks: dict[int, asyncio.Task[None]] = {}
    sizes: dict[int, int] = {}
    grant_order: list[int] = []
    expected_order: list[int] = []

    async def acquire(ident: int) -> None:
        await adm.acquire(sizes[ident], None)
        grant_order.append(ident)

    def check() -> None:
        assert adm.count == len(held) and adm.bytes == sum(held.values())
        assert adm.waiting == len(queue)
        assert adm.count <= MAX_COUNT
        assert adm.bytes <= MAX_BYTES or adm.count == 1  # only an oversized one alone
        assert grant_order == expected_order  # FIFO: admitted in arrival order, minus those that left
        assert all(tasks[i].done() for i in held) and not any(tasks[i].done() for i, _ in queue)

    for ident, (op, arg) in enumerate(steps):
        if op == "acquire":
            sizes[ident] = arg
            tasks[ident] = asyncio.create_task(acquire(ident))
            queue.append((ident, arg))
            expected_order += model_grant(held, queue) if len(queue) == 1 else []
        elif op == "release" and held:
            victim = sorted(held)[arg % len(held)]
            adm.release(held.pop(victim))
            expected_order += model_grant(held, queue)
        elif op == "cancel" and queue:
            victim, _ = queue.pop(arg % len(queue))
            tasks[victim].cancel()
            await settle()
            expected_order += model_grant(held, queue)
        elif op == "release_cancel_head" and held and queue:
            # the head is granted by the release and cancelled in the same tick: it gives the grant back
            head, _ = queue.pop(0)
            victim = sorted(held)[arg % len(held)]
            adm.release(held.pop(victim))
            tasks[head].cancel()
            expected_order += model_grant(held, queue)
        await settle()
        check()
    for ident in list(held):
        adm.release(held.pop(ident))
        expected_order += model_grant(held, queue)
        await settle()
        check()
    adm.close()
    await settle()
    assert all(task.done() for task in tasks.values())


@settings(max_examples=500, deadline=None)
@given(ops)
def test_random_sequences_keep_the_invariants(steps):
    asyncio.run(run_ops(steps))


async def test_a_batch_waits_for_room_for_all_of_it_and_keeps_its_place():
    adm = Admission(max_count=4, max_bytes=100)
    await asyncio.wait_for(adm.acquire(30, None, count=3), 1)  # fits: admitted at once
    consistent(adm, [10, 10, 10])
    order: list[str] = []

    async def batch(name: str, count: int, nbytes: int) -> None:
        await adm.acquire(nbytes, None, count=count)
        order.append(name)

    pair = asyncio.create_task(batch("pair", 2, 20))  # one slot free: the pair waits for two
    await settle()
    single = await queued(adm, 10, order, "single")  # fits now, but queues behind the pair (no barging)
    assert order == [] and adm.waiting == 2
    for _ in range(2):
        adm.release(10)
        await settle()
    await admitted(pair, single)  # the pair first, then the single behind it (both fit now)
    assert order == ["pair", "single"] and adm.count == 4 and adm.bytes == 40
    with pytest.raises(ValueError):
        await adm.acquire(10, None, count=0)


async def test_an_oversized_batch_goes_alone_and_a_cancelled_grant_gives_all_back():
    adm = Admission(max_count=2, max_bytes=100)
    await grab(adm, 10)
    order: list[str] = []

    async def batch() -> None:
        await adm.acquire(30, None, count=3)
        order.append("batch")

    big = asyncio.create_task(batch())
    await settle()
    assert order == []
    adm.release(10)  # nothing in flight: the oversized batch goes, alone
    await admitted(big)
    assert adm.count == 3 and adm.bytes == 30
    for _ in range(3):
        adm.release(10)
    consistent(adm, [])
    await grab(adm, 10)
    granted = asyncio.create_task(adm.acquire(20, None, count=2))
    await settle()
    behind = await queued(adm, 10, order, "behind")
    adm.release(10)  # resolves the batch's grant; it is cancelled before it resumes
    granted.cancel()
    await settle()
    assert granted.cancelled()
    await admitted(behind)
    consistent(adm, [10])
