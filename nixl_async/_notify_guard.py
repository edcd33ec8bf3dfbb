"""Replay protection for side-channel notifications: pure bookkeeping, no I/O.

How it works: the handshake server issues a fresh random 16-byte notify session with every
`MetadataReply` it sends, bound to the engine id that asked (`issue`). A notification is
accepted (`check` returns None) only if it names a session this server issued, to that same
engine id, with a sequence number above the last one accepted in that session, and, with a
shared secret, a valid `messages.notify_mac` over session, sequence number, sender and message.
Anything else gets a reason code and changes nothing, so a refused message cannot disturb
a good sender's sequence.

Why strictly increasing rather than "next expected": ZMQ keeps order on one DEALER->ROUTER
connection but drops what was queued when it breaks, so numbers may skip, never go back.
A sender that reconnects for good handshakes again and gets a new session.

Sessions live until evicted (least recently used first) past `max_sessions`; an
accepted notification counts as a use, so a flood of handshakes evicts idle sessions before
busy ones. An engine keeps its `_PER_ENGINE` newest sessions (one that handshakes again may
still have notifications under way in the previous one), so engines that handshake again and
again evict nobody else's. Only an answer that reached the asker's socket counts here
(`delivered`); one whose asker had gone (it gave up waiting, and the server read its request
late) is `revoke`d and evicts nobody: else a late answer to a handshake the asker gave up on
could evict the session it had just been given. A sender whose session was evicted (or whose
receiver restarted) is refused with "unknown_session" until its next handshake.

Without a shared secret nothing is authenticated: anyone who sees a session on the wire can
send new notifications in it. Session and sequence number still refuse a blind replay of a
captured notification, in its own session or after that session is gone.
"""

from __future__ import annotations

import hmac
import secrets
from collections import OrderedDict
from typing import Final

from . import messages

__all__ = ["REFUSAL_REASONS", "NotifyGuard"]

UNKNOWN_SESSION: Final = "unknown_session"
BAD_MAC: Final = "bad_mac"
WRONG_SENDER: Final = "wrong_sender"
REPLAYED: Final = "replayed"
REFUSAL_REASONS: Final = (UNKNOWN_SESSION, BAD_MAC, WRONG_SENDER, REPLAYED)

SESSION_BYTES: Final = 16
_PER_ENGINE: Final = 2


class _Session:
    __slots__ = ("engine_id", "last_seq")

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.last_seq = 0  # senders number from 1


class NotifyGuard:
    """Issues notify sessions and decides which notifications to accept (see the module doc)."""

    def __init__(self, secret: bytes | None = None, *, max_sessions: int = 4096) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be at least 1")
        self._secret = secret
        self._max_sessions = max_sessions
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()  # least recently used first
        self._by_engine: dict[str, list[bytes]] = {}  # each engine's live sessions, oldest first

    def __len__(self) -> int:
        return len(self._sessions)

    def issue(self, engine_id: str) -> bytes:
        """A fresh session for `engine_id`'s notifications to us, evicting nothing yet: the server then says
        whether its answer was `delivered` (and the limits apply) or `revoke`s it. (Until then the table may
        hold one session over `max_sessions`: the server does nothing else in between.)"""
        session = secrets.token_bytes(SESSION_BYTES)
        self._sessions[session] = _Session(engine_id)
        self._by_engine.setdefault(engine_id, []).append(session)
        return session

    def delivered(self, session: bytes) -> None:
        """The answer carrying `session` reached its asker: past `_PER_ENGINE`, the engine's oldest other
        session no notification came in goes first (answers the asker stopped waiting for just as they
        came), else its oldest."""
        state = self._sessions.get(session)
        if state is None:
            return
        mine = self._by_engine[state.engine_id]
        while len(mine) > _PER_ENGINE:  # first the engine's own surplus ...
            others = [s for s in mine if s != session]
            self._drop(next((s for s in others if self._sessions[s].last_seq == 0), others[0]))
        while len(self._sessions) > self._max_sessions:  # ... then, the table still full, the least recently used
            self._drop(next(s for s in self._sessions if s != session))

    def revoke(self, session: bytes) -> None:
        """The answer carrying `session` could not be sent (its asker had gone): forget it, evicting nobody."""
        if session in self._sessions:
            self._drop(session)

    def _drop(self, session: bytes) -> None:
        engine_id = self._sessions.pop(session).engine_id
        mine = self._by_engine[engine_id]
        mine.remove(session)
        if not mine:
            del self._by_engine[engine_id]

    def check(self, note: messages.NotifyMessage) -> str | None:
        """None to accept `note` (and remember its sequence number), else why it is refused.

        The MAC is checked before sender and sequence number so that, with a secret, only a
        holder of the secret learns more than "unknown_session" or "bad_mac".
        """
        state = self._sessions.get(note.session)
        if state is None:
            return UNKNOWN_SESSION
        if self._secret is not None:
            expected = messages.notify_mac(
                self._secret, note.session, note.seq, note.engine_id, note.message, note.busy_ms
            )
            if not hmac.compare_digest(note.mac, expected):
                return BAD_MAC
        if note.engine_id != state.engine_id:
            return WRONG_SENDER
        if note.seq <= state.last_seq:
            return REPLAYED
        state.last_seq = note.seq
        self._sessions.move_to_end(note.session)
        return None
