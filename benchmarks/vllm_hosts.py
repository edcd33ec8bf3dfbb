"""P/D on real vLLM across two hosts: the adapter against vLLM's NixlConnector, side by side.

Prefill and decode each run in their own network namespace (`nixl_async.testing.netns`: two
hosts on a bridge), UCX over TCP only, what leaves each host limited to 1 Gbit/s (`tc tbf`;
this kernel has no sch_netem, so no delay is added); the proxy and the client run in the root namespace.
Runs alternate between the set-ups (adapter, NixlConnector, adapter with its switch interval
lowered to 0.5 ms, then the reverse order),
each with fresh servers, a warm-up request, then unique prompts at concurrency 1 and 4.
Reported per connector: the median over its runs, with the spread (min-max) in the notes.

Needs root (network namespaces) and real vLLM; minutes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from nixl_async_vllm.launch import make_prompt

from .common import Result
from .vllm import TINY, ModelSpec, _progress, make_model, measure, medians, summarize

RATE_MBIT = 1000
# set-up -> (connector, kv_connector_extra_config); the third lowers the adapter's processes' switch
# interval to 0.5 ms (its default until session 15; now a setting), to see whether that pays.
SETUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "nixl_async": ("nixl_async", {}),
    "vllm": ("vllm", {}),
    "nixl_async_switch_500us": ("nixl_async", {"switch_interval_s": 0.0005}),
}


def _run_once(setup: str, spec: ModelSpec, model: str, net: Any, prompts: dict[int, list[str]], logs: Path,
              tag: str) -> dict[str, float]:  # fmt: skip
    connector, extra = SETUPS[setup]
    hosts = dict(zip(("kv_producer", "kv_consumer"), net.hosts, strict=True))

    def placement(role: str) -> dict[str, Any]:
        host = hosts[role]
        return {"host": host.address, "net_device": host.device, "command_prefix": host.prefix}

    loads = measure(connector, spec, model, prompts, logs, tag, extra=extra, env={"UCX_TLS": "tcp"},
                    placement=placement)  # fmt: skip
    return summarize(loads)


def run(quick: bool = False) -> Result:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit("the vllm_hosts scenario needs real vLLM: bash scripts/setup-vllm.sh") from None
    from nixl_async.testing.netns import NetnsUnavailable, network

    order = ["nixl_async", "vllm", "nixl_async_switch_500us"]
    order += order[::-1] + ([] if quick else order)
    n = 32 if quick else 100
    spec = TINY
    work = Path(tempfile.mkdtemp(prefix="nixl-async-bench-hosts-"))
    model = make_model(spec, work)
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
        found, notes = medians(measured, setup)
        metrics.update(found)
        spread += notes
        rows.append([setup, *(metrics[f"{setup}_{k}"] for k in ("c1_ttft_p50_ms", "c1_latency_p50_ms",
                                                                 "c4_ttft_p50_ms", "c4_itl_p50_ms",
                                                                 "c4_req_per_s"))])  # fmt: skip

    def ratio(key: str, ours: str = "nixl_async") -> float:
        return metrics[f"{ours}_{key}"] / metrics[f"vllm_{key}"]

    ratios = {
        "adapter_over_stock_latency_p50_c1_lower_is_better": ratio("c1_latency_p50_ms"),
        "adapter_over_stock_ttft_p50_c1_lower_is_better": ratio("c1_ttft_p50_ms"),
        "adapter_over_stock_ttft_p50_c4_lower_is_better": ratio("c4_ttft_p50_ms"),
        "adapter_over_stock_req_per_s_c4_higher_is_better": ratio("c4_req_per_s"),
        "adapter_over_stock_itl_p50_c4_lower_is_better": ratio("c4_itl_p50_ms"),
        "adapter_500us_switch_over_stock_latency_p50_c1_lower_is_better": ratio(
            "c1_latency_p50_ms", "nixl_async_switch_500us"
        ),
        "adapter_500us_switch_over_stock_req_per_s_c4_higher_is_better": ratio(
            "c4_req_per_s", "nixl_async_switch_500us"
        ),
    }
    return Result(
        scenario="vllm_hosts",
        columns=[
            "connector (median of runs)",
            "c1 TTFT p50 ms",
            "c1 latency p50 ms",
            "c4 TTFT p50 ms",
            "c4 ITL p50 ms",
            "c4 req/s",
        ],
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
