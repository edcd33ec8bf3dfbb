"""P/D on real vLLM across two hosts: the adapter against vLLM's NixlConnector, side by side.

Prefill and decode each run in their own network namespace (`nixl_async.testing.netns`: two
hosts on a bridge), UCX over TCP only, what leaves each host limited to 1 Gbit/s (`tc tbf`;
this kernel has no sch_netem, so no delay is added), each server's every thread on its host's core
(`taskset`, as on two machines: unpinned on this 2-core box, the vLLM processes that spin while they
wait took turns on either core, and decode's steps changed speed from run to run by up to 30 %);
the proxy and the client run in the root namespace, on either core. Decode's KV load time (the
step handing a request to the connector -> the step reporting it loaded) is logged by the same
wrapper around either connector (`load_clock`).
Runs alternate between the set-ups (adapter, NixlConnector, NixlConnector, adapter...: 4 runs each,
2 with ``--quick``), each with fresh servers, a warm-up request, then unique prompts at concurrency 1 and 4.
Reported per connector: the median over its runs, with the spread (min-max) in the notes.

Needs root (network namespaces) and real vLLM; minutes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from nixl_async.testing import TCP_TLS

from .common import Result
from .vllm import (
    LOAD_LOG_ENV,
    TINY,
    ModelSpec,
    _progress,
    load_times,
    make_model,
    measure,
    medians,
    nth_run,
    paired_prompts,
    summarize,
    summarize_loads,
)
from .vllm_push import ROLES, _placement

RATE_MBIT = 1000
# set-up -> (connector, kv_connector_extra_config). Until session 16 a third set-up lowered the
# adapter's switch interval to 0.5 ms; four sets of runs showed it does not pay (README, scenario 9).
SETUPS: dict[str, tuple[str, dict[str, Any]]] = {
    "nixl_async": ("nixl_async", {}),
    "vllm": ("vllm", {}),
}


# figure -> column, for the table (medians over each set-up's runs)
COLUMNS = {
    "c1_ttft_p50_ms": "c1 TTFT p50 ms",
    "c1_latency_p50_ms": "c1 latency p50 ms",
    "c1_itl_p50_ms": "c1 ITL p50 ms",
    "c1_load_p50_ms": "c1 KV load p50 ms",
    "c1_load_p90_ms": "c1 KV load p90 ms",
    "c4_ttft_p50_ms": "c4 TTFT p50 ms",
    "c4_itl_p50_ms": "c4 ITL p50 ms",
    "c4_load_p50_ms": "c4 KV load p50 ms",
    "c4_req_per_s": "c4 req/s",
}


def _run_once(setup: str, spec: ModelSpec, model: str, net: Any, prompts: dict[int, list[str]], logs: Path,
              tag: str) -> dict[str, float]:  # fmt: skip
    connector, extra = SETUPS[setup]
    load_log = logs / f"{tag}-loads.txt"
    loads = measure(f"{connector}_clocked", spec, model, prompts, logs, tag, extra=extra,
                    env={"UCX_TLS": TCP_TLS, LOAD_LOG_ENV: str(load_log)},
                    placement=_placement(dict(zip(ROLES, net.hosts, strict=True))))  # fmt: skip
    figures = summarize(loads)
    for concurrency, load in loads.items():
        kv_loads = load_times(load_log, load.started, load.started + load.wall)
        if not kv_loads:
            raise RuntimeError(f"{tag}: decode logged no KV loads at concurrency {concurrency} ({load_log})")
        figures.update(summarize_loads(kv_loads, f"c{concurrency}"))
    return figures


def run(quick: bool = False) -> Result:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit("the vllm_hosts scenario needs real vLLM: bash scripts/setup-vllm.sh") from None
    from nixl_async.testing.netns import NetnsUnavailable, network

    order = ["nixl_async", "vllm", "vllm", "nixl_async"] * (1 if quick else 2)
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
                prompts = paired_prompts(nth_run(order, index), spec.prompt_words, n)
                runs[setup].append(_run_once(setup, spec, str(model), net, prompts, work, f"run{index}-{setup}"))
            _progress(len(order), len(order), "done")
    except NetnsUnavailable as exc:
        raise SystemExit(f"the vllm_hosts scenario needs network namespaces (root): {exc}") from None

    # What the goals need to judge the figures (`goals._HOSTS_RUNS`).
    metrics: dict[str, float] = {"runs_per_setup": order.count("nixl_async"), "requests_per_point": n}
    spread: list[str] = []
    rows: list[list[Any]] = []
    for setup, measured in runs.items():
        found, notes = medians(measured, setup)
        metrics.update(found)
        spread += notes
        rows.append([setup, *(metrics[f"{setup}_{k}"] for k in COLUMNS)])

    def ratio(key: str, ours: str = "nixl_async") -> float:
        return metrics[f"{ours}_{key}"] / metrics[f"vllm_{key}"]

    ratios = {
        "adapter_over_stock_latency_p50_c1_lower_is_better": ratio("c1_latency_p50_ms"),
        "adapter_over_stock_ttft_p50_c1_lower_is_better": ratio("c1_ttft_p50_ms"),
        "adapter_over_stock_itl_p50_c1_lower_is_better": ratio("c1_itl_p50_ms"),
        "adapter_over_stock_load_p50_c1_lower_is_better": ratio("c1_load_p50_ms"),
        "adapter_over_stock_load_mean_c1_lower_is_better": ratio("c1_load_mean_ms"),
        "adapter_over_stock_ttft_p50_c4_lower_is_better": ratio("c4_ttft_p50_ms"),
        "adapter_over_stock_req_per_s_c4_higher_is_better": ratio("c4_req_per_s"),
        "adapter_over_stock_itl_p50_c4_lower_is_better": ratio("c4_itl_p50_ms"),
        "adapter_over_stock_load_p50_c4_lower_is_better": ratio("c4_load_p50_ms"),
    }
    return Result(
        scenario="vllm_hosts",
        columns=["connector (median of runs)", *(COLUMNS.values())],
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
