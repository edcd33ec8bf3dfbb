"""`NixlAsyncConnector`: a drop-in for vLLM's NixlConnector (pull mode), on nixl_async.

Enable it by changing only the connector name and module in ``--kv-transfer-config``::

    {"kv_connector": "NixlAsyncConnector",
     "kv_connector_module_path": "nixl_async_vllm.connector",
     "kv_role": "kv_producer" | "kv_consumer", ...}

The proxy, ``kv_transfer_params`` and every other setting stay as with NixlConnector. This
class only routes vLLM's calls: scheduler-role calls to `AdapterScheduler` (vLLM's own pull
scheduler), worker-role calls to `ConnectorWorker` (our engine, through its sync facade).
Both are imported lazily: this module is imported in every vLLM process, including the API
server, which needs nothing but `build_kv_connector_stats`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

if TYPE_CHECKING:
    from .push_worker import PushConnectorWorker
    from .scheduler import AdapterScheduler
    from .worker import ConnectorWorker

__all__ = ["NixlAsyncConnector", "NixlAsyncPushConnector"]


class NixlAsyncConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.P2P  # hits served by a peer, as vLLM's NixlConnector reports them

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer is None or transfer.engine_id is None:
            raise ValueError("NixlAsyncConnector needs kv_transfer_config with an engine_id")
        self.scheduler: AdapterScheduler | None = None
        self.worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = self._scheduler_class()(vllm_config, transfer.engine_id, kv_cache_config)
        else:
            self.worker = self._worker_class()(vllm_config, transfer.engine_id, kv_cache_config)

    @staticmethod
    def _scheduler_class() -> type[AdapterScheduler]:
        from .scheduler import AdapterScheduler

        return AdapterScheduler

    @staticmethod
    def _worker_class() -> type[ConnectorWorker]:
        from .worker import ConnectorWorker

        return ConnectorWorker

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """Head-major blocks (LBHNC): a TP rank's heads are one window of each block."""
        model = vllm_config.model_config
        return None if model is None or model.use_mla else "LBHNC"

    # -- scheduler role ------------------------------------------------------------------------
    def _sched(self) -> AdapterScheduler:
        if self.scheduler is None:
            raise RuntimeError("scheduler-side call on a worker-role connector")
        return self.scheduler

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def on_new_request(self, request: Any) -> None:
        self._sched().on_new_request(request)

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """With vLLM's hybrid allocator: a request's blocks in every KV cache group, held as one."""
        return self._sched().request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        return tuple(self._kv_cache_config.transfer_group_ids)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: Any) -> None:
        """Workers answer handshakes themselves; the scheduler publishes nothing."""

    # -- worker role ---------------------------------------------------------------------------
    def _work(self) -> ConnectorWorker:
        if self.worker is None:
            raise RuntimeError("worker-side call on a scheduler-role connector")
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self._work().set_host_xfer_buffer_ops(copy_operation)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().start_load_kv(self._connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Whole requests are loaded before they are scheduled; nothing per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """The reader pulls; nothing is pushed per layer."""

    def wait_for_save(self) -> None:
        self._work().wait_for_save(self._connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._work().get_transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> Any:
        return None if self.worker is None else self.worker.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats

        return NixlKVConnectorStats(data=data) if data is not None else NixlKVConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> Any:
        """NixlConnector's Prometheus series (``vllm:nixl_*``), so dashboards built for it keep working."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlPromMetrics

        return NixlPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()


class NixlAsyncPushConnector(NixlAsyncConnector):
    """A drop-in for vLLM's NixlPushConnector: decode registers its blocks, prefill WRITEs the KV.

    Same ``kv_transfer_config`` and proxy flow as NixlPushConnector (both legs sent together,
    decode's ``kv_transfer_params`` naming prefill's engine and request); only the connector name
    and module change. See `push_worker`.
    """

    @staticmethod
    def _scheduler_class() -> type[AdapterScheduler]:
        from .scheduler import AdapterPushScheduler

        return AdapterPushScheduler  # type: ignore[return-value]

    @staticmethod
    def _worker_class() -> type[ConnectorWorker]:
        from .push_worker import PushConnectorWorker

        return PushConnectorWorker

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """With ``push_progressive``: the layer is computed for this step; its finished blocks may go now."""
        self._push_worker().save_kv_layer(layer_name, self._connector_metadata)

    def _push_worker(self) -> PushConnectorWorker:
        return self._work()  # type: ignore[return-value]

    def has_pending_push_work(self) -> bool:
        """Keep vLLM's engine stepping while pushes are pending (its scheduler knows which)."""
        return self.scheduler is not None and self.scheduler.has_pending_push_work()  # type: ignore[attr-defined]
