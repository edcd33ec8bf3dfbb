"""How notifications leave and arrive: through NIXL, or through the side channel.

Outgoing notifications go the way `EngineConfig.notify_via` says: NIXL's own (`genNotif`, which
leaves only when our UCX worker is progressed) or the authenticated side channel
(`_side_notify.py`). Incoming ones come from draining NIXL's queue on each poll, or from the
handshake server's socket; both land in the engine's `NotificationBox`.

NIXL gives no handle for a notification, so after sending one through NIXL the poller is kept
brisk a while (`WIREUP_BRISK_S`): the message, and for a new peer UCX's connection wire-up, need
our worker progressed. `close()` gives recently sent notifications a moment for the same reason.
A side-channel notification needs nothing from our worker, so it keeps nothing brisk.
"""

from __future__ import annotations

from collections.abc import Callable

import zmq
import zmq.asyncio

from ._agent import NIXL_ERRORS, OwnedAgent
from ._peers import Peer, PeerTable
from ._poller import AdaptivePacer
from ._side_notify import SideChannelNotifier
from .config import EngineConfig
from .notifications import NotificationBox
from .stats import EngineStats

__all__ = ["NOTIFY_ERRORS", "WIREUP_BRISK_S", "NotificationTransport", "engine_id_of"]

# After a handshake or a notification, poll briskly this long: the peer's next step needs our
# UCX worker progressed (wire-up, the notification itself).
WIREUP_BRISK_S = 2.0
_ENVELOPE_BYTES = 256  # a side-channel notification's msgpack fields beside its message and engine id
# What sending a notification raises when the peer is unknown to NIXL or its queue is full.
NOTIFY_ERRORS: tuple[type[BaseException], ...] = (*NIXL_ERRORS, KeyError, zmq.ZMQError)


def engine_id_of(agent_name: str) -> str:
    """Our agents are named "<engine id>/<start time>"; other agents keep their own name."""
    engine_id, sep, stamp = agent_name.rpartition("/")
    return engine_id if sep and stamp.isalnum() else agent_name


