"""Benchmark scenarios for `nixl-async bench` (installed as `nixl_async_benchmarks`).

Each scenario module has ``run(quick: bool) -> Result`` and measures the engine side by side
with what a user would otherwise write, in the same run, on the same machine.
"""
