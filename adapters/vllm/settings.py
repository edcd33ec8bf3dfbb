"""What the adapter reads from vLLM's configuration: one place, plain values, no I/O.

Everything a user sets goes through ``--kv-transfer-config`` exactly as for vLLM's
NixlConnector; our own knobs live in ``kv_connector_extra_config``:

- ``kv_lease_duration`` (s, default 30, as vLLM): how long a producer holds a finished
  request's blocks for its reader. The reader is told the expiry and refuses to read later.
- ``auth_secret_env`` (name of an environment variable holding it) or ``auth_secret_file`` (a
  path): a shared secret (>= 16 bytes) both sides must prove in every handshake and
  notification. ``auth_secret`` (the value itself) works too, but vLLM prints its whole
  ``--kv-transfer-config`` at startup, so prefer the other two.
- ``transfer_timeout`` (s, default 120) and ``handshake_timeout`` (s, default 5): a dead or
  silent peer fails a request within these instead of hanging it.
- ``link_timeout`` (s, default 5; ``null`` keeps UCX's defaults): a peer silent this long over
  UCX/TCP loses its connection, so a read across a cut link fails (and its blocks go quiet)
  instead of staying in flight for minutes (`EngineConfig.link_timeout_s`).
- ``tcp_segment_bytes`` (default 524288; ``null``: UCX's 64 KiB): the largest active message UCX
  over TCP carries a READ's data in (`EngineConfig.tcp_segment_bytes`). Prefill and decode must
  agree: a reader receiving smaller segments than its producer sends is refused at the handshake.
- ``tcp_send_buffer_bytes`` (default 8388608; ``null``: the kernel's autotuning): each UCX/TCP socket's
  send buffer, asked for only where the host grants it in full and autotuning would stop short of it
  (`EngineConfig.tcp_send_buffer_bytes`). A producer sends a READ's data from it.
- ``etcd_endpoint`` (``host:port``; default none), ``etcd_namespace`` (default ``nixl_async``) and
  ``etcd_lease_ttl`` (s, default 10): publish each rank's engine in etcd and find producers by engine
  id there, so ``kv_transfer_params`` need no ``remote_host``/``remote_port`` (`EngineConfig.etcd`).
- ``push_registration_timeout`` (s, default ``decoder_kv_blocks_ttl`` or 480, as vLLM; push mode
  only): how long decode waits for prefill's WRITE of a registered request before failing it
  (prefill writes nothing after it).
- ``push_progressive`` (default false; push mode only): prefill WRITEs each layer's KV of a request
  decode already registered as soon as the layer is computed, and commits the request at its end
  (decode never sees a partial one). DRAM caches of attention-only models (one KV cache group),
  over the UCX backend alone.
- ``idle_step_wait_s`` (default 0.002; 0 turns it off): a vLLM step that schedules nothing while
  transfers are under way waits up to this long for one to end (or for a reader's notification)
  instead of returning at once, and has NIXL progressed every 0.25 ms meanwhile (`worker.idle_step_wait`).
  vLLM steps such an engine back to back (a decode waiting for its KV, a producer whose readers
  read), which takes a core; a request that arrives meanwhile waits at most this long to be scheduled.
- ``switch_interval_s`` (unset by default): lowers the worker process's `sys.setswitchinterval`
  to this many seconds (never raises it). The engine's loop thread shares the interpreter with
  vLLM's worker thread, and at Python's 5 ms each hand-over to the loop can wait that long; but
  the setting is process-wide and is paid in the model thread's steps. Measured with 0.0005
  against Python's own, four 3-run sets (README, scenario 9): decode steps under load slower
  with it in three and equal in one, first-token latency at concurrency 1 lower in two and no
  different in two.
  So the process keeps Python's interval unless a deployment asks for the trade.

NixlConnector's own keys are honoured (``backends``, ``num_threads`` (unset: NIXL's default, no extra
UCX threads, where NixlConnector passes 4: our loop progresses the worker), ``engine_ttl``,
``enforce_handshake_compat``, ``kv_lease_duration``; ``kv_recompute_threshold`` is accepted as
NixlConnector accepts it without ``bidirectional_kv_xfer``, where it changes nothing: it only
bounds reading KV back from decode) or refused at startup with an error naming the key
(`REFUSED`), as are unknown keys and the parallel layouts the adapter does not implement
(pipeline parallel, decode/prefill context parallel, ``enable_permute_local_kv``).
"""

