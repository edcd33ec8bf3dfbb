"""Helpers shared by scenarios: results, CPU accounting, raw NIXL baselines."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from nixl_async import EngineConfig, messages
from nixl_async._agent import OwnedAgent
from nixl_async.config import tcp_segment_in_use
from nixl_async.layout import BlockLayout, BlockView
from nixl_async.testing import TCP_TLS


@dataclass
class Result:
    """One scenario's outcome: a table for people, metrics and ratios for machines."""

    scenario: str
    columns: list[str]
    rows: list[list[Any]]
    metrics: dict[str, float] = field(default_factory=dict)
    ratios: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def format_figure(value: object, missing: str = "-") -> str:
    """A figure for a table: 3 significant digits, thousands grouped from 1,000; `missing` for nan."""
    if isinstance(value, float):
        if math.isnan(value):
            return missing
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


TCP = {"UCX_TLS": TCP_TLS, "UCX_NET_DEVICES": "lo"}

# Over TCP a READ moves only while the peer's UCX worker is progressed. An engine hints its peer
# busy while it reads (the peer then checks every 2 ms); a raw loop sends no hints, and a peer
# at its idle backoff (50 ms) served its reads at 0.24-0.63 GB/s instead of 1.6-1.9 here. So the
# TCP scenarios' peers check every 2 ms whoever reads, as a hinted peer does (vLLM's prefill,
# with NIXL's progress thread on, progresses all the time).
BRISK_PEER_POLL_S = 0.002


def run_tcp_child(module: str, quick: bool) -> Any:
    """Run ``python -m nixl_async_benchmarks.<module> --child quick|full`` with UCX over TCP only.

    The child prints its samples as one JSON line last; UCX reads its transports when the first
    agent starts, so a child keeps the other scenarios' agents on the default transports.
    """
    cmd = [sys.executable, "-m", f"nixl_async_benchmarks.{module}", "--child", "quick" if quick else "full"]
    done = subprocess.run(cmd, env={**os.environ, **TCP}, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{module} child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def percentiles(samples: list[float] | np.ndarray, *qs: float) -> list[float]:
    arr = np.asarray(samples, dtype=float)
    return [float(np.percentile(arr, q)) if arr.size else float("nan") for q in qs]


@contextmanager
def busy_python_thread() -> Iterator[list[int]]:
    """A thread of pure Python meanwhile, counting into the list it yields (one item).

    It holds the GIL but for the interpreter's switches, as a model thread's Python does at its
    worst: a reader beside it waits up to a switch interval whenever it gives the GIL up.
    """
    stop = threading.Event()
    count = [0]

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=spin, name="busy-python", daemon=True)
    thread.start()
    try:
        yield count
    finally:
        stop.set()
        thread.join()


@contextmanager
def cpu_meter() -> Iterator[dict[str, float]]:
    """CPU use of this process (all threads) over the block, in % of one core."""
    out: dict[str, float] = {}
    cpu0, t0 = time.process_time(), time.perf_counter()
    yield out
    out["seconds"] = time.perf_counter() - t0
    out["cpu_percent"] = (time.process_time() - cpu0) / out["seconds"] * 100


def raw_ucx_params() -> dict[str, str]:
    """A raw baseline's UCX parameters: the engines' TCP segment size, which its peers require
    (a reader receiving smaller segments than its peer sends cannot read: UCX dropped its link or
    it crashed), and nothing else."""
    return EngineConfig(link_timeout_s=None, cuda_ipc_get=False).backend_settings("UCX", os.environ)


def fetch_reply(host: str, port: int, timeout: float = 10.0) -> messages.MetadataReply:
    """A blocking handshake query (the raw baselines use it; the engine has its own)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(
            messages.encode(
                messages.MetadataRequest(
                    engine_id="raw-baseline",
                    tcp_segment_bytes=tcp_segment_in_use(EngineConfig().tcp_segment_bytes, os.environ),
                )
            )
        )
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no handshake reply from {host}:{port}")
        reply = messages.decode_reply(sock.recv())
    finally:
        sock.close(0)
    assert isinstance(reply, messages.MetadataReply)
    return reply


class RawReader:
    """NIXL used directly, the way a hand-written loop would: one agent, no engine."""

    def __init__(self, name: str, local: BlockLayout, address: tuple[str, int], *, progress_thread: bool,
                 ucx_params: dict[str, str] | None = None, remote_layout: str | None = None) -> None:  # fmt: skip
        """`ucx_params`: the UCX backend's parameters (default `raw_ucx_params()`); `remote_layout`:
        the peer's layout of that name (default its first)."""
        params = raw_ucx_params() if ucx_params is None else ucx_params
        self.agent = OwnedAgent(name, ("UCX",), {"UCX": params}, progress_thread=progress_thread)
        self.memory = self.agent.register(local.region_descriptors(), local.mem_type)
        reply = fetch_reply(*address)
        self.remote_name = self.agent.add_remote(reply.agent_metadata)
        named = [lay for lay in reply.layouts if remote_layout in (None, lay.name)]
        if not named:
            raise ValueError(f"the peer has no layout {remote_layout!r} ({[lay.name for lay in reply.layouts]})")
        self.remote_layout = named[0]
        self.local_view: BlockView = local.view()
        self.local = self.agent.prep_view("", self.local_view)
        self.remote = self.agent.prep_view(self.remote_name, self.remote_layout.view())

    # The transfers go through NIXL's public Python API (`nixl_agent`), as vLLM's connector calls it.
    def post(self, local_idx: np.ndarray, remote_idx: np.ndarray, notify: bytes = b"") -> tuple[Any, str]:
        """`notify`: a notification riding the READ (NIXL sends it to the peer once the data has moved)."""
        nixl = self.agent.public
        handle = nixl.make_prepped_xfer("READ", self.local, local_idx, self.remote, remote_idx, notif_msg=notify)
        return handle, nixl.transfer(handle)

    def state(self, handle: Any) -> str:
        return str(self.agent.public.check_xfer_state(handle))

    def release(self, handle: Any) -> None:
        self.agent.public.release_xfer_handle(handle)

    def read(self, local_idx: np.ndarray, remote_idx: np.ndarray, check_every_s: float = 0.0,
             notify: bytes = b"") -> None:  # fmt: skip
        """One READ as one post, its state checked every `check_every_s` (0: without pause) until DONE."""
        handle, state = self.post(local_idx, remote_idx, notify)
        while state == "PROC":
            if check_every_s:
                time.sleep(check_every_s)
            state = self.state(handle)
        self.release(handle)
        assert state == "DONE", state

    def close(self) -> None:
        self.agent.release_dlist(self.local)
        self.agent.release_dlist(self.remote)
        self.agent.remove_remote(self.remote_name)
        self.agent.deregister(self.memory)
