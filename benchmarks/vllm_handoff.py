"""What each transfer mode adds after prefill is done: prefill's answer -> decode's first token.

`vllm_push` compares TTFTs, of which prefill's own ~20 s of CPU compute (and its ±1 s from run
to run) is nearly all. This scenario times the hand-off alone, per request: the client sends the
legs itself (pull: prefill, then decode with prefill's transfer params; push: both at once, as
vLLM's push proxies do) and notes when prefill's answer came and when decode streamed its first
token. The larger model, ~2 k-token prompts (76 MB of KV), two hosts (network namespaces) at
200 Mbit/s each way, each server pinned to its core, UCX over TCP. Needs root.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from nixl_async.testing import TCP_TLS
from nixl_async_vllm.launch import PushTarget

from .common import Result
from .vllm import LARGE, _progress, _require_vllm, make_model, nth_run, paired_prompts, pd_servers
from .vllm_push import RATE_MBIT, ROLES, SETUPS, _placement

ORDER = ["pull", "push", "progressive", "progressive", "push", "pull"]
REQUESTS = 2  # per run, after a warm-up


async def _one(session: Any, prefill: Any, decode: Any, model: str, prompt: str, push: bool) -> tuple[float, float]:
    """(TTFT, hand-off) in seconds for one request driven leg by leg."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True}
    request_id = uuid.uuid4().hex
    headers = {"X-Request-Id": request_id}
    marks: dict[str, float] = {}
    started = time.perf_counter()

    async def prefill_leg() -> dict[str, Any]:
        first = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
        async with session.post(f"{prefill.url}/v1/completions", json=first, headers=headers) as reply:
            answer: dict[str, Any] = await reply.json(content_type=None)
            if reply.status != 200:
                raise RuntimeError(f"prefill answered {reply.status}: {answer}")
        marks["prefill"] = time.perf_counter()
        return answer

    async def decode_leg(params: dict[str, Any]) -> None:
        async with session.post(f"{decode.url}/v1/completions", json=dict(body, kv_transfer_params=params),
                                headers=headers) as reply:  # fmt: skip
            if reply.status != 200:
                raise RuntimeError(f"decode answered {reply.status}: {await reply.text()}")
            async for line in reply.content:
                if line.startswith(b"data: {"):
                    marks.setdefault("token", time.perf_counter())

    if push:
        target = PushTarget("bench-kv_producer", prefill.host, prefill.side_channel_port)
        await asyncio.gather(prefill_leg(), decode_leg(target.decode_params(request_id)))
    else:
        await decode_leg((await prefill_leg())["kv_transfer_params"])
    return marks["token"] - started, marks["token"] - marks["prefill"]


def _run_setup(setup: str, model: str, net: Any, work: Path, tag: str, prompts: list[str]) -> list[tuple[float, float]]:
    import aiohttp

    from nixl_async_vllm.launch import running

    connector, extra, push = SETUPS[setup]
    assert connector is not None
    prefill, decode = pd_servers(connector, LARGE, model, work, tag, extra=extra, env={"UCX_TLS": TCP_TLS},
                                 placement=_placement(dict(zip(ROLES, net.hosts, strict=True))), push=push)  # fmt: skip

    async def drive() -> list[tuple[float, float]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            return [await _one(session, prefill, decode, model, p, push) for p in prompts]

    with running(prefill, decode, timeout=600):
        return asyncio.run(drive())[1:]  # the first is the warm-up (handshake)


def run(quick: bool = False) -> Result:
    _require_vllm("vllm_handoff")
    from nixl_async.testing.netns import NetnsUnavailable, network

    work = Path(tempfile.mkdtemp(prefix="nixl-async-bench-handoff-"))
    model = str(make_model(LARGE, work))
    order = ORDER[:3] if quick else ORDER
    samples: dict[str, list[tuple[float, float]]] = {}
    try:
        with network(2, subnet="10.217.0") as net:
            for host in net.hosts:
                host.shape(RATE_MBIT)
            for index, setup in enumerate(order):
                _progress(index, len(order), setup)
                prompts = paired_prompts(nth_run(order, index), LARGE.prompt_words, REQUESTS + 1, (1,))[1]
                samples.setdefault(setup, []).extend(_run_setup(setup, model, net, work, f"run{index}-{setup}",
                                                                prompts))  # fmt: skip
            _progress(len(order), len(order), "done")
    except NetnsUnavailable as exc:
        raise SystemExit(f"the vllm_handoff scenario needs network namespaces (root): {exc}") from None
    metrics: dict[str, float] = {}
    rows: list[list[Any]] = []
    for setup, pairs in samples.items():
        ttft = statistics.median(t for t, _ in pairs) * 1e3
        handoff = [h * 1e3 for _, h in pairs]
        metrics[f"{setup}_ttft_p50_ms"] = ttft
        metrics[f"{setup}_handoff_p50_ms"] = statistics.median(handoff)
        rows.append([f"{setup} ({len(pairs)} requests)", metrics[f"{setup}_handoff_p50_ms"], min(handoff),
                     max(handoff), ttft])  # fmt: skip
    ratios = {
        "progressive_over_pull_handoff_p50_lower_is_better": metrics["progressive_handoff_p50_ms"]
        / metrics["pull_handoff_p50_ms"],
        "progressive_over_push_handoff_p50_lower_is_better": metrics["progressive_handoff_p50_ms"]
        / metrics["push_handoff_p50_ms"],
        "push_over_pull_handoff_p50_lower_is_better": metrics["push_handoff_p50_ms"] / metrics["pull_handoff_p50_ms"],
    }
    return Result(
        scenario="vllm_handoff",
        columns=["set-up", "hand-off p50 ms", "min ms", "max ms", "TTFT p50 ms"],
        rows=rows,
        metrics=metrics,
        ratios=ratios,
        notes=[
            "hand-off: prefill's answer to its leg -> decode's first streamed token, per request",
            f"model {LARGE.name}, ~2 k-token prompts; two hosts at {RATE_MBIT} Mbit/s each way, UCX_TLS=tcp, each"
            f" server pinned to its core; runs in the order {order}, {REQUESTS} requests each after a warm-up;"
            f" logs in {work}",
        ],
    )
