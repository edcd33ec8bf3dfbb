"""One frozen configuration for an engine. Every knob lives here, so nothing reads the
environment behind the caller's back; adapters translate their own settings into it."""

from __future__ import annotations

import dataclasses
import math
import numbers
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "TCP_SEGMENT_BYTES",
    "TCP_SEGMENT_RANGE",
    "TCP_SEND_BUFFER_BYTES",
    "TCP_SEND_BUFFER_RANGE",
    "UCX_TCP_DEFAULT_SEGMENT",
    "EngineConfig",
    "EtcdConfig",
    "PollConfig",
    "SendBufferLimits",
    "tcp_segment_in_use",
    "tcp_send_buffer_request",
    "ucx_link_settings",
]

# UCX's own TCP_RX_SEG_SIZE: the most a peer whose agent runs on UCX's defaults can receive at once.
UCX_TCP_DEFAULT_SEGMENT = 64 << 10
TCP_SEGMENT_BYTES = 512 << 10  # ours (EngineConfig.tcp_segment_bytes)
TCP_SEGMENT_RANGE = (16 << 10, 64 << 20)  # what EngineConfig.tcp_segment_bytes accepts
_SEGMENT_KEYS = ("TCP_RX_SEG_SIZE", "TCP_TX_SEG_SIZE")
TCP_SEND_BUFFER_BYTES = 8 << 20  # ours (EngineConfig.tcp_send_buffer_bytes)
TCP_SEND_BUFFER_RANGE = (64 << 10, 1 << 30)  # what EngineConfig.tcp_send_buffer_bytes accepts
_PROBE_BYTES = 1 << 30  # asked of a throwaway socket: the kernel grants twice its cap (net.core.wmem_max)
_MEMUNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_MEMUNITS |= {f"{unit}b": size for unit, size in _MEMUNITS.items() if unit not in ("", "b")}


