"""The error tree. Local faults (the caller's input, the caller's thread) are kept apart from
remote ones (what a peer said or failed to say), so a caller can tell "fix my call" from
"retry or give up on that peer".

    NixlAsyncError
    ├── EngineClosedError            the engine is not running (not started, or closed)
    ├── CollectionClosedError        a task submitted after its `collect_transfers()` block ended
    ├── WrongThreadError             a NIXL call from a thread that does not own the agent
    ├── BackendStartError            NIXL could not create a configured backend (start() failed)
    ├── CallTooLarge (ValueError)    a call's payload is over max_request_bytes: nothing was sent
    ├── LayoutError (ValueError)     bad layout, block ids or memory given by the caller
    ├── HandshakeError               connecting to a peer (or a call over the side channel) failed
    │   ├── HandshakeTimeout         nobody answered within the timeout
    │   ├── HandshakeRejected        the peer answered with an error reply
    │   ├── IncompatiblePeerError    compatibility hashes or UCX/TCP segment sizes do not allow the pair
    │   ├── EngineIdMismatch         the peer is not the engine the caller expected
    │   ├── ProtocolError            the reply was malformed or of an unknown version
    │   ├── DiscoveryUnavailable     etcd did not answer (or failed) the lookup
    │   └── PeerNotPublished         etcd holds no record of that engine
    ├── TransferError                a transfer did not complete
    │   ├── TransferFailed           NIXL reported an error (dead peer, cut link, ...)
    │   │   ├── BatchRowsFailed      some rows of a `TransferBatch` failed (the others landed)
    │   │   └── NotificationFailed   a notification could not be sent
    │   ├── TransferTimeout          the transfer's deadline passed first
    │   ├── TransferCancelled        the transfer was cancelled
    │   ├── TransferFenced           it ended, but NIXL may still touch its memory: keep it aside
    │   └── LeaseExpired             the producer's lease on the blocks ran out: not read
    ├── NotificationTimeout          awaited notifications did not all arrive in time
    ├── NotificationsLost            a subscriber fell behind and notifications were dropped
    └── PeerUnknownError (KeyError)  no peer with that engine id is connected
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .transfer import TransferResult

__all__ = [
    "BackendStartError",
    "BatchRowsFailed",
    "CallTooLarge",
    "CollectionClosedError",
    "DiscoveryUnavailable",
    "EngineClosedError",
    "EngineIdMismatch",
    "HandshakeError",
    "HandshakeRejected",
    "HandshakeTimeout",
    "IncompatiblePeerError",
    "LayoutError",
    "LeaseExpired",
    "NixlAsyncError",
    "NotificationFailed",
    "NotificationTimeout",
    "NotificationsLost",
    "PeerNotPublished",
    "PeerUnknownError",
    "ProtocolError",
    "TransferCancelled",
    "TransferError",
    "TransferFailed",
    "TransferFenced",
    "TransferTimeout",
    "WrongThreadError",
]


class NixlAsyncError(Exception):
    """Base of every error this library raises on purpose."""


class EngineClosedError(NixlAsyncError):
    """The engine was used before `start()` or after `close()`."""


class CollectionClosedError(NixlAsyncError, RuntimeError):
    """A task started inside `TransferEngine.collect_transfers()` submitted after the block ended.

    Whoever settled that collection (the sync facade, before reporting the request) would never
    see the transfer, so it is refused and nothing is posted.
    """


class WrongThreadError(NixlAsyncError, RuntimeError):
    """A NIXL call came from a thread other than the one that owns the agent."""


class CallTooLarge(NixlAsyncError, ValueError):
    """A call's payload is over what a peer takes (`EngineConfig.max_request_bytes`): refused unsent."""


class BackendStartError(NixlAsyncError, RuntimeError):
    """NIXL could not create a backend the engine is configured with (`start()` made no agent).

    NIXL's own exception says only ``NIXL_ERR_BACKEND``; the message adds the cause where this
    host shows it (UCX_TLS without a CUDA transport on a GPU host), and ``__cause__`` is NIXL's.
    """


class LayoutError(NixlAsyncError, ValueError):
    """The caller's layout, memory or block ids are invalid; nothing was posted."""


class HandshakeError(NixlAsyncError):
    """Connecting to a peer, or a call to it over the side channel, failed. `address` says which one."""

    def __init__(self, message: str, *, address: str | None = None) -> None:
        super().__init__(message)
        self.address = address


class HandshakeTimeout(HandshakeError, TimeoutError):
    """The peer did not answer the metadata query within the timeout."""


