"""ZMQ TCP endpoints for hosts that may be IPv6 literals: ZMQ wants those in brackets, and the socket told."""

from __future__ import annotations

import ipaddress
from typing import Any

import zmq

__all__ = ["bare_host", "endpoint", "for_host"]


def bare_host(host: str) -> str:
    """`host` without the brackets an IPv6 literal may come in (``[::1]`` -> ``::1``)."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(bare_host(host)), ipaddress.IPv6Address)
    except ValueError:  # (a name, or IPv4)
        return False


def endpoint(host: str, port: int | None = None) -> str:
    """``tcp://host:port`` as ZMQ reads it (``tcp://[::1]:5600``); without `port`, for `bind_to_random_port`."""
    bare = bare_host(host)
    where = f"[{bare}]" if _is_ipv6(bare) else bare
    return f"tcp://{where}" if port is None else f"tcp://{where}:{port}"


def for_host(sock: Any, host: str) -> None:
    """Let `sock` (a ZMQ socket, plain or asyncio) reach or listen on `host`: ZMQ speaks IPv4 alone unless told."""
    if _is_ipv6(host):
        sock.setsockopt(zmq.IPV6, 1)
