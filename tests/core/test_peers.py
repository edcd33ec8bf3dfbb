"""The peer registry without NIXL: `reconcile` for every re-handshake case, and `PeerTable`'s indexes."""

import itertools

import pytest

from nixl_async import messages
from nixl_async._peers import Peer, PeerTable, Reconcile, metadata_digest, pick_layout, reconcile
from nixl_async.exceptions import LayoutError
from nixl_async.layout import BlockLayout

KV = BlockLayout.from_regions("kv", [1 << 20], num_blocks=8, block_len=4096)
KV_MOVED = BlockLayout.from_regions("kv", [2 << 20], num_blocks=8, block_len=4096)  # same name, other memory
SCRATCH = BlockLayout.from_regions("scratch", [4 << 20], num_blocks=2, block_len=4096)


def reply(engine_id="p", agent="p/1", metadata=b"md-1", layouts=(KV,), **over):
    fields = dict(
        version=1,
        engine_id=engine_id,
        agent_name=agent,
        agent_metadata=metadata,
        compat_hash="h",
        layouts=list(layouts),
        extra={"tp": "0"},
        notify_session=b"s-1",
    )
    fields.update(over)
    return messages.MetadataReply(**fields)


def peer(address=("10.0.0.1", 5600), now=0.0, **reply_fields):
    return Peer(reply(**reply_fields), address, now=now)


# -- Peer ---------------------------------------------------------------------------------
def test_peer_takes_the_reply_and_digests_its_metadata():
    p = peer(now=3.5)
    assert (p.engine_id, p.agent_name, p.compat_hash, p.address) == ("p", "p/1", "h", ("10.0.0.1", 5600))
    assert p.layouts == {"kv": KV} and p.extra == {"tp": "0"} and p.notify_session == b"s-1"
    assert p.metadata_digest == metadata_digest(b"md-1") and len(p.metadata_digest) == 16
    assert p.connected and not p.stale and p.clock_offset_s == 0.0 and p.last_used == 3.5
    assert metadata_digest(b"md-1") != metadata_digest(b"md-2")
    assert repr(p) == "<Peer p at 10.0.0.1:5600 agent=p/1>"


def test_peer_layout_picks_by_name_or_the_only_one():
    p = peer(layouts=(KV, SCRATCH))
    assert p.layout("scratch") is SCRATCH
    with pytest.raises(LayoutError, match="has 2 layouts"):
        p.layout()
    with pytest.raises(LayoutError, match="no layout 'nope'"):
        p.layout("nope")
    assert pick_layout({"kv": KV}, None, "this engine") is KV


def test_refresh_takes_layouts_extra_session_offset_and_clears_stale():
    p = peer(now=1.0)
    p.stale = True
    p.refresh(reply(layouts=(KV, SCRATCH), extra={"tp": "1"}, notify_session=b"s-2"), clock_offset_s=0.25, now=9.0)
    assert p.layouts == {"kv": KV, "scratch": SCRATCH} and p.extra == {"tp": "1"} and p.notify_session == b"s-2"
    assert p.clock_offset_s == 0.25 and not p.stale and p.last_used == 9.0
    assert p.metadata_digest == metadata_digest(b"md-1")  # a KEEP never changes what is loaded


# -- reconcile: every branch -----------------------------------------------------------------
def test_nothing_known_is_new():
    assert reconcile(None, reply(), busy=False) is Reconcile.NEW
    assert reconcile(None, reply(), busy=True) is Reconcile.NEW


def test_a_forgotten_old_peer_counts_as_nothing_known():
    old = peer()
    old.connected = False
    assert reconcile(old, reply(), busy=False) is Reconcile.NEW
    assert reconcile(old, reply(agent="p/2"), busy=True) is Reconcile.NEW


@pytest.mark.parametrize("busy", [False, True])
def test_same_agent_metadata_and_layouts_is_keep(busy):
    assert reconcile(peer(), reply(extra={"tp": "7"}, notify_session=b"other", wall_clock=5.0), busy=busy) is (
        Reconcile.KEEP
    )


