"""vLLM's own NixlConnector and NixlPushConnector, patched as a vLLM user on a CPU-only machine must.

Used as ``kv_connector_module_path`` (with ``"kv_connector": "NixlConnector"`` or
``"NixlPushConnector"``) for the side-by-side benchmarks. Two patches, both applied at import,
in each vLLM process, before any agent exists:

- NIXL's progress thread off: with it on, every agent spins a core (two idle instances fill
  both cores of this machine) and vLLM offers no switch for it;
- AMX tile permission requested before UCX starts threads (else SIGILL in bf16 attention).

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

__all__ = ["NixlConnector", "NixlPushConnector"]
