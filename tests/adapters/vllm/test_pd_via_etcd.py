"""P/D in real vLLM where decode finds prefill by engine id in etcd (``etcd_endpoint``): the
``kv_transfer_params`` decode gets carry no ``remote_host`` / ``remote_port``, only engine ids.

One cluster (prefill, decode, a single reference instance) and one etcd for the module.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")


from nixl_async.testing.etcd import etcd_or_skip
from nixl_async_vllm.launch import VllmServer, kv_transfer_config, make_prompt, running

from .pd_client import complete, counter, make_models

pytestmark = pytest.mark.vllm

NAMESPACE = "pd-etcd-test"
PROMPTS = [make_prompt(f"etcd request {i}", n) for i, n in enumerate([6, 90, 210])]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("pd-etcd")
    make_models(root)
    model = str(root / "model")
    with etcd_or_skip() as etcd:
        extra = {"transfer_timeout": 20, "etcd_endpoint": etcd.endpoint, "etcd_namespace": NAMESPACE,
                 "etcd_lease_ttl": 3}  # fmt: skip
        servers = {
            "prefill": VllmServer(model, 19100, 16400, kv_transfer_config("nixl_async", "kv_producer", extra), cpu=0,
                                  log_path=root / "prefill.log"),
            "decode": VllmServer(model, 19200, 16500, kv_transfer_config("nixl_async", "kv_consumer", extra), cpu=1,
                                 log_path=root / "decode.log"),
            "single": VllmServer(model, 19300, 16600, None, cpu=0, log_path=root / "single.log"),
        }  # fmt: skip
        with running(*servers.values()):
            yield model, servers, etcd


async def _published(etcd) -> list[str]:
    prefix = f"{NAMESPACE}/engines/"
    return [key.decode().removeprefix(prefix) for key in etcd.keys(prefix.encode())]


async def _pd_by_engine_id(servers, prompt: str, model: str) -> dict:
    """The proxy's two legs, with prefill's address removed from what decode gets."""
    first = await complete(servers["prefill"].url, prompt, model, max_tokens=1,
                           kv_transfer_params={"do_remote_decode": True})  # fmt: skip
    params = dict(first["kv_transfer_params"], remote_host=None, remote_port=None)
    return await complete(servers["decode"].url, prompt, model, kv_transfer_params=params)


async def test_decode_finds_prefill_by_engine_id_and_tokens_equal_a_single_instance(cluster):
    model, servers, etcd = cluster
    for prompt in PROMPTS:
        want = await complete(servers["single"].url, prompt, model)
        got = await _pd_by_engine_id(servers, prompt, model)
        assert got["choices"][0]["text"] == want["choices"][0]["text"], prompt
    assert counter(servers["decode"], "vllm:nixl_bytes_transferred_sum") > 0, "decode read the KV (no recompute)"
    assert counter(servers["decode"], "vllm:nixl_num_failed_transfers_total") == 0
    published = await _published(etcd)
    assert len(published) == 2 and all(name.endswith("/tp0") for name in published), published


async def test_a_stopped_prefill_leaves_etcd(cluster):
    _model, servers, etcd = cluster
    before = await _published(etcd)
    servers["prefill"].stop()
    started = time.monotonic()
    while len(await _published(etcd)) == len(before):
        assert time.monotonic() - started < 3 + 5, "prefill's record outlived its server by more than its lease"
        await asyncio.sleep(0.2)
    assert len(await _published(etcd)) == 1