from __future__ import annotations

import ipaddress
import math
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nixl_async import EngineConfig, EtcdConfig, HandshakeError, Peer, PollConfig, TransferEngine
from nixl_async.config import TCP_SEGMENT_BYTES, TCP_SEGMENT_RANGE, TCP_SEND_BUFFER_BYTES, TCP_SEND_BUFFER_RANGE

__all__ = ["ADAPTER_POLL", "REFUSED", "AdapterSettings", "UnsupportedSetting", "connect_rank", "rank_engine_id"]

ADAPTER_PROTOCOL = "nixl_async-vllm-pull-1"

# Never spin: the loop thread shares the interpreter and the cores with vLLM's model thread
# (measured, tiny model: decode TTFT p50 at concurrency 4 62 -> 42 ms without the 2 ms linger;
# inter-token latency during P/D over TCP ~4.4 -> ~2.2 ms, NixlConnector's, without the spin near
# a read's end and without busy hints). A producer ignores busy hints: vLLM steps it while readers
# may read, and each step pokes the loop. Nor does it check again 1, 2, 4, ... ms after its own
# transfers end (the engine's back-off, which catches a burst's next request): a submit wakes it
# anyway, readers notify through the side channel, and on decode's one core each such check after
# a KV load is CPU taken from the model steps beside the load (bench `small_reads`: 748 -> 497 us
# per read). It still checks every `waiting_interval_s` while a notification is awaited.
ADAPTER_POLL = PollConfig(linger_s=0.0, spin=False, follow_busy_hints=False, backoff_start_s=PollConfig.idle_interval_s)
# A push registration names every decode block of a request (up to 5 bytes each): at the engine's
# 64 KiB a prompt of ~200 k tokens in 16-token blocks no longer fit, and decode held it to its deadline.
MAX_CALL_BYTES = 1 << 20
# Push mode: decode waits this long past `write_by` (plus the engine's release grace) for WRITEs in flight.
WRITE_MARGIN_S = 2.0

# Keys we read, ours and NixlConnector's (see the module docstring).
_KNOWN = {
    "kv_lease_duration", "auth_secret", "auth_secret_env", "auth_secret_file", "transfer_timeout",
    "handshake_timeout", "link_timeout", "switch_interval_s", "backends", "num_threads", "engine_ttl",
    "enforce_handshake_compat", "kv_recompute_threshold", "etcd_endpoint", "etcd_namespace", "etcd_lease_ttl",
    "push_registration_timeout", "push_progressive", "idle_step_wait_s", "tcp_segment_bytes",
    "tcp_send_buffer_bytes",
}  # fmt: skip
PUSH_ONLY = ("push_registration_timeout", "push_progressive")
PUSH_CONNECTOR = "NixlAsyncPushConnector"
# vLLM's push scheduler times registrations out after `decoder_kv_blocks_ttl` when
# `push_registration_timeout` is not set: honoured so in push mode.
PUSH_FALLBACKS = ("decoder_kv_blocks_ttl",)
# NixlConnector keys the adapter does not implement: refused when set (to anything but the default).
REFUSED: dict[str, tuple[object, str]] = {
    "bidirectional_kv_xfer": (False, "KV transfer from decode back to prefill is not implemented"),
    "decoder_kv_blocks_ttl": (
        None,
        "in pull mode it only keeps decode's blocks for bidirectional_kv_xfer, which is not implemented",
    ),
}


class UnsupportedSetting(ValueError):
    """A vLLM or NixlConnector setting the adapter does not implement: refused, never ignored."""