@pytest.mark.parametrize("busy", [False, True])
@pytest.mark.parametrize(
    "layouts",
    [(KV, SCRATCH), (), (KV_MOVED,), (SCRATCH,)],
    ids=["registered-another", "deregistered-all", "same-name-other-memory", "swapped"],
)
def test_changed_layouts_with_same_metadata_refresh_them(busy, layouts):
    assert reconcile(peer(), reply(layouts=layouts), busy=busy) is Reconcile.REFRESH_LAYOUTS


def test_layout_order_in_the_reply_does_not_matter():
    assert reconcile(peer(layouts=(KV, SCRATCH)), reply(layouts=(SCRATCH, KV)), busy=False) is Reconcile.KEEP


@pytest.mark.parametrize("busy", [False, True])
def test_changed_metadata_reloads_even_while_busy(busy):
    # The peer re-registered memory: new rkeys. Keeping the old metadata is the bug this fixes.
    assert reconcile(peer(), reply(metadata=b"md-2"), busy=busy) is Reconcile.RELOAD
    assert reconcile(peer(), reply(metadata=b"md-2", layouts=(KV, SCRATCH)), busy=busy) is Reconcile.RELOAD


def test_a_stale_peer_with_nothing_in_flight_reloads():
    old = peer()
    old.stale = True
    assert reconcile(old, reply(), busy=False) is Reconcile.RELOAD
    assert reconcile(old, reply(layouts=(KV, SCRATCH)), busy=False) is Reconcile.RELOAD


def test_a_stale_peer_with_transfers_in_flight_is_kept():
    # One failed request must not cancel the healthy transfers still moving with that agent.
    old = peer()
    old.stale = True
    assert reconcile(old, reply(), busy=True) is Reconcile.KEEP
    assert reconcile(old, reply(layouts=(KV, SCRATCH)), busy=True) is Reconcile.REFRESH_LAYOUTS
    assert reconcile(old, reply(metadata=b"md-2"), busy=True) is Reconcile.RELOAD  # a real change still reloads


@pytest.mark.parametrize("busy", [False, True])
@pytest.mark.parametrize("stale", [False, True])
def test_another_agent_name_is_a_restart_whatever_else(busy, stale):
    old = peer()
    old.stale = stale
    assert reconcile(old, reply(agent="p/2"), busy=busy) is Reconcile.REPLACE
    assert reconcile(old, reply(agent="p/2", metadata=b"md-2", layouts=()), busy=busy) is Reconcile.REPLACE


@pytest.mark.parametrize(
    ("new_agent", "new_metadata", "new_layouts", "stale", "busy"), list(itertools.product([False, True], repeat=5))
)
def test_every_combination_follows_the_precedence(new_agent, new_metadata, new_layouts, stale, busy):
    """REPLACE, then RELOAD for metadata, then RELOAD for an idle stale peer, then REFRESH_LAYOUTS, else KEEP."""
    old = peer()
    old.stale = stale
    answer = reply(
        agent="p/2" if new_agent else "p/1",
        metadata=b"md-2" if new_metadata else b"md-1",
        layouts=(KV_MOVED,) if new_layouts else (KV,),
    )
    if new_agent:
        expected = Reconcile.REPLACE
    elif new_metadata or (stale and not busy):
        expected = Reconcile.RELOAD
    elif new_layouts:
        expected = Reconcile.REFRESH_LAYOUTS
    else:
        expected = Reconcile.KEEP
    assert reconcile(old, answer, busy=busy) is expected


def test_reconcile_changes_nothing():
    old = peer()
    old.stale = True
    before = {name: getattr(old, name) for name in Peer.__slots__}
    for answer in (reply(), reply(agent="p/2"), reply(metadata=b"x"), reply(layouts=())):
        reconcile(old, answer, busy=False)
    assert {name: getattr(old, name) for name in Peer.__slots__} == before


# -- PeerTable ----------------------------------------------------------------------------
A1, A2 = ("10.0.0.1", 5600), ("10.0.0.2", 5600)


def test_add_indexes_by_engine_id_agent_and_address():
    table = PeerTable()
    p = peer(address=A1)
    table.add(p)
    assert table.get("p") is p and table.of_agent("p/1") is p and table.at(A1) is p
    assert len(table) == 1 and list(table) == [p] and p in table
    assert table.get("q") is None and table.of_agent("q/1") is None and table.at(A2) is None
    assert "p" not in table and peer(address=A1) not in table  # membership is by identity


