"""Other hosts on one machine: network namespaces on a bridge, for tests and benchmarks.

Each `Host` is a network namespace joined by a veth pair to a bridge in the root namespace,
which has the subnet's first address; hosts reach each other through the bridge (no IP
forwarding) and the root namespace reaches them all, so a proxy there sees them as other
machines. Processes started with `Host.prefix` run inside. UCX between two hosts must be told
to use TCP (``UCX_TLS=tcp``): the namespaces share one kernel, so UCX would otherwise still pick
shared memory or CMA. A process in the root namespace using UCX on the bridge also needs
``UCX_TCP_BRIDGE_ENABLE=y`` (UCX skips bridge devices by default), and UCX reads the routing
table once per process: interfaces made after a process's first UCX TCP connection stay
unreachable to it, so make the network first (or keep one for a whole test module).

Needs root (CAP_NET_ADMIN) and iproute2; `NetnsUnavailable` says why it cannot run.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Host", "NetnsUnavailable", "Network", "netns_required", "network", "network_or_skip"]


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be created here (no privileges, no iproute2)."""


def netns_required() -> bool:
    """Whether a test needing namespaces must fail rather than skip (set by scripts/test.sh as root)."""
    return os.environ.get("NIXL_ASYNC_REQUIRE_NETNS") == "1"


def _run(*args: str) -> None:
    subprocess.run(list(args), check=True, capture_output=True, timeout=10)


@dataclass(frozen=True)
class Host:
    """One namespace: `address` on its `device`, whose other end `root_device` is on the bridge."""

    name: str
    address: str
    device: str
    root_device: str

    @property
    def prefix(self) -> list[str]:
        """Prepend to a command to run it inside this host."""
        return ["ip", "netns", "exec", self.name]

    def run(self, *args: str) -> str:
        """Run a command inside this host; its stdout."""
        done = subprocess.run([*self.prefix, *args], check=True, capture_output=True, timeout=10, text=True)
        return done.stdout

    def set_link(self, up: bool) -> None:
        """Plug or unplug this host's cable (the root end of its veth pair)."""
        _run("ip", "link", "set", self.root_device, "up" if up else "down")

    def shape(self, rate_mbit: float, delay_ms: float = 0.0) -> None:
        """Rate-limit what leaves this host (`tc tbf`), and delay it too if `delay_ms` (`tc netem`:
        kernels without the sch_netem module, like these machines', refuse that)."""
        rate = f"{rate_mbit}mbit"
        if delay_ms:
            self.run("tc", "qdisc", "replace", "dev", self.device, "root", "netem", "delay", f"{delay_ms}ms",
                     "rate", rate)  # fmt: skip
            return
        burst = max(32 << 10, int(rate_mbit * 1e6 / 8 / 100))  # 10 ms at the rate
        self.run("tc", "qdisc", "replace", "dev", self.device, "root", "tbf", "rate", rate, "burst", str(burst),
                 "latency", "50ms")  # fmt: skip

    def unshape(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.run("tc", "qdisc", "del", "dev", self.device, "root")

    def tcp_sockets(self) -> str:
        """``ss -tni`` inside the host: its TCP connections with their byte counters."""
        return self.run("ss", "-tni")

    def listening(self) -> str:
        """``ss -tlnH`` inside the host: its listening TCP sockets."""
        return self.run("ss", "-tlnH")


@dataclass(frozen=True)
class Network:
    """The bridge (in the root namespace, at `address`) and the hosts on it."""

    bridge: str
    address: str
    hosts: list[Host]


@contextlib.contextmanager
def network(count: int, *, tag: str | None = None, subnet: str = "10.213.0") -> Iterator[Network]:
    """`count` hosts at ``{subnet}.2`` … on a bridge at ``{subnet}.1``; removed on exit.

    `tag` (default: this process id) keeps the interface names of concurrent runs apart.
    """
    tag = tag or str(os.getpid() % 100000)
    bridge = f"nxbr{tag}"
    made: list[Host] = []
    bridge_made = False  # (one that existed is another run's: never deleted here)
    try:
        try:
            _run("ip", "link", "add", bridge, "type", "bridge")
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace").strip()
            raise NetnsUnavailable(f"cannot create bridge {bridge} here: {exc} {detail}") from exc
        bridge_made = True
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        for index in range(count):
            host = Host(f"nxh{tag}-{index}", f"{subnet}.{index + 2}", f"nxv{tag}n{index}", f"nxv{tag}r{index}")
            _run("ip", "netns", "add", host.name)
            made.append(host)
            _run("ip", "link", "add", host.root_device, "type", "veth", "peer", "name", host.device)
            _run("ip", "link", "set", host.device, "netns", host.name)
            _run("ip", "link", "set", host.root_device, "master", bridge)
            _run("ip", "link", "set", host.root_device, "up")
            host.run("ip", "addr", "add", f"{host.address}/24", "dev", host.device)
            host.run("ip", "link", "set", host.device, "up")
            host.run("ip", "link", "set", "lo", "up")
        yield Network(bridge, f"{subnet}.1", made)
    finally:
        for host in made:
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True, timeout=10)
            subprocess.run(["ip", "link", "del", host.root_device], capture_output=True, timeout=10)
        if bridge_made:
            subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=10)


@contextlib.contextmanager
def network_or_skip(count: int, **kwargs: str) -> Iterator[Network]:
    """`network` for a test: skips where namespaces cannot be made, unless `netns_required()`."""
    import pytest

    try:
        with network(count, **kwargs) as net:
            yield net
    except NetnsUnavailable as exc:
        if netns_required():
            pytest.fail(f"{exc} (NIXL_ASYNC_REQUIRE_NETNS=1: this run must test across namespaces)")
        pytest.skip(str(exc))
