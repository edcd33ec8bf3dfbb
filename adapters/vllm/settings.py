"""What the adapter reads from vLLM's configuration: one place, plain values, no I/O.

Everything a user sets goes through ``--kv-transfer-config`` exactly as for vLLM's
NixlConnector; our own knobs live in ``kv_connector_extra_config``:

- ``kv_lease_duration`` (s, default 30, as vLLM): how long a producer holds a finished
  request's blocks for its reader. The reader is told the expiry and refuses to read later.
- ``auth_secret``: shared secret (>= 16 bytes) both sides must prove in the handshake.
- ``transfer_timeout`` (s, default 120) and ``handshake_timeout`` (s, default 5): a dead or
  silent peer fails a request within these instead of hanging it.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from nixl_async import EngineConfig

__all__ = ["AdapterSettings", "rank_engine_id"]

ADAPTER_PROTOCOL = "nixl_async-vllm-pull-1"


def rank_engine_id(engine_id: str, tp_rank: int) -> str:
    """The engine id one TP rank's transfer engine announces (vLLM's id names the whole instance)."""
    return f"{engine_id}/tp{tp_rank}"


def _number(extra: dict[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be a number, got {value!r}") from None
    if number <= 0:
        raise ValueError(f"kv_connector_extra_config[{key!r}] must be > 0, got {value!r}")
    return number


@dataclass(frozen=True)
class AdapterSettings:
    side_channel_host: str
    side_channel_port: int  # this instance's base port: TP rank r serves at base + r
    lease_s: float
    transfer_timeout_s: float
    handshake_timeout_s: float
    auth_secret: bytes | None

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
        parallel = vllm_config.parallel_config
        tp = max(parallel.tensor_parallel_size, parallel.decode_context_parallel_size)
        # Each data-parallel instance gets its own range of ports, one per TP rank.
        port = envs.VLLM_NIXL_SIDE_CHANNEL_PORT + parallel.data_parallel_index * tp
        secret = extra.get("auth_secret")
        return cls(
            side_channel_host=envs.VLLM_NIXL_SIDE_CHANNEL_HOST,
            side_channel_port=port,
            lease_s=_number(extra, "kv_lease_duration", 30),
            transfer_timeout_s=_number(extra, "transfer_timeout", 120),
            handshake_timeout_s=_number(extra, "handshake_timeout", 5),
            auth_secret=secret.encode() if isinstance(secret, str) else secret,
        )

    def bind_host(self) -> str:
        """The address to listen on: ZMQ binds IPs, so a host name is resolved first."""
        return socket.gethostbyname(self.side_channel_host)

    def engine_config(self, engine_id: str, compat: dict[str, str]) -> EngineConfig:
        return EngineConfig(
            engine_id=engine_id,
            compat={"protocol": ADAPTER_PROTOCOL, **compat},
            transfer_timeout_s=self.transfer_timeout_s,
            handshake_timeout_s=self.handshake_timeout_s,
            auth_secret=self.auth_secret,
        )