def test_an_address_re_pointed_to_another_engine_leaves_the_old_engine_indexed_by_id():
    table = PeerTable()
    old = peer(address=A1)
    new = peer(address=A1, engine_id="q", agent="q/1")
    table.add(old)
    table.add(new)
    assert table.at(A1) is new and table.get("p") is old and table.of_agent("p/1") is old
    assert len(table) == 2
    table.remove(old)  # the engine forgets the displaced one: the address stays with the new one
    assert table.at(A1) is new and table.get("p") is None and table.of_agent("p/1") is None
    assert list(table) == [new]


def test_removing_an_old_object_keeps_the_entries_a_newer_one_took_over():
    table = PeerTable()
    old = peer(address=A1)
    new = peer(address=A1, agent="p/2")  # the same engine restarted at the same address
    table.add(old)
    table.add(new)
    assert table.of_agent("p/1") is old  # the old agent name keeps its entry until removed
    table.remove(old)
    assert table.get("p") is new and table.at(A1) is new and table.of_agent("p/2") is new
    assert table.of_agent("p/1") is None and len(table) == 1
    table.remove(old)  # twice is harmless
    assert table.get("p") is new


def test_a_restart_at_another_address_moves_the_engine_and_frees_the_old_address():
    table = PeerTable()
    old = peer(address=A1)
    new = peer(address=A2, agent="p/2")
    table.add(old)
    table.add(new)
    assert table.get("p") is new and table.at(A1) is old and table.at(A2) is new
    table.remove(old)
    assert table.at(A1) is None and table.at(A2) is new and len(table) == 1


def test_a_second_address_reaching_the_same_peer_is_indexed_and_removed_with_it():
    table = PeerTable()
    p = peer(address=A1)
    table.add(p)
    table.add(p, address=A2)  # a KEEP reached through another address
    assert table.at(A1) is p and table.at(A2) is p and p.address == A1 and len(table) == 1
    table.remove(p)
    assert table.at(A1) is None and table.at(A2) is None and len(table) == 0 and p not in table


def test_iterating_copies_so_the_caller_may_remove_while_iterating():
    table = PeerTable()
    peers = [peer(address=("h", i), engine_id=f"e{i}", agent=f"e{i}/1") for i in range(3)]
    for p in peers:
        table.add(p)
    for p in table:
        table.remove(p)
    assert len(table) == 0


def test_touch_moves_last_used_forward_only():
    table = PeerTable()
    p = peer(now=5.0)
    table.add(p)
    table.touch(p, 7.0)
    assert p.last_used == 7.0
    table.touch(p, 6.0)  # a late stamp never makes a peer look older
    assert p.last_used == 7.0


def test_idle_selects_peers_unused_for_the_ttl_with_no_live_transfer():
    table = PeerTable()
    fresh = peer(address=("h", 1), engine_id="fresh", agent="fresh/1", now=9.5)
    old = peer(address=("h", 2), engine_id="old", agent="old/1", now=1.0)
    busy = peer(address=("h", 3), engine_id="busy", agent="busy/1", now=1.0)
    edge = peer(address=("h", 4), engine_id="edge", agent="edge/1", now=8.0)
    for p in (fresh, old, busy, edge):
        table.add(p)
    assert table.idle(10.0, 2.0, {"busy/1"}) == [old, edge]  # unused for exactly the ttl counts
    assert table.idle(10.0, 2.0, {"busy/1", "old/1", "edge/1"}) == []
    assert table.idle(10.0, 0.0, set()) == [fresh, old, busy, edge]
    assert table.idle(10.0, 100.0, set()) == []
    table.touch(old, 9.9)
    assert table.idle(10.0, 2.0, frozenset()) == [busy, edge]


def test_idle_only_offers_current_peers():
    table = PeerTable()
    old = peer(address=A1, now=0.0)
    new = peer(address=A1, agent="p/2", now=0.0)
    table.add(old)
    table.add(new)
    assert table.idle(10.0, 1.0, set()) == [new]  # the replaced one is the engine's to retire, not the table's
