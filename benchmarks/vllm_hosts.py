"""P/D on real vLLM across two hosts: the adapter against vLLM's NixlConnector, side by side.

Prefill and decode each run in their own network namespace (`nixl_async.testing.netns`: two
hosts on a bridge), UCX over TCP only, what leaves each host limited to 1 Gbit/s (`tc tbf`;
this kernel has no sch_netem, so no delay is added); the proxy and the client run in the root namespace.
Runs alternate between the set-ups (adapter, NixlConnector, adapter with Python's 5 ms switch
interval, then the reverse order),
each with fresh servers, a warm-up request, then unique prompts at concurrency 1 and 4.
Reported per connector: the median over its runs, with the spread (min-max) in the notes.

Needs root (network namespaces) and real vLLM; minutes.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nixl_async_vllm.launch import make_prompt

from .common import Result, percentiles
from .vllm import REPO, TINY, ModelSpec, _load, _progress

RATE_MBIT = 1000
# set-up -> (connector, kv_connector_extra_config); the third keeps Python's 5 ms switch interval
# in the adapter's processes, to see whether lowering it to 0.5 ms (the adapter's default) pays.
SETUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "nixl_async": ("nixl_async", {}),
    "vllm": ("vllm", {}),
    "nixl_async_switch_5ms": ("nixl_async", {"switch_interval_s": 0.005}),
}


def _run_once(setup: str, spec: ModelSpec, model: str, net: Any, prompts: dict[int, list[str]], logs: Path,
              tag: str) -> dict[str, float]:  # fmt: skip
    from nixl_async_vllm.launch import ProxyProcess, VllmServer, kv_transfer_config, running

    p_host, d_host = net.hosts
    connector, extra = SETUPS[setup]
    common = {"max_model_len": spec.max_model_len, "kv_cache_bytes": spec.kv_cache_bytes}
    servers = [
        VllmServer(model, 18910, 15950, kv_transfer_config(connector, role, extra), cpu=cpu,
                   log_path=logs / f"{tag}-{name}.log", extra_env={"UCX_TLS": "tcp"}, host=host.address,
                   net_device=host.device, command_prefix=host.prefix, **common)
        for name, role, host, cpu in (("prefill", "kv_producer", p_host, 0), ("decode", "kv_consumer", d_host, 1))
    ]  # fmt: skip
    proxy = ProxyProcess(18940, servers[0].url, servers[1].url)
    out: dict[str, float] = {}
    with running(*servers, timeout=600):
        try:
            proxy.start()
            asyncio.run(_load(proxy.url, model, [make_prompt(f"warm-up {tag}", spec.prompt_words)], 1))
            for concurrency, batch in prompts.items():
                started = time.perf_counter()
                ttfts, latencies = asyncio.run(_load(proxy.url, model, batch, concurrency))
                wall = time.perf_counter() - started
                t50, t99 = percentiles([t * 1e3 for t in ttfts], 50, 99)
                (l50,) = percentiles([t * 1e3 for t in latencies], 50)
                key = f"c{concurrency}"
                out.update({f"{key}_ttft_p50_ms": t50, f"{key}_ttft_p99_ms": t99, f"{key}_latency_p50_ms": l50,
                            f"{key}_req_per_s": len(batch) / wall})  # fmt: skip
        finally:
            proxy.stop()
    return out


def run(quick: bool = False) -> Result:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit("the vllm_hosts scenario needs real vLLM: bash scripts/setup-vllm.sh") from None
    from nixl_async.testing.netns import NetnsUnavailable, network

    order = ["nixl_async", "vllm", "nixl_async_switch_5ms"]
    order += order[::-1] + ([] if quick else order)
    n = 32 if quick else 100
    spec = TINY
    work = Path(tempfile.mkdtemp(prefix="nixl-async-bench-hosts-"))
    model = work / spec.name
    subprocess.run([sys.executable, str(REPO / "examples" / "vllm_pd" / "make_tiny_model.py"), str(model),
                    *spec.args], check=True, capture_output=True)  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {setup: [] for setup in SETUPS}
    try:
        with network(2, subnet="10.214.0") as net:
            for host in net.hosts:
                host.shape(RATE_MBIT)
            for index, setup in enumerate(order):
                _progress(index, len(order), f"run {index + 1}: {setup}")
                prompts = {c: [make_prompt(f"{setup} r{index} c{c} #{i}", spec.prompt_words) for i in range(n)]
                           for c in (1, 4)}  # fmt: skip
                runs[setup].append(_run_once(setup, spec, str(model), net, prompts, work, f"run{index}-{setup}"))
            _progress(len(order), len(order), "done")
    except NetnsUnavailable as exc:
        raise SystemExit(f"the vllm_hosts scenario needs network namespaces (root): {exc}") from None

    metrics: dict[str, float] = {}
    spread: list[str] = []
    rows: list[list[Any]] = []
    for setup, measured in runs.items():
        for key in measured[0]:
            values = [m[key] for m in measured]
            metrics[f"{setup}_{key}"] = statistics.median(values)
            spread.append(f"{setup} {key}: {min(values):.1f} to {max(values):.1f} over {len(values)} runs")
        rows.append([setup, *(metrics[f"{setup}_{k}"] for k in ("c1_ttft_p50_ms", "c1_latency_p50_ms",
                                                                 "c4_ttft_p50_ms", "c4_req_per_s"))])  # fmt: skip

    def ratio(key: str, ours: str = "nixl_async") -> float:
        return metrics[f"{ours}_{key}"] / metrics[f"vllm_{key}"]

    ratios = {
        "adapter_over_stock_latency_p50_c1_lower_is_better": ratio("c1_latency_p50_ms"),
        "adapter_over_stock_ttft_p50_c1_lower_is_better": ratio("c1_ttft_p50_ms"),
        "adapter_over_stock_ttft_p50_c4_lower_is_better": ratio("c4_ttft_p50_ms"),
        "adapter_over_stock_req_per_s_c4_higher_is_better": ratio("c4_req_per_s"),
        "adapter_5ms_switch_over_stock_latency_p50_c1_lower_is_better": ratio(
            "c1_latency_p50_ms", "nixl_async_switch_5ms"
        ),
        "adapter_5ms_switch_over_stock_req_per_s_c4_higher_is_better": ratio("c4_req_per_s", "nixl_async_switch_5ms"),
    }
    return Result(
        scenario="vllm_hosts",
        columns=["connector (median of runs)", "c1 TTFT p50 ms", "c1 latency p50 ms", "c4 TTFT p50 ms", "c4 req/s"],
        rows=rows,
        metrics=metrics,
        ratios=ratios,
        notes=[
            f"P and D in network namespaces, UCX_TLS=tcp, {RATE_MBIT} Mbit/s each way (tc tbf; no sch_netem here, "
            f"so no added delay); {n} unique prompts of ~{spec.prompt_words} words per concurrency and run",
            f"runs in the order {order}; logs in {work}",
            "vllm = vLLM's NixlConnector with its progress thread patched off (benchmarks/stock_nixl.py)",
            *spread,
        ],
    )
