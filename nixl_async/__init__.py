"""nixl_async: an asyncio-native transfer engine over NVIDIA NIXL.

Four rooms: `layout` (pure descriptor math), `engine` (the sole owner of the loop and the NIXL
agent), `sync` (a thin facade for threads) and `adapters/vllm` (translation for vLLM).
"""

from __future__ import annotations

from ._peers import Peer
from .config import EngineConfig, EtcdConfig, PollConfig
from .engine import TransferEngine
from .exceptions import (
    BackendStartError,
    BatchRowsFailed,
    CallTooLarge,
    CollectionClosedError,
    DiscoveryUnavailable,
    EngineClosedError,
    EngineIdMismatch,
    HandshakeError,
    HandshakeRejected,
    HandshakeTimeout,
    IncompatiblePeerError,
    LayoutError,
    LeaseExpired,
    NixlAsyncError,
    NotificationFailed,
    NotificationsLost,
    NotificationTimeout,
    PeerNotPublished,
    PeerUnknownError,
    ProtocolError,
    TransferCancelled,
    TransferError,
    TransferFailed,
    TransferFenced,
    TransferTimeout,
    WrongThreadError,
)
from .layout import BlockLayout, BlockView, LayoutKind, MemType, ViewSpec
from .notifications import Lease, Notification
from .stats import StatsSnapshot
from .sync import FinishedRequests, PeerInfo, SyncEngine
from .transfer import Transfer, TransferBatch, TransferResult, TransferState, wait_all

__version__ = "0.1.0"

__all__ = [
    "BackendStartError",
    "BatchRowsFailed",
    "BlockLayout",
    "BlockView",
    "CallTooLarge",
    "CollectionClosedError",
    "DiscoveryUnavailable",
    "EngineClosedError",
    "EngineConfig",
    "EngineIdMismatch",
    "EtcdConfig",
    "FinishedRequests",
    "HandshakeError",
    "HandshakeRejected",
    "HandshakeTimeout",
    "IncompatiblePeerError",
    "LayoutError",
    "LayoutKind",
    "Lease",
    "LeaseExpired",
    "MemType",
    "NixlAsyncError",
    "Notification",
    "NotificationFailed",
    "NotificationTimeout",
    "NotificationsLost",
    "Peer",
    "PeerInfo",
    "PeerNotPublished",
    "PeerUnknownError",
    "PollConfig",
    "ProtocolError",
    "StatsSnapshot",
    "SyncEngine",
    "Transfer",
    "TransferBatch",
    "TransferCancelled",
    "TransferEngine",
    "TransferError",
    "TransferFailed",
    "TransferFenced",
    "TransferResult",
    "TransferState",
    "TransferTimeout",
    "ViewSpec",
    "WrongThreadError",
    "__version__",
    "wait_all",
]