def _refuse_unsupported(vllm_config: Any, extra: dict[str, Any]) -> None:
    push = getattr(vllm_config.kv_transfer_config, "kv_connector", None) == PUSH_CONNECTOR  # (stand-ins lack it)
    for key, value in extra.items():
        if key in PUSH_FALLBACKS and push:
            continue
        if key in REFUSED:
            default, why = REFUSED[key]
            if value != default:
                raise UnsupportedSetting(f"kv_connector_extra_config[{key!r}] = {value!r} is not supported: {why}")
        elif key in PUSH_ONLY and not push:
            raise UnsupportedSetting(f"kv_connector_extra_config[{key!r}] applies to push mode ({PUSH_CONNECTOR}) only")
        elif key not in _KNOWN:
            raise UnsupportedSetting(
                f"kv_connector_extra_config[{key!r}] is not a setting of this adapter (known: {sorted(_KNOWN)})"
            )
    parallel = vllm_config.parallel_config
    for name, what in (
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("decode_context_parallel_size", "decode context parallelism (DCP)"),
        ("prefill_context_parallel_size", "prefill context parallelism (PCP)"),
    ):
        size = getattr(parallel, name, 1)
        if size > 1:
            raise UnsupportedSetting(f"{name}={size}: {what} is not supported by the nixl_async adapter yet")
    nodes = getattr(parallel, "nnodes_within_dp", 1)
    role = getattr(vllm_config.kv_transfer_config, "kv_role", "kv_both")
    if nodes > 1 and extra.get("etcd_endpoint") is None and (push or role != "kv_consumer"):
        # Each rank serves its own handshakes, and peers dial remote_host at the side-channel port + rank:
        # one node's ranks only (a pull-mode reader is never dialled). Through etcd ranks are found by id.
        raise UnsupportedSetting(
            f"tensor parallelism across {nodes} nodes needs kv_connector_extra_config['etcd_endpoint'] "
            "(peers reach each rank at remote_host, which names one node), and each node's "
            "VLLM_NIXL_SIDE_CHANNEL_HOST set to its own address"
        )
    if getattr(vllm_config.kv_transfer_config, "enable_permute_local_kv", False):
        raise UnsupportedSetting("enable_permute_local_kv is not supported: the adapter reads layouts as they are")
    if getattr(getattr(vllm_config, "aux_output_config", None), "enabled", False):
        # (vLLM 0.32 refuses it for its own NIXL connectors by their names: ours would start, and decode would
        # answer without the routed experts prefill computed)
        raise UnsupportedSetting("--enable-return-routed-experts is not supported: the adapter moves KV only, "
                                 "not auxiliary outputs (as vLLM's NIXL connectors)")  # fmt: skip


def _registration_timeout(extra: dict[str, Any]) -> float:
    """Push mode's `push_registration_timeout`; unset, `decoder_kv_blocks_ttl` (if set), as vLLM's push scheduler.

    Decode lets prefill write until that long after registering less the margin for WRITEs in
    flight (`WRITE_MARGIN_S` plus the engine's release grace): a timeout within the margin leaves
    no time to write, and every push would be refused.
    """
    key = "push_registration_timeout"
    if key not in extra and extra.get("decoder_kv_blocks_ttl") is not None:
        key = "decoder_kv_blocks_ttl"
    timeout = _number(extra, key, 480)
    margin = EngineConfig.release_grace_s + WRITE_MARGIN_S
    if timeout <= margin:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be over {margin:g} s (decode's margin for WRITEs "
                         f"in flight; prefill may write until the timeout less it), got {timeout!r}")  # fmt: skip
    return timeout


def _backends(extra: dict[str, Any]) -> tuple[str, ...]:
    value = extra.get("backends", ["UCX"])
    if isinstance(value, str) or not value or not all(isinstance(b, str) and b for b in value):
        raise ValueError(f"kv_connector_extra_config['backends'] must be a list of NIXL backend names, got {value!r}")
    return tuple(value)


def _backend_params(extra: dict[str, Any], backends: tuple[str, ...]) -> dict[str, str]:
    """NIXL backend parameters: ``num_threads`` for the UCX backend, as NixlConnector passes it."""
    if "num_threads" not in extra:
        return {}  # UCX's own default: our loop progresses the worker, no extra threads wanted
    threads = extra["num_threads"]
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ValueError(f"kv_connector_extra_config['num_threads'] must be an integer >= 0, got {threads!r}")
    if backends != ("UCX",):
        raise UnsupportedSetting(
            f"kv_connector_extra_config['num_threads'] applies to the UCX backend alone, not to backends {backends}"
        )
    return {"num_threads": str(threads)} if threads else {}


