"""A real etcd server on loopback, for tests and benchmarks (Debian's ``etcd-server`` package).

`EtcdServer` runs the ``etcd`` binary with its own data directory and free ports, and can be
stopped, killed and started again on the same ports and data (an outage, then recovery).
`etcd_or_skip` starts one for a test, skipping where no ``etcd`` binary exists unless
`etcd_required()` (scripts/test.sh sets ``NIXL_ASYNC_REQUIRE_ETCD=1`` as root, where it installs
the package).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any, Self

from .children import dies_with_us

__all__ = ["EtcdServer", "EtcdStartError", "EtcdUnavailable", "etcd_or_skip", "etcd_required"]


class EtcdUnavailable(RuntimeError):
    """No etcd binary here, or it would not start."""


class EtcdStartError(EtcdUnavailable):
    """The etcd binary is here but did not start (a test run with it fails, it does not skip)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def etcd_required() -> bool:
    """Whether a test needing etcd must fail rather than skip."""
    return os.environ.get("NIXL_ASYNC_REQUIRE_ETCD") == "1"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One etcd member listening for clients on ``host:client_port``."""

    def __init__(self, host: str = "127.0.0.1", options: Sequence[str] = ()) -> None:
        """`options`: more of etcd's command-line flags (e.g. ``--max-request-bytes=4096``)."""
        binary = shutil.which("etcd")
        if binary is None:
            raise EtcdUnavailable("no etcd binary on PATH (Debian: apt-get install etcd-server)")
        self.binary = binary
        self.host = host
        self.options = tuple(options)
        self.client_port = _free_port(host)
        self.peer_port = _free_port(host)
        self.data_dir = tempfile.mkdtemp(prefix="nixl-async-etcd-")
        self.process: subprocess.Popen[bytes] | None = None
        self._log = open(os.path.join(self.data_dir, "etcd.log"), "ab")  # noqa: SIM115 - closed in close()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self, timeout: float = 20.0) -> Self:
        client, peer = f"http://{self.host}:{self.client_port}", f"http://{self.host}:{self.peer_port}"
        command = [
            self.binary,
            "--name=nixl-async-test",
            f"--data-dir={self.data_dir}/data",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=nixl-async-test={peer}",
            *self.options,
        ]
        self.process = subprocess.Popen(
            dies_with_us(command),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.process.poll() is not None:
                raise EtcdStartError(f"etcd exited with {self.process.returncode}: {self._log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise EtcdStartError(f"etcd did not become healthy within {timeout}s: {self._log_tail()}")
            time.sleep(0.05)
        return self

    def _log_tail(self) -> str:
        self._log.flush()
        with open(self._log.name, "rb") as log:
            return log.read()[-1500:].decode(errors="replace")

    def _healthy(self) -> bool:
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
        try:
            with opener.open(f"http://{self.endpoint}/health", timeout=1) as answer:
                return b'"health":"true"' in answer.read()
        except OSError:
            return False

    # -- a client of our own for tests (etcd's JSON gateway, blocking, a few ms on loopback) ----------
    def _call(self, path: str, body: dict[str, object]) -> dict[str, Any]:
        import urllib.request

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        request = urllib.request.Request(f"http://{self.endpoint}{path}", data=json.dumps(body).encode())
        with opener.open(request, timeout=5) as answer:
            return dict(json.loads(answer.read()))

    def get(self, key: bytes) -> bytes | None:
        """The value at `key` (None: no such key)."""
        kvs = self._call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def keys(self, prefix: bytes) -> list[bytes]:
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        kvs = self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end), "keys_only": True}).get(
            "kvs", []
        )
        return sorted(base64.b64decode(kv["key"]) for kv in kvs)

    def put(self, key: bytes, value: bytes) -> None:
        self._call("/v3/kv/put", {"key": _b64(key), "value": _b64(value)})

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL): clients see it down; `start` brings it back with its data."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def wipe(self) -> None:
        """Stop it and delete its data: started again, it is a new etcd (no keys, no leases, revisions from 1)."""
        self.stop()
        shutil.rmtree(os.path.join(self.data_dir, "data"), ignore_errors=True)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.process = None

    def close(self) -> None:
        self.kill()
        self._log.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextlib.contextmanager
def etcd_or_skip(host: str = "127.0.0.1", options: Sequence[str] = ()) -> Iterator[EtcdServer]:
    """A started `EtcdServer` for a test: skips where there is no etcd binary, unless `etcd_required()`.

    A binary that does not start fails the test (after one more try on fresh ports: two servers
    may have drawn the same free port), its data directory removed.
    """
    import pytest

    for attempt in range(2):
        try:
            server = EtcdServer(host, options)
        except EtcdUnavailable as exc:
            if etcd_required():
                pytest.fail(f"{exc} (NIXL_ASYNC_REQUIRE_ETCD=1: this run must test with etcd)")
            pytest.skip(str(exc))
        try:
            server.start()
            break
        except EtcdStartError:
            server.close()
            if attempt:
                raise
    with server:
        yield server