class HandshakeRejected(HandshakeError):
    """The peer answered with an error reply (bad request, authentication, ...), or its answer is refused here.

    `code`: the peer's error code ("auth_failed", "unknown_topic", "refused", "too_large", ...) for a
    program to act on; None when the refusal is ours."""

    def __init__(self, message: str, *, address: str | None = None, code: str | None = None) -> None:
        super().__init__(message, address=address)
        self.code = code


class IncompatiblePeerError(HandshakeError):
    """The peer's compatibility hash differs (its KV cache cannot be mixed with ours), or one side
    would READ UCX/TCP segments larger than it receives (`EngineConfig.tcp_segment_bytes`)."""


class EngineIdMismatch(HandshakeError):
    """The engine answering at that address is not the one the caller expected."""


class ProtocolError(HandshakeError):
    """The peer's reply could not be decoded, or speaks an unknown protocol version."""


class DiscoveryUnavailable(HandshakeError):
    """The discovery service (etcd) did not answer within the handshake timeout, or refused us."""


class PeerNotPublished(HandshakeError):
    """No engine with that id is published in the discovery service (never was, closed, or its lease ran out)."""


class TransferError(NixlAsyncError):
    """A transfer did not complete. `transfer_id` and `peer` say which one."""

    def __init__(self, message: str, *, transfer_id: int | None = None, peer: str | None = None) -> None:
        super().__init__(message)
        self.transfer_id = transfer_id
        self.peer = peer


class TransferFailed(TransferError):
    """NIXL reported an error for the transfer (dead peer, cut link, bad remote memory)."""


class BatchRowsFailed(TransferFailed):
    """Some rows of a `TransferBatch` failed (the others arrived); none of its handles is alive.

    `failed_rows` maps each failed row to NIXL's answer; those rows' blocks hold no trustworthy data.
    """

    def __init__(self, message: str, *, failed_rows: dict[int, str], transfer_id: int | None = None,
                 peer: str | None = None) -> None:  # fmt: skip
        super().__init__(message, transfer_id=transfer_id, peer=peer)
        self.failed_rows = failed_rows


class NotificationFailed(TransferFailed):
    """A notification could not be sent (the peer is unknown to NIXL, or its queue is full).

    `result` is the `TransferResult` of a READ whose data did arrive, and only its completion
    notice could not be sent: its blocks hold the data (and NIXL holds none of their handles).
    """

    result: TransferResult | None = None


class TransferTimeout(TransferError, TimeoutError):
    """The transfer's deadline passed before it completed; its handles were released."""


class TransferCancelled(TransferError):
    """The transfer was cancelled; its handles were released."""


class TransferFenced(TransferError):
    """The transfer ended (`reason` says why), but NIXL has not let go of all its handles.

    Until it does, the transfer's local blocks may still be written (a READ) or read (a WRITE):
    do not hand them to anyone. The engine keeps that memory registered and alive meanwhile;
    `Transfer.wait_quiet()` (or `SyncEngine.get_finished`, which reports the request only then)
    says when the blocks are safe again.
    """

    def __init__(self, message: str, *, reason: TransferError, slices: int = 0) -> None:
        super().__init__(message, transfer_id=reason.transfer_id, peer=reason.peer)
        self.reason = reason
        self.slices = slices
        # Set by the engine: ``await error.quiet(timeout)`` -> True once NIXL let go of the memory.
        self.quiet: Callable[[float | None], Awaitable[bool]] | None = None

    @classmethod
    def of(cls, reason: TransferError, *, slices: int) -> TransferFenced:
        fenced = cls(
            f"{reason} -- and NIXL still holds {slices} of its handles: its memory is fenced until they end",
            reason=reason,
            slices=slices,
        )
        fenced.__cause__ = reason
        return fenced


class LeaseExpired(TransferError):
    """The producer's lease on those blocks has run out (they may hold other data now).

    A submit past the lease (or one still waiting for room when it ends) is refused with nothing
    posted; a transfer under way when it ends is stopped, and one whose data came after it is not
    trusted: either is reported, as any error, once NIXL holds none of its handles. Not a
    `TimeoutError` (a renewed lease, `TransferEngine.renew_lease`, moves it).
    """


class NotificationTimeout(NixlAsyncError, TimeoutError):
    """Fewer notifications than expected arrived before the deadline (`message`: the one awaited; the text
    shows only its start)."""

    def __init__(self, text: str, *, message: bytes = b"") -> None:
        super().__init__(text)
        self.message = message


class NotificationsLost(NixlAsyncError):
    """A subscription (`TransferEngine.notifications()`) fell so far behind that it was ended: the
    notifications it held unread reached the unclaimed limits. Those before it were all delivered."""


class PeerUnknownError(NixlAsyncError, KeyError):
    """No connected peer has that engine id."""
