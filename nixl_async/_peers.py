"""The peer registry: who we handshook with, and what to do when one answers again. No I/O.

A `Peer` is a remote engine we completed a handshake with: its engine id, the name under which
its NIXL agent metadata is loaded in ours, its layouts, the address we reached it at. The engine
owns the NIXL side (remote agents, prepared descriptor lists, notifier sockets); this module only
decides and indexes, so every case is tested without NIXL (`tests/core/test_peers.py`).

When a handshake reply arrives for an engine id we may already know, `reconcile` says what the
engine must do with what it holds for that peer:

======================  ===========================================================================
NEW                     nothing known: load the remote agent
KEEP                    same agent, same metadata, same layouts: keep remote agent and descriptor
                        lists; take the reply's clock offset, extra and notify session
REFRESH_LAYOUTS         same agent and metadata, changed layouts: drop the peer's prepared remote
                        descriptor lists (a layout's name may now mean other memory), keep the agent
RELOAD                  same agent, other metadata (it re-registered memory: new rkeys), or a stale
                        peer (a transfer with it failed) with nothing in flight: remove the remote
                        agent and its descriptor lists, load it afresh
REPLACE                 another agent name (the engine restarted): forget the old peer entirely,
                        load the new one
======================  ===========================================================================

The rules it keeps:

1. Metadata is compared by digest (`metadata_digest`): loaded metadata that no longer matches
   what the peer registered is never kept (NIXL would use old rkeys).
2. One failed request must not cancel healthy transfers: a stale peer with transfers in flight
   (`busy`) is kept; only a real change (metadata or agent) reloads it while busy, and the engine
   then removes the old remote agent once its transfers are quiet.
3. The `PeerTable` indexes (engine id, agent name, address) only ever hold the newest peer for
   each key; removing an old `Peer` object never removes entries a newer one took over.
4. A peer unused for `ttl_s` whose agent has no live transfer is `idle`: the engine forgets it
   (remote agent removed once quiet, descriptor lists released, notifier socket closed).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterator
from collections.abc import Set as AbstractSet

import msgspec

from ._slicing import LinkRates
from .exceptions import LayoutError
from .layout import BlockLayout
from .messages import MetadataReply

__all__ = [
    "Address",
    "Peer",
    "PeerTable",
    "Reconcile",
    "fingerprint",
    "metadata_digest",
    "pick_layout",
    "reconcile",
    "reply_fingerprint",
]

Address = tuple[str, int]


def metadata_digest(agent_metadata: bytes) -> bytes:
    """A 16-byte digest of NIXL agent metadata: equal digests, same registrations (rkeys)."""
    return hashlib.blake2b(agent_metadata, digest_size=16).digest()


def fingerprint(agent_name: str, digest: bytes, layouts: list[BlockLayout], extra: dict[str, str]) -> str:
    """What identifies a handshake reply's content: agent, metadata digest, layouts (by name), extra."""
    ordered = sorted(layouts, key=lambda lay: lay.name)
    content = msgspec.msgpack.encode([agent_name, digest, ordered, sorted(extra.items())])
    return hashlib.blake2b(content, digest_size=16).hexdigest()


def reply_fingerprint(reply: MetadataReply) -> str:
    return fingerprint(reply.agent_name, metadata_digest(reply.agent_metadata), list(reply.layouts), dict(reply.extra))


def pick_layout(layouts: dict[str, BlockLayout], name: str | None, owner: str) -> BlockLayout:
    """The layout called `name`, or the only one when `name` is None (raises `LayoutError`)."""
    if name is None:
        if len(layouts) != 1:
            raise LayoutError(f"{owner} has {len(layouts)} layouts {sorted(layouts)}: name one")
        return next(iter(layouts.values()))
    try:
        return layouts[name]
    except KeyError:
        raise LayoutError(f"{owner} has no layout {name!r} (has {sorted(layouts)})") from None


class Peer:
    """A remote engine we completed a handshake with."""

    __slots__ = (
        "address",
        "agent_name",
        "clock_offset_s",
        "compat_hash",
        "connected",
        "engine_id",
        "extra",
        "last_used",
        "layouts",
        "link",
        "max_request_bytes",
        "metadata_digest",
        "notify_session",
        "stale",
        "unpublished",
    )

    def __init__(self, reply: MetadataReply, address: Address, *, now: float = 0.0) -> None:
        """`now` is the engine loop's time: the peer counts as used then (see `PeerTable.idle`)."""
        self.engine_id = reply.engine_id
        self.agent_name = reply.agent_name
        self.compat_hash = reply.compat_hash
        self.layouts = {lay.name: lay for lay in reply.layouts}
        self.extra = dict(reply.extra)
        self.notify_session = reply.notify_session  # for side-channel notifications to it
        self.max_request_bytes = reply.max_request_bytes  # what its side channel takes (0: not said)
        self.metadata_digest = metadata_digest(reply.agent_metadata)
        self.address = address
        self.connected = True
        self.stale = False  # a transfer with it failed: the next connect() handshakes again
        self.unpublished = False  # its etcd record went: the next connect() looks it up again
        self.clock_offset_s = 0.0  # its wall clock minus ours, estimated at the handshake
        self.link = LinkRates()  # how posts to it behave: sizes slices, paces the poller
        self.last_used = now  # loop time of the last connect or submit

    def __repr__(self) -> str:
        return f"<Peer {self.engine_id} at {self.address[0]}:{self.address[1]} agent={self.agent_name}>"

    @property
    def fingerprint(self) -> str:
        """`reply_fingerprint` of the reply we hold for it (compare with a published record's)."""
        return fingerprint(self.agent_name, self.metadata_digest, list(self.layouts.values()), self.extra)

    def layout(self, name: str | None = None) -> BlockLayout:
        """The peer's layout called `name` (or its only one)."""
        return pick_layout(self.layouts, name, f"peer {self.engine_id}")

    def refresh(self, reply: MetadataReply, *, clock_offset_s: float, now: float) -> None:
        """Take what a KEEP or REFRESH_LAYOUTS reply brings; the loaded remote agent stays.

        The caller drops the peer's prepared remote descriptor lists first on REFRESH_LAYOUTS.
        """
        self.layouts = {lay.name: lay for lay in reply.layouts}
        self.extra = dict(reply.extra)
        self.notify_session = reply.notify_session  # a new session per handshake
        self.max_request_bytes = reply.max_request_bytes
        self.clock_offset_s = clock_offset_s
        self.stale = False
        self.unpublished = False
        self.last_used = now


