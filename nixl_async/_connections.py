"""What the engine holds for each peer in NIXL, and when it lets go of it.

`_peers.py` decides (which peer is which, what a new handshake reply means); this module carries
the decisions out against NIXL: it loads remote agents, drops prepared descriptor lists, closes
notifier sockets, and forgets peers. A forgotten peer's transfers are ended at once, but its
remote agent and descriptor lists are released only once no live transfer uses them (NIXL may
still be moving that transfer's bytes), so a peer is *retiring* in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from . import messages
from ._agent import NIXL_ERRORS, OwnedAgent
from ._driver import TransferDriver
from ._memory import MemoryRegistry
from ._notify_transport import NotificationTransport
from ._peers import Address, Peer, PeerTable, Reconcile, reconcile
from .config import EngineConfig
from .exceptions import HandshakeRejected, TransferCancelled
from .stats import EngineStats

__all__ = ["Connections"]

log = logging.getLogger("nixl_async.engine")


class Connections:
    """The peers we handshook with, and the NIXL state each one keeps alive."""

    def __init__(
        self,
        config: EngineConfig,
        stats: EngineStats,
        table: PeerTable,
        memory: MemoryRegistry,
        driver: TransferDriver,
        notify: NotificationTransport,
        poke: Callable[[], None],
    ) -> None:
        self._config = config
        self._stats = stats
        self.table = table
        self._memory = memory
        self._driver = driver
        self._notify = notify
        self._poke = poke  # asks the poller for a sweep (not during its back-off from an error)
        self.agent: OwnedAgent | None = None  # set while the engine runs (and while it closes)
        self.retiring: dict[str, Peer] = {}  # forgotten; their remote agent goes once quiet
        self._orphan_dlists: list[Any] = []  # remote lists a peer's new layouts replaced, still in use
        self._next_eviction = float("-inf")
        self._adopting: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    async def adopt(
        self, reply: messages.MetadataReply, address: Address, offset: float, now: float, *, claimed: bool = False
    ) -> Peer:
        """Carry out what `reconcile` decides for a handshake reply; the peer to use from now on.

        `address` is where the reply came from, or, with `claimed`, where an etcd record says the
        engine serves ("", 0: nowhere). A claimed address is only a claim (a dead engine's record
        outlives it): it neither displaces the engine that answers there nor is indexed.
        Adoptions for one engine id run one at a time (a watch and a connect may race).
        """
        async with self._one_at_a_time(reply.engine_id):
            return await self._adopt(reply, address, offset, now, claimed)

    async def adopt_record(self, reply: messages.MetadataReply, address: Address, now: float,
                           newest: Callable[[], bool], adopts: Callable[[Peer | None], bool]
                           ) -> Peer | None:  # fmt: skip
        """`adopt` an etcd record's metadata, unless, asked in its turn, `adopts` refuses the peer now
        held (a handshake with it finished while this waited: its session and clock offset stay, and
        it is returned, marked stale if the record is newer) or `newest` says a newer record was applied
        meanwhile (None)."""
        async with self._one_at_a_time(reply.engine_id):
            held = self.table.get(reply.engine_id)
            if not adopts(held):
                if held is not None and newest():  # a newer record than that handshake may have seen
                    held.stale = True  # (its next connect handshakes again)
                return held
            return await self._adopt(reply, address, 0.0, now, True) if newest() else None

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, engine_id: str) -> AsyncIterator[None]:
        entry = self._adopting.setdefault(engine_id, (asyncio.Lock(), [0]))
        entry[1][0] += 1  # callers holding or awaiting it: the lock goes with the last one
        try:
            async with entry[0]:
                yield
        finally:
            entry[1][0] -= 1
            if not entry[1][0]:
                del self._adopting[engine_id]

    async def _adopt(
        self, reply: messages.MetadataReply, address: Address, offset: float, now: float, claimed: bool
    ) -> Peer:
        agent = self._agent()
        where = f"{address[0]}:{address[1]}" if address[0] else None
        holder = self.table.of_agent(reply.agent_name)
        if holder is not None and holder.engine_id != reply.engine_id:
            raise HandshakeRejected(f"{reply.engine_id} answered with the NIXL agent of {holder.engine_id} "
                                    f"({reply.agent_name!r}): two engines cannot share one agent",
                                    address=where)  # fmt: skip
        old = self.table.get(reply.engine_id)
        busy = old is not None and old.agent_name in self._driver.busy_agents()
        decision = reconcile(old, reply, busy=busy)
        previous = None if claimed else self.table.at(address)
        if previous is not None and previous.engine_id == reply.engine_id:
            previous = None
        # (another engine answering at this address means that one is gone: it is forgotten once
        # the reply proved usable, and so is an engine replaced by a new agent)
        if old is not None and decision in (Reconcile.KEEP, Reconcile.REFRESH_LAYOUTS):
            if decision is Reconcile.REFRESH_LAYOUTS:
                in_use = {id(t.remote_dlist) for t in self._driver.live()}
                self._orphan_dlists += self._memory.drop_remote(agent, old.agent_name, keep=in_use)
            old.refresh(reply, clock_offset_s=offset, now=now)
            if previous is not None:
                self.forget(previous)
            if claimed:
                old.address = address
            else:  # (before, `address` stayed at the first one: notifications went to a server it left)
                self.table.answered_at(old, address)
            return old
        if old is not None and decision is Reconcile.RELOAD:  # (NIXL loads no agent name twice)
            self.forget(old)  # its transfers end; its remote agent goes once quiet
        retiring = self.retiring.get(reply.agent_name)
        if retiring is not None:
            # NIXL still has that agent loaded for transfers that are releasing: wait for them
            # (bounded by the grace) before loading it anew.
            await self._retired(retiring, self._config.release_grace_s + 0.5)
        assert self._driver.loop is not None
        peer = Peer(reply, address, now=self._driver.loop.time())
        peer.agent_name = self._load_agent(agent, reply, where)  # refused: `old` and `previous` stay as they were
        peer.clock_offset_s = offset
        for gone in (old, previous):
            if gone is not None and gone in self.table:  # REPLACE: a new agent for that engine id
                self.forget(gone)
        self.table.add(peer, ("", 0) if claimed else address)
        return peer

    def _load_agent(self, agent: OwnedAgent, reply: messages.MetadataReply, where: str | None) -> str:
        """Load the peer's agent metadata into NIXL; `HandshakeRejected` if NIXL refuses it, or if it
        names another agent than the reply does (whose loaded agent, unless a peer of ours uses it, goes)."""
        try:
            loaded = agent.add_remote(reply.agent_metadata)
        except NIXL_ERRORS as exc:
            raise HandshakeRejected(f"NIXL refused the agent metadata of {reply.engine_id}: {exc}",
                                    address=where) from exc  # fmt: skip
        if loaded == reply.agent_name:
            return loaded
        if self.table.of_agent(loaded) is None and loaded not in self.retiring:
            try:
                agent.remove_remote(loaded)
            except NIXL_ERRORS as exc:
                log.warning("NIXL refused to unload agent %r, loaded from %s's metadata: %s", loaded,
                            reply.engine_id, exc)  # fmt: skip
        raise HandshakeRejected(f"{reply.engine_id} claims NIXL agent {reply.agent_name!r} but its metadata is "
                                f"agent {loaded!r}'s", address=where)  # fmt: skip

    async def _retired(self, peer: Peer, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while peer.agent_name in self.retiring:
            if loop.time() >= deadline:
                raise HandshakeRejected(
                    f"transfers with the previous connection to {peer.engine_id} are still fenced in NIXL",
                    address=f"{peer.address[0]}:{peer.address[1]}",
                )
            self._poke()
            await asyncio.sleep(0.005)

    def forget(self, peer: Peer) -> None:
        """Stop using a peer now; its remote agent and descriptor lists go once its transfers are quiet."""
        if not peer.connected:
            return
        self._driver.end_all(
            lambda t: TransferCancelled("peer disconnected", transfer_id=t.id, peer=peer.engine_id),
            agent_name=peer.agent_name,
        )
        self._notify.forget(peer, self.table)
        peer.connected = False
        self.table.remove(peer)
        self.retiring[peer.agent_name] = peer
        self.drop_quiet()

    def drop_quiet(self) -> None:
        """Remove what forgotten peers left once no live transfer uses it.

        What NIXL refuses to let go of is logged and left to it (`live_handles()` still counts
        it): a refusal is no reason to fail transfers or a close, and retried on every pass it
        would only be refused again.
        """
        if self._orphan_dlists:
            in_use = {id(t.remote_dlist) for t in self._driver.live()}
            agent = self._agent()
            for handle in [h for h in self._orphan_dlists if id(h) not in in_use]:
                self._orphan_dlists.remove(handle)
                try:
                    agent.release_dlist(handle)
                except NIXL_ERRORS as exc:
                    log.warning("NIXL refused to release a descriptor list of a forgotten peer: %s", exc)
        if self.retiring:
            busy = self._driver.busy_agents()
            for name, peer in list(self.retiring.items()):
                if name not in busy:
                    self._drop_remote(peer)

    def evict_idle(self, now: float) -> None:
        """Forget peers unused for `peer_ttl_s` (a fleet whose instances come and go must not leak)."""
        ttl = self._config.peer_ttl_s
        if ttl is None or now < self._next_eviction or not len(self.table):
            return
        self._next_eviction = now + min(ttl / 2, 1.0)
        for peer in self.table.idle(now, ttl, self._driver.busy_agents()):
            self._stats.counters["peers_evicted"] += 1
            self.forget(peer)

    def release_all(self) -> None:
        """At close, with every transfer quiet: forget every peer and unload its remote agent."""
        for peer in [*self.table, *self.retiring.values()]:
            self.forget(peer)
            self._drop_remote(peer)
        self.drop_quiet()  # lists replaced by a refresh

    def _drop_remote(self, peer: Peer) -> None:
        if self.retiring.pop(peer.agent_name, None) is None:
            return
        agent = self._agent()
        try:
            self._memory.drop_remote(agent, peer.agent_name)
        except NIXL_ERRORS as exc:
            log.warning("NIXL refused to release a descriptor list of %s: %s", peer.engine_id, exc)
        try:
            agent.remove_remote(peer.agent_name)
        except NIXL_ERRORS as exc:
            log.warning("NIXL refused to unload the remote agent of %s (%s): leaving it loaded", peer.engine_id, exc)

    def _agent(self) -> OwnedAgent:
        assert self.agent is not None
        return self.agent
