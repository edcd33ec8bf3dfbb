"""Models and HTTP calls the vLLM end-to-end tests make to servers and proxies (completions, prefill legs, metrics)."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from nixl_async_vllm.launch import VllmServer

MAX_TOKENS = 12
REPO = Path(__file__).resolve().parents[3]


def make_models(root: Path) -> None:
    """Two tiny models with the same tokenizer and different weights; `model` points at A."""
    for name, seed in (("model-a", "0"), ("model-b", "1")):
        script = REPO / "examples" / "vllm_pd" / "make_tiny_model.py"
        subprocess.run([sys.executable, str(script), str(root / name), "--seed", seed], check=True,
                       capture_output=True)  # fmt: skip
    (root / "model").symlink_to(root / "model-a")


async def post(
    url: str, body: dict[str, Any], timeout: float = 120, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    """POST a completion; (status, decoded reply)."""
    timeout_cfg = aiohttp.ClientTimeout(total=timeout)
    async with (
        aiohttp.ClientSession(timeout=timeout_cfg) as session,
        session.post(f"{url}/v1/completions", json=body, headers=headers) as reply,
    ):
        return reply.status, await reply.json(content_type=None)


async def complete(url: str, prompt: str, model: str, timeout: float = 120, **fields: Any) -> dict[str, Any]:
    """A greedy completion of MAX_TOKENS tokens (unless `fields` say otherwise) that must succeed."""
    status, reply = await post(url, {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                     **fields}, timeout)  # fmt: skip
    assert status == 200, reply
    return reply


async def text(url: str, prompt: str, model: str) -> str:
    return str((await complete(url, prompt, model))["choices"][0]["text"])


async def prefill_only(server: VllmServer, prompt: str, model: str) -> dict[str, Any]:
    """What the proxy's first leg does: prefill computes and holds the KV; its transfer params."""
    reply = await complete(server.url, prompt, model, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params: dict[str, Any] = reply["kv_transfer_params"]
    assert params["remote_block_ids"], params
    return params


async def keep_busy(server: VllmServer, model: str, seconds: float, seqs: int) -> list[asyncio.Task[Any]]:
    """Queue long requests on `server` (running `seqs` at a time) so that a request sent next waits at least `seconds`.

    One wave is timed, and half as many again are queued as it says: later waves ran faster than
    the timed one (a CI run: 8.7 s for 12 asked), and the callers rely on the lower bound.
    """
    body = {"model": model, "prompt": "busy", "max_tokens": 480, "temperature": 0, "ignore_eos": True}
    started = time.monotonic()
    await asyncio.gather(*(post(server.url, body) for _ in range(seqs)))  # one wave, timed
    waves = math.ceil(1.5 * seconds / (time.monotonic() - started)) + 1
    tasks = [asyncio.create_task(post(server.url, body, timeout=600)) for _ in range(waves * seqs)]
    await asyncio.sleep(0.5)  # queued before whatever comes next
    return tasks


def restart_with_weights(server: VllmServer, root: Path, model: str) -> None:
    """Restart `server` with `root/model` pointing at `model` ("model-a" or "model-b")."""
    server.kill()
    (root / "model").unlink()
    (root / "model").symlink_to(root / model)
    server.start()
    server.wait_ready(300)


def counter(server: VllmServer, name: str) -> float:
    value = server.metric(name)
    assert value is not None, f"{name} missing from {server.url}/metrics"
    return value