class Reconcile(enum.StrEnum):
    """What to do with what we hold for a peer when its handshake reply arrives (see the table above)."""

    NEW = "new"
    KEEP = "keep"
    REFRESH_LAYOUTS = "refresh_layouts"
    RELOAD = "reload"
    REPLACE = "replace"


def reconcile(old: Peer | None, reply: MetadataReply, *, busy: bool) -> Reconcile:
    """Decide how a handshake `reply` updates `old`, the peer we hold for `reply.engine_id`.

    `busy`: transfers with `old`'s agent are still in flight (or releasing). A disconnected
    `old` (already forgotten, its agent retiring) counts as nothing known.
    """
    if old is None or not old.connected:
        return Reconcile.NEW
    if old.agent_name != reply.agent_name:
        return Reconcile.REPLACE
    if old.metadata_digest != metadata_digest(reply.agent_metadata):
        return Reconcile.RELOAD  # busy or not: its old rkeys must not be used again
    if old.stale and not busy:
        return Reconcile.RELOAD  # the failure may have broken the UCX endpoint: rebuild it
    if old.layouts != {lay.name: lay for lay in reply.layouts}:
        return Reconcile.REFRESH_LAYOUTS
    return Reconcile.KEEP


class PeerTable:
    """The connected peers, by engine id, by NIXL agent name and by address (see rule 3 above)."""

    __slots__ = ("_by_address", "_by_agent", "_by_id")

    def __init__(self) -> None:
        self._by_id: dict[str, Peer] = {}
        self._by_agent: dict[str, Peer] = {}
        self._by_address: dict[Address, Peer] = {}

    def add(self, peer: Peer, address: Address | None = None) -> None:
        """Index `peer` under its engine id, agent name and `address` (default `peer.address`).

        Each key now points at `peer`, whichever peer held it before: the caller forgets a
        displaced peer itself (it may still hold other keys). Adding a peer again under another
        address keeps the earlier address too (both reach it).
        """
        self._by_id[peer.engine_id] = peer
        self._by_agent[peer.agent_name] = peer
        key = peer.address if address is None else address
        if key[0]:  # ("", 0): found through etcd, serving no side channel: reachable by engine id only
            self._by_address[key] = peer

    def answered_at(self, peer: Peer, address: Address) -> None:
        """`peer` answered a handshake at `address`: it serves there now, and its notify session is
        that server's. Its other addresses on another port led to a server it no longer runs (an engine
        serves one socket at a time), so they go; other names for this same port stay (both reach it)."""
        peer.address = address
        self.add(peer, address)
        for other in [a for a, p in self._by_address.items() if p is peer and a[1] != address[1]]:
            del self._by_address[other]

    def remove(self, peer: Peer) -> None:
        """Drop the index entries that still point at this very `peer` object (none of a newer one's)."""
        if self._by_id.get(peer.engine_id) is peer:
            del self._by_id[peer.engine_id]
        if self._by_agent.get(peer.agent_name) is peer:
            del self._by_agent[peer.agent_name]
        for address in [a for a, p in self._by_address.items() if p is peer]:
            del self._by_address[address]

    def get(self, engine_id: str) -> Peer | None:
        return self._by_id.get(engine_id)

    def at(self, address: Address) -> Peer | None:
        """The peer that last answered a handshake at `address`."""
        return self._by_address.get(address)

    def of_agent(self, agent_name: str) -> Peer | None:
        return self._by_agent.get(agent_name)

    def __contains__(self, peer: object) -> bool:
        """Whether `peer` is the current peer for its engine id (not one forgotten or replaced)."""
        return isinstance(peer, Peer) and self._by_id.get(peer.engine_id) is peer

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def touch(self, peer: Peer, now: float) -> None:
        """`peer` was used at loop time `now` (a connect or a submit)."""
        peer.last_used = max(peer.last_used, now)

    def idle(self, now: float, ttl_s: float, busy_agents: AbstractSet[str]) -> list[Peer]:
        """Peers unused for at least `ttl_s` whose agent has no live transfer (in `busy_agents`)."""
        return [p for p in self._by_id.values() if now - p.last_used >= ttl_s and p.agent_name not in busy_agents]
