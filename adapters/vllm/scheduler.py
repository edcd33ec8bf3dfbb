"""Scheduler side: vLLM's own pull scheduler, with two changes.

vLLM's `NixlPullConnectorScheduler` already implements the request semantics users rely on
(``do_remote_prefill``/``do_remote_decode``, prefix-cache hits, prompts shorter than a block,
leases on blocks held for a reader), so it is reused as is. What differs:

- no side channel here: each worker's transfer engine answers handshakes itself, at
  ``base port + tp_rank``, so `set_xfer_handshake_metadata` does nothing;
- heartbeats are packed every ``lease / 6`` seconds as vLLM does (the worker sends them as
  acknowledged calls, see `leases`);
- the producer tells the reader when its blocks expire (``remote_blocks_expiry_time``, wall
  clock), and the reader refuses a read that would land after it instead of reading blocks
  that may already belong to another request.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler

from .settings import AdapterSettings

__all__ = ["AdapterPushScheduler", "AdapterScheduler"]

log = logging.getLogger(f"vllm.{__name__}")  # under "vllm", so it shows in vLLM's log


def _adapt(scheduler: Any, vllm_config: Any) -> AdapterSettings:
    """Our settings on vLLM's scheduler: side channel address, lease, heartbeat cadence."""
    settings = AdapterSettings.from_vllm(vllm_config)
    scheduler.side_channel_host = settings.side_channel_host
    scheduler.side_channel_port = settings.side_channel_port
    scheduler._kv_lease_duration = settings.lease_s
    # vLLM's integer division makes leases under 6 s heartbeat every step; keep lease / 6.
    scheduler._heartbeat_interval = settings.lease_s / 6
    return settings


class _WorkersServeHandshakes:
    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        """Workers serve their own handshakes; nothing to publish from the scheduler."""


class AdapterScheduler(_WorkersServeHandshakes, NixlPullConnectorScheduler):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.settings = _adapt(self, vllm_config)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        deadline = self._reqs_need_send.get(request.request_id)
        if delay and params is not None and deadline is not None and params.get("do_remote_prefill"):
            params["remote_blocks_expiry_time"] = time.time() + (deadline - time.perf_counter())
        return delay, params


class AdapterPushScheduler(_WorkersServeHandshakes, NixlPushConnectorScheduler):
    """vLLM's push scheduler as is: decode stages registrations, prefill hands over finished blocks."""

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self.settings = _adapt(self, vllm_config)
        self._push_registration_timeout = self.settings.push_registration_timeout_s
