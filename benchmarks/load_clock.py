"""Decode's KV load time, measured the same way around either connector (`vllm_hosts`).

The classes here wrap `NixlAsyncConnector` and vLLM's NixlConnector (as `stock_nixl` patches it)
alike. A request's load runs from the worker step whose metadata hands it to the connector
(`start_load_kv`) to the step whose `get_transfer_results` reports it: what the connector adds to a
request's time to first token, without the client, the proxy and prefill around it (failed loads are
left out). vLLM 0.32 starts asynchronous loads after the step's forward, so the time starts at that
step's end, for either connector alike. Each load is appended to the file named by
``NIXL_ASYNC_BENCH_LOAD_LOG`` as ``<start ns> <duration ns>`` (``time.perf_counter_ns``, the
machine's monotonic clock, so `vllm.load_times` can split the lines by the benchmark's phases), one
line at a time so a killed server loses nothing.
"""

from __future__ import annotations

import os
import time
from typing import Any

from nixl_async_vllm.connector import NixlAsyncConnector

from .stock_nixl import NixlConnector
from .vllm import LOAD_LOG_ENV

__all__ = ["ClockedNixlAsyncConnector", "ClockedNixlConnector"]


class _LoadClock:
    """Mixed in before a connector class: stamps its loads (worker role only)."""

    _handed: dict[str, int]

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        now = time.perf_counter_ns()
        metadata = getattr(self, "_connector_metadata", None)  # bound by vLLM before each step
        handed = self.__dict__.setdefault("_handed", {})
        for request_id, req in (getattr(metadata, "reqs_to_recv", None) or {}).items():
            if getattr(req, "awaiting_kvs", True):  # else only a notification goes out: no load is reported
                handed.setdefault(request_id, now)
        super().start_load_kv(*args, **kwargs)  # type: ignore[misc]

    def get_transfer_results(self, *args: Any, **kwargs: Any) -> Any:
        results = super().get_transfer_results(*args, **kwargs)  # type: ignore[misc]
        now = time.perf_counter_ns()
        handed = self.__dict__.get("_handed", {})
        failed = results.failed_recving  # reported in finished_recving too: not a load
        lines = [f"{start} {now - start}\n" for request_id in results.finished_recving
                 if (start := handed.pop(request_id, None)) is not None and request_id not in failed]  # fmt: skip
        path = os.environ.get(LOAD_LOG_ENV)
        if lines and path:
            with open(path, "a") as log:
                log.write("".join(lines))
        return results


class ClockedNixlAsyncConnector(_LoadClock, NixlAsyncConnector):
    pass


class ClockedNixlConnector(_LoadClock, NixlConnector):
    pass
