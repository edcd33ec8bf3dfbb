"""vLLM's own NixlConnector and NixlPushConnector, patched as a vLLM user on a CPU-only machine must.

Used as ``kv_connector_module_path`` (with ``"kv_connector": "NixlConnector"`` or
``"NixlPushConnector"``) for the side-by-side benchmarks. Three patches, all applied at import,
in each vLLM process, before any agent exists:

- NIXL's progress thread off: with it on, every agent spins a core (two idle instances fill
  both cores of this machine) and vLLM offers no switch for it;
- AMX tile permission requested before UCX starts threads (else SIGILL in bf16 attention);
- the worker keeps the cores the launcher bound it to. On CPU the connector moves the thread
  that builds it -- vLLM's model thread -- onto the last core of each NUMA node (vLLM reserves
  that core for KV transfers). With both servers on one 2-core host that put the producer's
  model thread on the decode server's core, so the two connectors ran with different
  placements, which made most of the c1 inter-token gap between them (README, scenario 7).
  Both now run where the benchmark puts them.

Nothing else about the connector changes.
"""

from __future__ import annotations

from typing import Any

from nixl_async_vllm import cpu_quirks

cpu_quirks.prepare_process()

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (  # noqa: E402
    NixlConnector,
    NixlPushConnector,
)

_original_config = base_worker.nixl_agent_config


def _config_without_progress_thread(*args: Any, **kwargs: Any) -> Any:
    kwargs["enable_prog_thread"] = False
    return _original_config(*args, **kwargs)


base_worker.nixl_agent_config = _config_without_progress_thread


def _no_reserved_kv_cores() -> list[list[int]]:
    return []  # the connector then leaves its thread's CPU affinity alone


# (vLLM's CPU platform has this method; the Platform type it is declared as does not)
base_worker.current_platform.discover_numa_topology = _no_reserved_kv_cores  # type: ignore[attr-defined]

__all__ = ["NixlConnector", "NixlPushConnector"]