class NotificationTransport:
    """Sends notifications to peers and feeds arriving ones into the engine's box."""

    def __init__(
        self,
        config: EngineConfig,
        stats: EngineStats,
        box: NotificationBox,
        pacer: AdaptivePacer,
        wakeup: Callable[[], None],
    ) -> None:
        self._via_nixl = config.notify_via == "nixl"
        # A peer's server drops requests over its max_request_bytes (said in its handshake reply; ours for
        # one that does not say): leave room for the envelope (engine id, session, number, MAC).
        self._max_request_bytes = config.max_request_bytes
        self._envelope = len(config.engine_id.encode()) + _ENVELOPE_BYTES
        self._engine_id = config.engine_id
        self._secret = config.auth_secret
        self._stats = stats
        self._box = box
        self._pacer = pacer
        self._wakeup = wakeup
        self._agent: OwnedAgent | None = None
        self._side: SideChannelNotifier | None = None
        # Each peer's addresses its side-channel sockets were opened for (another name or port of its server,
        # followed since): all closed when it is forgotten. By agent name, as an engine restarted is another peer.
        self._addresses: dict[str, set[tuple[str, int]]] = {}
        self.last_sent_at = float("-inf")

    def open(self, agent: OwnedAgent, context: zmq.asyncio.Context) -> None:
        self._agent = agent
        self._side = SideChannelNotifier(context, self._engine_id, self._secret)

    def close(self) -> None:
        """Close the side channel's sockets (before the ZMQ context goes) and let go of the agent."""
        if self._side is not None:
            self._side.close()
        self._agent = None

    @property
    def side_sockets(self) -> int:
        """Open side-channel sockets (one per peer address notified)."""
        return len(self._side) if self._side is not None else 0

    def check(self, message: object, op: str, peer: Peer) -> None:
        """Refuse a message the transport cannot carry to `peer`, before anything is posted (`TypeError`,
        `ValueError`).

        `op`: "READ" or "NOTIFY" go as configured; a WRITE's notification always rides on NIXL.
        """
        if not isinstance(message, bytes):
            raise TypeError(f"a notification must be bytes, not {type(message).__name__}")
        if op == "WRITE" or self._via_nixl:
            return
        room = (peer.max_request_bytes or self._max_request_bytes) - self._envelope
        if len(message) > room:
            raise ValueError(f"a notification of {len(message)} bytes exceeds the {room} that {peer.engine_id!r}'s "
                             "side channel takes (its max_request_bytes)")  # fmt: skip

    @staticmethod
    def check_rides(message: bytes | None, op: str) -> None:
        """Refuse an empty notification riding a WRITE with blocks: NIXL attaches none, yet the caller would be
        told it went (one with no blocks travels alone, and may be empty)."""
        if op == "WRITE" and message == b"":
            raise ValueError("an empty notification cannot ride a WRITE: NIXL sends none; give it a message")

    def send(self, peer: Peer, message: bytes) -> None:
        """Send `message` to `peer` (raises one of `NOTIFY_ERRORS`; `zmq.Again` when its queue is full)."""
        if self._via_nixl:
            assert self._agent is not None
            self._agent.send_notification(peer.agent_name, message)
        else:
            self._side_send(peer, message)

    def _side_send(self, peer: Peer, message: bytes, busy_ms: int = 0) -> None:
        assert self._side is not None
        self._side.send(peer.address, peer.notify_session, message, busy_ms)
        self._addresses.setdefault(peer.agent_name, set()).add(peer.address)

    def hint_busy(self, peer: Peer, seconds: float) -> None:
        """Ask `peer` to progress its worker briskly for `seconds`: transfers with it are in flight.

        Best effort (a full queue or a closed socket only costs throughput), hence no error. A
        peer adopted from etcd without a handshake has issued us no session: it gets none.
        """
        if not peer.notify_session:
            return
        try:
            self._side_send(peer, b"", busy_ms=max(1, round(seconds * 1000)))
        except zmq.ZMQError:
            return
        self._stats.counters["busy_hints_sent"] += 1

    def sent(self, now: float) -> None:
        """A notification went out: count it, and keep the poller brisk while a NIXL one leaves.

        A side-channel one is ZMQ's to deliver: polling briskly for it would only wake our loop
        every few ms for 2 s after each request, and in a vLLM worker every wake-up takes the
        GIL from the model's thread (decode steps were 10-40 % slower with nothing in flight).
        """
        self._stats.counters["notifications_sent"] += 1
        self.last_sent_at = now
        if self._via_nixl:
            self._pacer.stay_brisk(now + WIREUP_BRISK_S)
            self._wakeup()

    def forget(self, peer: Peer, table: PeerTable) -> None:
        """Close `peer`'s side-channel sockets, but those at an address another peer of `table` now answers at (its
        notifications queued there must leave in order): that peer's, from now on."""
        if self._side is not None:
            for address in self._addresses.pop(peer.agent_name, set()) | {peer.address}:
                other = table.at(address)
                if other is None or other is peer:
                    self._side.forget(address)
                else:
                    self._addresses.setdefault(other.agent_name, set()).add(address)

    def drain(self, agent: OwnedAgent, table: PeerTable) -> None:
        """Move what NIXL received into the box, naming senders by engine id."""
        batch = agent.notifications()
        if not batch:
            return
        for agent_name, msgs in batch.items():
            peer = table.of_agent(agent_name)
            sender = peer.engine_id if peer is not None else engine_id_of(agent_name)
            for msg in msgs:
                self._box.deliver(sender, bytes(msg))
        self._stats.counters["notifications_received"] += sum(len(m) for m in batch.values())

    def deliver(self, sender: str, message: bytes) -> None:
        """A notification came through the side channel (already authenticated and de-duplicated)."""
        self._box.deliver(sender, message)
        self._stats.counters["notifications_received"] += 1
