"""nixl_async_vllm: vLLM integration of nixl_async (translation only; the engine does the work).

`tp_mapping` (pure) decides which remote ranks and byte windows a worker reads for
heterogeneous tensor parallelism and MLA.
"""