def _recompute_threshold(extra: dict[str, Any]) -> None:
    """vLLM's scheduler reads it with ``int()`` before ours runs: what that takes is taken, the rest refused
    naming the key (vLLM's own error names none)."""
    value = extra.get("kv_recompute_threshold", 64)
    try:
        if isinstance(value, bool):
            raise TypeError(value)
        int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(
            f"kv_connector_extra_config['kv_recompute_threshold'] must be a whole number, got {value!r}"
        ) from None


def _check_side_channel(host: str, base_port: int, tp: int) -> None:
    """vLLM's ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``, checked: rank r listens at base + r, and port 0
    would make rank 0 listen on a random port while the scheduler announces 0."""
    if not host.strip():
        raise ValueError("VLLM_NIXL_SIDE_CHANNEL_HOST is empty: set it to this host's address (or unset it)")
    if not 0 < base_port <= 65536 - tp:
        raise ValueError(f"VLLM_NIXL_SIDE_CHANNEL_PORT: this instance's ranks would listen at ports {base_port}.."
                         f"{base_port + tp - 1}, outside 1..65535")  # fmt: skip


def _flag(extra: dict[str, Any], key: str, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be true or false, got {value!r}")
    return value


def rank_engine_id(engine_id: str, tp_rank: int) -> str:
    """The engine id one TP rank's transfer engine announces (vLLM's id names the whole instance)."""
    return f"{engine_id}/tp{tp_rank}"


async def connect_rank(engine: TransferEngine, host: str | None, port: int | None, rank_id: str, *,
                       refresh: bool = False) -> Peer:  # fmt: skip
    """Connect to a peer rank: by its engine id in etcd when configured, else at host:port."""
    if engine.config.etcd is not None:
        return await engine.connect(engine_id=rank_id, refresh=refresh)
    if not host or not port:
        raise HandshakeError(f"no address for producer {rank_id!r}: remote_host/remote_port unset, no etcd_endpoint")
    return await engine.connect(host, port, expected_engine_id=rank_id, refresh=refresh)


def _etcd(extra: dict[str, Any]) -> EtcdConfig | None:
    endpoint = extra.get("etcd_endpoint")
    if endpoint is None:
        for key in ("etcd_namespace", "etcd_lease_ttl"):
            if key in extra:
                raise ValueError(f"kv_connector_extra_config[{key!r}] needs 'etcd_endpoint'")
        return None
    ttl = extra.get("etcd_lease_ttl", 10)
    whole = isinstance(ttl, int | float) and not isinstance(ttl, bool) and math.isfinite(ttl) and ttl == int(ttl)
    if not whole:
        raise ValueError(f"kv_connector_extra_config['etcd_lease_ttl'] must be whole seconds, got {ttl!r}")
    try:
        return EtcdConfig(str(endpoint), namespace=extra.get("etcd_namespace", "nixl_async"), lease_ttl_s=int(ttl))
    except ValueError as exc:
        raise ValueError(f"kv_connector_extra_config (etcd_endpoint, etcd_namespace): {exc}") from None


# Keys vLLM's own scheduler reads too, with arithmetic (the lease with ``//``): a string there stops vLLM's
# constructor with an error naming no key, so these must be JSON numbers (vLLM reads the push timeouts with
# ``float()``, which takes numeric strings as we do).
_READ_BY_VLLM = ("kv_lease_duration",)


def _number(extra: dict[str, Any], key: str, default: float, *, zero: bool = False) -> float:
    """A finite number > 0 (>= 0 with `zero`): a JSON number, or a numeric string where vLLM does not read the key."""
    value = extra.get(key, default)
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    text = isinstance(value, str) and key not in _READ_BY_VLLM
    try:
        if not (numeric or text):
            raise ValueError(value)
        number = float(value)
    except ValueError:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a number, got {value!r}") from None
    if not ((number >= 0 if zero else number > 0) and number < math.inf):  # (NaN fails both)
        raise ValueError(
            f"kv_connector_extra_config[{key!r}] must be a finite number {'>=' if zero else '>'} 0, got {value!r}"
        )
    return number


def _optional_number(extra: dict[str, Any], key: str) -> float | None:
    """`_number` for a setting that is off unless given (None or absent: off)."""
    return None if extra.get(key) is None else _number(extra, key, 0)


def _idle_wait(extra: dict[str, Any]) -> float:
    wait = _number(extra, "idle_step_wait_s", 0.002, zero=True)  # 0: off
    if wait > 0.1:
        raise ValueError(f"kv_connector_extra_config['idle_step_wait_s'] must be <= 0.1 (seconds), got {wait}")
    return wait


def _link_timeout(extra: dict[str, Any]) -> float | None:
    if extra.get("link_timeout", 5.0) is None:
        return None
    timeout = _number(extra, "link_timeout", 5.0)
    if timeout < 2:
        raise ValueError(f"kv_connector_extra_config['link_timeout'] must be >= 2 (seconds) or null, got {timeout}")
    return timeout


def _bytes_or_null(extra: dict[str, Any], key: str, default: int, bounds: tuple[int, int]) -> int | None:
    value = extra.get(key, default)
    low, high = bounds
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
        raise ValueError(
            f"kv_connector_extra_config[{key!r}] must be whole bytes in [{low}, {high}] or null, got {value!r}"
        )
    return value


def _secret(extra: dict[str, Any]) -> bytes | None:
    """The shared secret from the value, an environment variable or a file (never logged)."""
    # Present means set (an empty one is refused, never read as "no authentication").
    given = [key for key in ("auth_secret", "auth_secret_env", "auth_secret_file") if extra.get(key) is not None]
    if len(given) > 1:
        raise ValueError(f"kv_connector_extra_config: give only one of {given}")
    if not given:
        return None
    key = given[0]
    value = extra[key]
    if key == "auth_secret" and isinstance(value, bytes) and value:
        return value
    if not isinstance(value, str) or not value:
        what = "the secret" if key == "auth_secret" else "a name" if key == "auth_secret_env" else "a path"
        shown = f"a {type(value).__name__}" if key == "auth_secret" else repr(value)  # (never the secret itself)
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be {what} as a non-empty string, got {shown}")
    if key == "auth_secret_env":
        if value not in os.environ:
            raise ValueError(f"kv_connector_extra_config[{key!r}]: environment variable {value!r} is not set")
        return os.environ[value].encode()
    if key == "auth_secret_file":
        try:
            return Path(value).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"kv_connector_extra_config[{key!r}]: cannot read {value!r}: {exc.strerror}") from None
    return value.encode()