@dataclass(frozen=True)
class PollConfig:
    """How the poller paces itself (see `_poller.py` for why these defaults).

    While transfers are in flight it checks them every `busy_interval_s` until one may be about
    to end (from the rate recent transfers moved at) or has slices to post, then on every loop
    iteration (a spin that yields to other coroutines); ``busy_interval_s=0`` spins for as long
    as anything is in flight. After the last activity it keeps spinning for `linger_s`, then
    backs off from `backoff_start_s` doubling up to `idle_interval_s`. While someone awaits a
    notification the interval never exceeds `waiting_interval_s`.

    `spin=False` never spins: transfers about to end are checked every `busy_interval_s` too, for
    a host whose other threads share the interpreter and the cores (vLLM's worker: spinning there
    slowed its decode steps). `follow_busy_hints=False` ignores peers' busy hints, for a host
    that calls `poll_soon` itself whenever peers may be reading (the vLLM adapter's producer,
    once per step).
    """

    busy_interval_s: float = 0.001
    linger_s: float = 0.002
    backoff_start_s: float = 0.001
    idle_interval_s: float = 0.05
    waiting_interval_s: float = 0.002
    spin: bool = True
    follow_busy_hints: bool = True

    def __post_init__(self) -> None:
        # Finite seconds: an infinite busy interval never checks a transfer again (its deadline and a
        # cancel's release are seen only at checks), a NaN one compares false everywhere.
        for name in ("busy_interval_s", "linger_s", "backoff_start_s", "idle_interval_s", "waiting_interval_s"):
            value = getattr(self, name)
            if not _finite_seconds(value) or value < 0:
                raise ValueError(f"PollConfig.{name} must be a finite number of seconds >= 0, got {value!r}")
        for name in ("spin", "follow_busy_hints"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"PollConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.backoff_start_s > self.idle_interval_s:
            raise ValueError("PollConfig.backoff_start_s must not exceed idle_interval_s")
        if self.backoff_start_s == 0 < self.idle_interval_s:
            raise ValueError("PollConfig.backoff_start_s must be > 0 to back off to idle_interval_s (0 doubles to 0)")
        # (zeros elsewhere are asked-for spinning: idle_interval_s=0 never idles, as busy_interval_s=0 never waits)


def _finite_seconds(value: object) -> bool:
    """A real number, not a bool, and finite (an int is)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return isinstance(value, numbers.Integral) or math.isfinite(value)


def ucx_link_settings(timeout_s: float) -> dict[str, str]:
    """UCX settings that drop a TCP connection after about `timeout_s` of silence from the peer.

    Keepalive probes catch a link that died while nothing was unacknowledged (an idle
    connection, or a READ waiting for the peer's data); TCP_USER_TIMEOUT one that died under
    data we sent. The kernel counts keepalive in whole seconds.
    """
    total = max(2, int(timeout_s))
    idle = total // 2
    return {
        "TCP_KEEPIDLE": f"{idle}s",
        "TCP_KEEPINTVL": "1s",
        "TCP_KEEPCNT": str(total - idle),
        "TCP_USER_TIMEOUT": f"{int(timeout_s * 1000)}ms",
    }


def _memunits(text: str) -> int:
    """UCX's size syntax ("65536", "512k", "1mb"), as its configuration parser reads it."""
    value = text.strip().lower()
    digits = value.rstrip("bkmgt")
    unit = value[len(digits) :]
    if not (digits.isascii() and digits.isdigit()) or unit not in _MEMUNITS:
        raise ValueError(f"not a UCX size: {text!r}")
    return int(digits) * _MEMUNITS[unit]


def _environment_sets_segment(environ: Mapping[str, str]) -> bool:
    return any(f"UCX_{key}" in environ for key in _SEGMENT_KEYS)


def _upper_key(item: str) -> str:
    """A "key=value" UCX setting with its key upper-cased (the value as given)."""
    key, value = item.split("=", 1)
    return f"{key.strip().upper()}={value}"


def _named_keys(engine_config: str) -> set[str]:
    """The UCX settings an ``engine_config`` string ("KEY=value,...") names, upper-cased."""
    return {item.split("=", 1)[0].strip().upper() for item in engine_config.split(",") if "=" in item}


def tcp_segment_in_use(configured: int | None, environ: Mapping[str, str]) -> int:
    """The largest UCX/TCP segment an agent made with `configured` sends and receives.

    An agent sends active messages up to its receive segment. UCX's environment wins over a
    backend's own settings, and where it names a segment size the engine passes none of its own
    (`EngineConfig.backend_settings`): ``UCX_TCP_RX_SEG_SIZE`` then decides, or UCX's default.
    """
    if _environment_sets_segment(environ):
        given = environ.get("UCX_TCP_RX_SEG_SIZE")
        if given is None:
            return UCX_TCP_DEFAULT_SEGMENT
        try:
            size = _memunits(given)
        except ValueError:
            size = 0
        if size <= 0:
            raise ValueError(f"UCX_TCP_RX_SEG_SIZE={given!r} in the environment: not a UCX size in bytes > 0 "
                             "(e.g. 65536 or 512k)")  # fmt: skip
        return size
    return UCX_TCP_DEFAULT_SEGMENT if configured is None else configured


@dataclass(frozen=True)
class SendBufferLimits:
    """The host's say over a TCP socket's send buffer (Linux; found by `of_host`).

    A socket that asks for a send buffer (SO_SNDBUF) gets twice what it asked, at most twice
    ``net.core.wmem_max``, and the kernel stops autotuning it; left alone, autotuning grows it
    up to ``net.ipv4.tcp_wmem``'s third field.
    """

    wmem_max: int
    autotune_max: int

    @classmethod
    def of_host(cls) -> SendBufferLimits | None:
        """This network namespace's limits (None where the kernel does not say: not Linux, or hidden).

        The cap is probed on a throwaway socket, not read from /proc: a container's network
        namespace on an older kernel has no ``net.core.wmem_max`` of its own to read.
        """
        try:
            with open("/proc/sys/net/ipv4/tcp_wmem") as f:
                autotune_max = int(f.read().split()[2])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _PROBE_BYTES)
                granted = probe.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        except (OSError, ValueError, IndexError):
            return None
        return cls(granted // 2, autotune_max)


def tcp_send_buffer_request(wanted: int | None, limits: SendBufferLimits | None) -> int | None:
    """What UCX should ask SO_SNDBUF for so a socket's send buffer is `wanted` bytes, or None.

    None (leave the kernel's autotuning) unless the host grants `wanted` in full and autotuning
    would stop short of it: a smaller fixed buffer would only cap the socket.
    """
    if wanted is None or limits is None:
        return None
    asked = -(-wanted // 2)  # the kernel doubles it
    return asked if asked <= limits.wmem_max and wanted > limits.autotune_max else None


@dataclass(frozen=True)
class EtcdConfig:
    """Where engines publish and find each other (see `nixl_async.discovery`).

    `endpoint` is one etcd client address, ``host:port`` (a list is refused: put a load balancer
    or a local etcd proxy in front of a cluster). `namespace` prefixes every key, so fleets can
    share an etcd. A published engine's key lives on a lease of `lease_ttl_s` whole seconds,
    renewed every third of it: an engine that dies disappears from etcd that long after.
    """

    endpoint: str
    namespace: str = "nixl_async"
    lease_ttl_s: int = 10

    def __post_init__(self) -> None:
        if not isinstance(self.endpoint, str) or not isinstance(self.namespace, str):
            raise ValueError(
                f"EtcdConfig.endpoint and namespace must be strings, got {self.endpoint!r}, {self.namespace!r}"
            )
        host, sep, port = self.endpoint.rpartition(":")
        if ("," in self.endpoint or "://" in self.endpoint or not sep or not host or not port.isascii()
                or not port.isdigit() or not 0 < int(port) < 65536):  # fmt: skip
            raise ValueError(f"EtcdConfig.endpoint must be one 'host:port', got {self.endpoint!r}")
        if not self.namespace or self.namespace.endswith("/"):
            raise ValueError(f"EtcdConfig.namespace must be non-empty without a trailing '/', got {self.namespace!r}")
        if isinstance(self.lease_ttl_s, bool) or not isinstance(self.lease_ttl_s, int) or self.lease_ttl_s < 2:
            raise ValueError(f"EtcdConfig.lease_ttl_s must be whole seconds >= 2, got {self.lease_ttl_s!r}")

    @property
    def host(self) -> str:
        """The host as it stands in a URL (an IPv6 address keeps its brackets)."""
        return self.endpoint.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.endpoint.rpartition(":")[2])


def _default_engine_id() -> str:
    return f"engine-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one `TransferEngine`.

    `compat` holds whatever must agree between two engines before their memory can be mixed
    (model, dtype, cache layout...); its hash is exchanged in the handshake and a peer whose
    hash differs is refused with `IncompatiblePeerError` (unless `enforce_compat` is False: then
    the mismatch is logged and the peer used, at the caller's risk).
    """

    engine_id: str = field(default_factory=_default_engine_id)
    compat: Mapping[str, str] = field(default_factory=dict)
    enforce_compat: bool = True
    backends: tuple[str, ...] = ("UCX",)
    backend_params: Mapping[str, str] = field(default_factory=dict)
    # Backpressure: a submit beyond either limit waits for room.
    max_inflight_transfers: int = 4096
    max_inflight_bytes: int = 4 << 30
    # A post over CMA (or cuda_ipc) is a synchronous copy inside `transfer()`; slicing bounds the
    # loop stall. Slices are sized to copy for about `post_target_s` at the rate measured on
    # recent posts, within [min_post_bytes, max_post_bytes] and at most `max_post_descriptors`;
    # while posts wait to get the GIL back (a busy Python thread beside us), for up to twice
    # that wait instead (at most twice Python's switch interval), so fewer posts pay it. The cap
    # only guards against a runaway estimate: a GPU copy (cuda_ipc, 120-200 GB/s on an H100)
    # capped at 64 MiB posted half-millisecond slices, each paying its NIXL calls' GIL waits.
    # Slices hold whole blocks: a block (or view piece) larger than `max_post_bytes` is posted one
    # per slice, and a `TransferBatch`'s rows one post each, whatever their size.
    post_target_s: float = 0.002
    min_post_bytes: int = 1 << 20
    max_post_bytes: int = 1 << 30
    max_post_descriptors: int = 8192
    slices_in_flight: int = 2
    # Over transports that do not copy inside the post (TCP, RDMA), a slice instead
    # carries about this much wire time at the rate recent transfers to that peer moved at
    # (None: size every slice as an inline copy, as before).
    slice_flight_s: float | None = 0.025
    # After a transfer ends with an error, its slices still in flight are left to finish (NIXL
    # cannot be trusted to stop a READ in flight) and the caller hears of it once every handle is
    # released. Past this grace the caller gets `TransferFenced` instead, and the engine keeps
    # the memory registered until NIXL lets go.
    release_grace_s: float = 1.0
    # A transfer submitted without a timeout gets this deadline, so a stalled or paused peer
    # cannot hang its caller forever. None disables it.
    transfer_timeout_s: float | None = 120.0
    # UCX over TCP notices a cut link only after minutes (the kernel keeps retrying), and until
    # then a READ in flight keeps its memory fenced. A peer silent this long loses its UCX
    # connection (TCP keepalive and TCP_USER_TIMEOUT in the UCX backend's own settings, not
    # the process environment), so its transfers fail and their memory goes quiet. Whole
    # seconds, >= 2; None leaves UCX's defaults.
    link_timeout_s: float | None = 5.0
    # UCX turns cuda_ipc's GET off on a GPU without active NVLink (PCIe cards, or two processes
    # sharing one GPU); a READ of a peer's VRAM then falls back to software emulation over TCP
    # (0.4 GB/s against hundreds with cuda_ipc, measured on an H100: docs/gpu.md). True asks for
    # it in the UCX backend's own settings (CUDA_IPC_ENABLE_GET_ZCOPY=on; an environment
    # variable of that name still wins); False leaves UCX's choice.
    cuda_ipc_get: bool = True
    # UCX over TCP carries a READ's data as active messages of at most this many bytes; each
    # costs the receiver one progress call and the sender one send. UCX's 64 KiB moved 1.4-1.5
    # GB/s between two processes checking every ms here; 512 KiB 2.0-2.4 GB/s at ~40 % less CPU
    # per GB (README, Design). A peer that receives smaller segments than we send cannot READ
    # from us (UCX dropped its link, or it crashed: UCX received into smaller buffers), so the
    # handshake refuses it by name. None: UCX's default (for peers on older versions).
    # ``UCX_TCP_RX_SEG_SIZE`` or ``UCX_TCP_TX_SEG_SIZE`` in the environment still win.
    tcp_segment_bytes: int | None = TCP_SEGMENT_BYTES
    # Over TCP a READ's data leaves the *target* only while the target's UCX worker is
    # progressed (an engine every ms or two while it serves): each progress call sends what fits
    # in the socket's send buffer. Autotuning stops at 4 MiB by default, which held reads between
    # two processes to ~2 GB/s where a reader progressing without pause got ~3; with 8 MiB the
    # engine's paced reader got 0.85-1.19x that one (README, Design). The UCX backend asks each
    # socket for this much where the host allows it in full and autotuning would stop short of
    # it (`SendBufferLimits`); elsewhere, and with None, the kernel's autotuning stays. Such a
    # buffer is not trimmed under memory pressure: up to this much per socket while a reader lags.
    # ``UCX_TCP_SNDBUF`` in the environment, or TCP_SNDBUF in `backend_params`, still wins.
    tcp_send_buffer_bytes: int | None = TCP_SEND_BUFFER_BYTES
    # A peer unused this long (no connect, no transfer) with nothing in flight is forgotten: its
    # remote agent, descriptor lists and notification socket go (vLLM's engine TTL is 3600 s).
    # None keeps peers until `disconnect()`.
    peer_ttl_s: float | None = 3600.0
    # Handshake side channel.
    handshake_timeout_s: float = 5.0
    # Fleet discovery: with it, `publish()` puts what a handshake tells in etcd and
    # `connect(engine_id=...)` finds peers there (bounded by the handshake timeout too).
    etcd: EtcdConfig | None = None
    # Optional shared secret: when set, handshakes in both directions must prove it (HMAC over
    # a single-use server nonce). Never printed: it is left out of repr().
    auth_secret: bytes | None = field(default=None, repr=False)
    max_request_bytes: int = 64 << 10
    max_frame_bytes: int = 4 << 20
    # How notifications travel: "nixl" (NIXL active messages) or "side_channel" (a message to the
    # peer's handshake socket). NIXL's way makes UCX hold our next operation to that peer until
    # the peer's worker is progressed, which an idle peer does only every few ms; the side
    # channel wakes the peer's loop through its socket and holds nothing. WRITE notifications
    # always ride on the WRITE (ordering at the target).
    notify_via: str = "nixl"
    # Notifications nobody has claimed yet are kept up to this many, and up to this many bytes of
    # distinct messages (oldest dropped first).
    max_unclaimed_notifications: int = 65536
    max_unclaimed_notification_bytes: int = 64 << 20
    poll: PollConfig = field(default_factory=PollConfig)

    def __post_init__(self) -> None:
        if not self.engine_id or not isinstance(self.engine_id, str):
            raise ValueError("EngineConfig.engine_id must be a non-empty string")
        if isinstance(self.backends, str):  # (read letter by letter)
            raise ValueError(f"EngineConfig.backends must be a tuple of NIXL backend names, got {self.backends!r}")
        backends = tuple(self.backends)
        if not backends or not all(isinstance(b, str) and b for b in backends):
            raise ValueError(f"EngineConfig.backends must be a non-empty tuple of NIXL backend names, got {backends!r}")
        object.__setattr__(self, "backends", backends)
        for name in ("enforce_compat", "cuda_ipc_get"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be True or False, got {getattr(self, name)!r}")
        positive = (
            "max_inflight_transfers",
            "max_inflight_bytes",
            "min_post_bytes",
            "max_post_bytes",
            "max_post_descriptors",
            "slices_in_flight",
            "max_request_bytes",
            "max_frame_bytes",
            "max_unclaimed_notifications",
            "max_unclaimed_notification_bytes",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"EngineConfig.{name} must be a whole number > 0, got {value!r}")
            object.__setattr__(self, name, int(value))  # (numpy's ints: ZMQ's options take Python ints)
        if not isinstance(self.poll, PollConfig):
            raise ValueError(f"EngineConfig.poll must be a PollConfig, got {self.poll!r}")
        # Seconds: finite numbers (a NaN deadline is never reached and never missed; None is "no limit").
        for name, low, strict, optional in (("transfer_timeout_s", 0, True, True), ("peer_ttl_s", 0, True, True),
                                            ("handshake_timeout_s", 0, True, False), ("post_target_s", 0, True, False),
                                            ("slice_flight_s", 0, True, True), ("release_grace_s", 0, False, False),
                                            ("link_timeout_s", 2, False, True)):  # fmt: skip
            value = getattr(self, name)
            if value is None and optional:
                continue
            if not _finite_seconds(value) or value < low or (strict and value == low):
                raise ValueError(f"EngineConfig.{name} must be a finite number of seconds {'>' if strict else '>='} "
                                 f"{low}{' or None' if optional else ''}, got {value!r}")  # fmt: skip
        if self.etcd is not None and not isinstance(self.etcd, EtcdConfig):
            raise ValueError(f"EngineConfig.etcd must be an EtcdConfig (or None), got {self.etcd!r}")
        if self.notify_via not in ("nixl", "side_channel"):
            raise ValueError(f"EngineConfig.notify_via must be 'nixl' or 'side_channel', got {self.notify_via!r}")
        for name, (low, high) in (("tcp_segment_bytes", TCP_SEGMENT_RANGE),
                                  ("tcp_send_buffer_bytes", TCP_SEND_BUFFER_RANGE)):  # fmt: skip
            value = getattr(self, name)
            whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            if value is not None and not (whole and low <= value <= high):
                raise ValueError(f"EngineConfig.{name} must be whole bytes in {[low, high]} or None, got {value!r}")
            if value is not None:
                object.__setattr__(self, name, int(value))  # (numpy's ints: UCX's settings are Python strings)
        if not isinstance(self.backend_params, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.backend_params.items()
        ):
            raise ValueError(f"EngineConfig.backend_params must map strings to strings, got {self.backend_params!r}")
        if clash := sorted(_named_keys(self.backend_params.get("engine_config", "")) & set(_SEGMENT_KEYS)):
            raise ValueError(
                f"backend_params['engine_config'] sets {', '.join(clash)}: set EngineConfig.tcp_segment_bytes "
                "instead (peers check it at the handshake)"
            )
        if self.min_post_bytes > self.max_post_bytes:
            raise ValueError("EngineConfig.min_post_bytes must not exceed max_post_bytes")
        if isinstance(self.auth_secret, str | bytearray | memoryview):
            secret = self.auth_secret
            object.__setattr__(self, "auth_secret", secret.encode() if isinstance(secret, str) else bytes(secret))
        if self.auth_secret is not None and not isinstance(self.auth_secret, bytes):
            kind = type(self.auth_secret).__name__  # (never the secret itself)
            raise ValueError(f"EngineConfig.auth_secret must be bytes or a string (or None), got a {kind}")
        if self.auth_secret is not None and len(self.auth_secret) < 16:
            raise ValueError("EngineConfig.auth_secret must be at least 16 bytes")
        # Freeze the mappings so the config stays hashable-in-spirit and immutable.
        object.__setattr__(self, "compat", dict(self.compat))
        object.__setattr__(self, "backend_params", dict(self.backend_params))

    def backend_settings(self, backend: str, environ: Mapping[str, str] | None = None,
                         send_limits: SendBufferLimits | None = None) -> dict[str, str]:  # fmt: skip
        """The parameters NIXL's `backend` is created with: `backend_params`, and for UCX the link
        timeout, cuda_ipc GET, TCP segment size and TCP send buffer as UCX settings (an
        ``engine_config`` the caller gave wins key by key). `environ`: the process environment UCX
        will read; where it sets a TCP segment size, ours is left out (UCX would take the
        environment's anyway, and a receive segment below our send segment is an error), and so
        is our send buffer where it sets one. `send_limits`: the host's (`SendBufferLimits.of_host`);
        None asks for no send buffer."""
        params = dict(self.backend_params)
        if backend != "UCX":
            return params
        settings = ucx_link_settings(self.link_timeout_s) if self.link_timeout_s is not None else {}
        if self.cuda_ipc_get:
            settings["CUDA_IPC_ENABLE_GET_ZCOPY"] = "on"  # unknown to a UCX without CUDA: ignored there
        if self.tcp_segment_bytes is not None and not _environment_sets_segment(environ or {}):
            settings.update(dict.fromkeys(_SEGMENT_KEYS, str(self.tcp_segment_bytes)))
        asked = tcp_send_buffer_request(self.tcp_send_buffer_bytes, send_limits)
        if asked is not None and "UCX_TCP_SNDBUF" not in (environ or {}):
            settings["TCP_SNDBUF"] = str(asked)
        # UCX matches setting names exactly, and all of them are upper case: a lower-case one
        # would be refused (NIXL logs that only at debug level) and the setting silently lost.
        given = [_upper_key(item) for item in params.get("engine_config", "").split(",") if "=" in item]
        named = {item.split("=", 1)[0] for item in given}
        ours = [f"{key}={value}" for key, value in settings.items() if key not in named]
        if given or ours:
            params["engine_config"] = ",".join(given + ours)
        return params

    def replace(self, **changes: object) -> EngineConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
