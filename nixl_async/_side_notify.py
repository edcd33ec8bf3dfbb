"""The sending side of side-channel notifications (`EngineConfig.notify_via="side_channel"`).

How it works: one plain (not asyncio) ZMQ DEALER per peer address, connected on first use to
the peer's handshake ROUTER, so `send` queues the message and returns at once; ZMQ's I/O
thread delivers it. Each notification carries the notify session the peer issued to us in
our handshake and a sequence number, signed with the shared secret if there is one; the
peer's `NotifyGuard` accepts each (session, number) once, in increasing order.

Sequence numbers come from one counter for all peers and sessions: they grow within every
session, which is all the receiver needs, and nothing has to be reset or bounded when a peer
is forgotten or handshakes again. (The receiver learns how many notifications we sent in all,
a trusted peer's business.) One session only ever travels on one socket, whose connection
keeps order.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import zmq
import zmq.asyncio

from . import messages
from ._zmq_tcp import endpoint, for_host

__all__ = ["SideChannelNotifier"]

Address = tuple[str, int]

_RETIRED_S = 1.0  # a forgotten peer's socket stays open this long, for what it has queued to leave
_SNDHWM = 10000  # queued notifications per peer before send raises zmq.Again


class SideChannelNotifier:
    """Sends signed, numbered notifications to peers' handshake sockets; owns one socket per address."""

    def __init__(self, context: zmq.asyncio.Context, engine_id: str, secret: bytes | None = None) -> None:
        # A plain shadow of the engine's context: a plain socket's send() is immediate, no awaiting.
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(context)
        self._engine_id = engine_id
        self._secret = secret
        self._seq = itertools.count(1)
        self._sockets: dict[Address, zmq.Socket[bytes]] = {}
        # Forgotten peers' sockets, left open a while, then closed without a linger (every socket is): a
        # socket closed with one would hold up the context's term at the engine's close (the loop blocked).
        self._retired: deque[tuple[float, zmq.Socket[bytes]]] = deque()

    def send(self, address: Address, session: bytes, message: bytes, busy_ms: int = 0) -> None:
        """Queue `message` (or, with `busy_ms`, a busy hint) for the peer at `address` in its notify `session`.

        Raises `zmq.Again` when that peer's queue is full (the number it used is simply skipped).
        """
        sock = self._sockets.get(address)
        if sock is None:
            sock = self._open(address)
        if self._retired:
            self._close_retired(time.monotonic())
        seq = next(self._seq)
        secret = self._secret
        mac = messages.notify_mac(secret, session, seq, self._engine_id, message, busy_ms) if secret else b""
        note = messages.NotifyMessage(engine_id=self._engine_id, message=message, mac=mac, session=session, seq=seq,
                                      busy_ms=busy_ms)  # fmt: skip
        sock.send(messages.encode(note), flags=zmq.NOBLOCK)

    def _open(self, address: Address) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self._context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)  # (closed explicitly; one never closed must not hold up the term)
            sock.setsockopt(zmq.SNDHWM, _SNDHWM)
            for_host(sock, address[0])
            sock.connect(endpoint(address[0], address[1]))
        except zmq.ZMQError:
            sock.close(0)
            raise
        self._sockets[address] = sock
        return sock

    def forget(self, address: Address) -> None:
        """Retire the socket to `address`: what it has queued gets `_RETIRED_S` to leave."""
        now = time.monotonic()
        sock = self._sockets.pop(address, None)
        if sock is not None:
            self._retired.append((now + _RETIRED_S, sock))
        self._close_retired(now)

    def _close_retired(self, now: float) -> None:
        while self._retired and self._retired[0][0] <= now:
            self._retired.popleft()[1].close(linger=0)

    def close(self) -> None:
        """Close every socket, dropping what is still queued: the engine's close gave notifications
        sent moments ago their time to leave, and a peer that could not take them in that time is
        unreachable. (A linger here would block the loop in the context's term, up to 1 s.)"""
        sockets, self._sockets = self._sockets, {}
        for sock in [*sockets.values(), *(sock for _, sock in self._retired)]:
            sock.close(linger=0)
        self._retired.clear()

    def __len__(self) -> int:
        return len(self._sockets)