@dataclass(frozen=True)
class AdapterSettings:
    side_channel_host: str
    side_channel_port: int  # this instance's base port: TP rank r serves at base + r
    lease_s: float
    transfer_timeout_s: float
    handshake_timeout_s: float
    auth_secret: bytes | None
    switch_interval_s: float | None = None  # None: keep the process's interval
    backends: tuple[str, ...] = ("UCX",)
    backend_params: tuple[tuple[str, str], ...] = ()
    peer_ttl_s: float | None = 3600.0  # NixlConnector's engine_ttl; None: never evict
    enforce_compat: bool = True
    link_timeout_s: float | None = 5.0
    tcp_segment_bytes: int | None = TCP_SEGMENT_BYTES
    tcp_send_buffer_bytes: int | None = TCP_SEND_BUFFER_BYTES
    etcd: EtcdConfig | None = None
    push_registration_timeout_s: float = 480.0  # push mode: how long decode waits for prefill's WRITE
    push_progressive: bool = False  # push mode: WRITE each layer as soon as prefill computed it
    idle_step_wait_s: float = 0.002  # a step that scheduled nothing waits this long for a transfer to end

    def __repr__(self) -> str:  # the secret never appears in logs
        secret = "set" if self.auth_secret else "none"
        return (
            f"AdapterSettings(side_channel={self.side_channel_host}:{self.side_channel_port}, "
            f"lease_s={self.lease_s}, transfer_timeout_s={self.transfer_timeout_s}, auth={secret})"
        )

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> AdapterSettings:
        from vllm import envs

        transfer = vllm_config.kv_transfer_config
        extra = dict(transfer.kv_connector_extra_config or {})
        _refuse_unsupported(vllm_config, extra)
        parallel = vllm_config.parallel_config
        tp = max(parallel.tensor_parallel_size, parallel.decode_context_parallel_size)
        # Each data-parallel instance gets its own range of ports, one per TP rank.
        port = envs.VLLM_NIXL_SIDE_CHANNEL_PORT + parallel.data_parallel_index * tp
        secret = _secret(extra)
        backends = _backends(extra)
        progressive = _flag(extra, "push_progressive", False)
        if progressive and backends != ("UCX",):
            # Its commit is a notification sent once the layers' WRITEs are DONE: only UCX reports a
            # WRITE done once its bytes are in decode's memory.
            raise UnsupportedSetting(
                f"kv_connector_extra_config['push_progressive'] needs the UCX backend alone, not backends {backends}"
            )
        ttl = extra.get("engine_ttl", 3600.0)
        if isinstance(ttl, bool) or not isinstance(ttl, int | float) or math.isnan(ttl):
            raise ValueError(f"kv_connector_extra_config['engine_ttl'] must be a number of seconds, got {ttl!r}")
        _recompute_threshold(extra)
        _check_side_channel(envs.VLLM_NIXL_SIDE_CHANNEL_HOST, port, tp)
        return cls(
            side_channel_host=envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
            side_channel_port=port,
            lease_s=_number(extra, "kv_lease_duration", 30),
            transfer_timeout_s=_number(extra, "transfer_timeout", 120),
            handshake_timeout_s=_number(extra, "handshake_timeout", 5),
            auth_secret=secret,
            switch_interval_s=_optional_number(extra, "switch_interval_s"),
            backends=backends,
            backend_params=tuple(_backend_params(extra, backends).items()),
            peer_ttl_s=float(ttl) if 0 < ttl < math.inf else None,  # as NixlConnector: <= 0 turns eviction off
            enforce_compat=_flag(extra, "enforce_handshake_compat", True),
            link_timeout_s=_link_timeout(extra),
            tcp_segment_bytes=_bytes_or_null(extra, "tcp_segment_bytes", TCP_SEGMENT_BYTES, TCP_SEGMENT_RANGE),
            tcp_send_buffer_bytes=_bytes_or_null(
                extra, "tcp_send_buffer_bytes", TCP_SEND_BUFFER_BYTES, TCP_SEND_BUFFER_RANGE
            ),
            etcd=_etcd(extra),
            push_registration_timeout_s=_registration_timeout(extra),
            push_progressive=progressive,
            idle_step_wait_s=_idle_wait(extra),
        )

    def apply_switch_interval(self) -> None:
        """Lower this process's switch interval to `switch_interval_s`, if set (never raise it)."""
        if self.switch_interval_s is not None and self.switch_interval_s < sys.getswitchinterval():
            sys.setswitchinterval(self.switch_interval_s)

    def bind_host(self) -> str:
        """The address to listen on: ZMQ binds IPs, so a host name is resolved first (IPv6 too)."""
        host = self.side_channel_host.removeprefix("[").removesuffix("]")  # ([::1] as a URL has it)
        try:
            return str(ipaddress.ip_address(host))
        except ValueError:  # a name: its first TCP address, IPv4 or IPv6 (gethostbyname knows IPv4 alone)
            return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])

    def engine_config(self, engine_id: str, compat: dict[str, str]) -> EngineConfig:
        return EngineConfig(
            engine_id=engine_id,
            compat={"protocol": ADAPTER_PROTOCOL, **compat},
            transfer_timeout_s=self.transfer_timeout_s,
            handshake_timeout_s=self.handshake_timeout_s,
            auth_secret=self.auth_secret,
            backends=self.backends,
            backend_params=dict(self.backend_params),
            peer_ttl_s=self.peer_ttl_s,
            enforce_compat=self.enforce_compat,
            link_timeout_s=self.link_timeout_s,
            tcp_segment_bytes=self.tcp_segment_bytes,
            tcp_send_buffer_bytes=self.tcp_send_buffer_bytes,
            etcd=self.etcd,
            # Readers notify producers through the side channel: a NIXL notification would hold
            # the reader's next read until the producer's loop polls (see EngineConfig.notify_via).
            notify_via="side_channel",
            poll=ADAPTER_POLL,
            max_request_bytes=MAX_CALL_BYTES,
        )
