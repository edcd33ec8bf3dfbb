"""The adapter in real vLLM across hosts: prefill and decode in their own network namespaces
(two hosts on a bridge), UCX over TCP only, the proxy and a single reference instance in the
root namespace, as a user would run them on three machines.

Tests run in file order on one cluster: outputs and the wire -> the side channel's address ->
a link cut while a read is in flight (decode recomputes, keeps serving, and reads again once
the link is back, with neither server restarted).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import time

import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")

from nixl_async.testing import TCP_TLS
from nixl_async.testing.netns import Host, network_or_skip
from nixl_async_vllm.launch import ProxyProcess, VllmServer, kv_transfer_config, make_prompt, running

from .pd_client import complete, counter, make_models, post, prefill_only

pytestmark = pytest.mark.vllm

SECRET = "hosts-test-secret-0123456789"
HTTP = {"prefill": 18500, "decode": 18600}
SIDE = {"prefill": 15900, "decode": 16000}
LINK_TIMEOUT_S, TRANSFER_TIMEOUT_S = 4, 12
PROMPTS = [make_prompt(f"across hosts {i}", n) for i, n in enumerate([4, 60, 150, 260])]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("hosts")
    make_models(root)
    model = str(root / "model")
    extra = {"transfer_timeout": TRANSFER_TIMEOUT_S, "link_timeout": LINK_TIMEOUT_S, "auth_secret_env": "PD_SECRET"}
    with network_or_skip(2, subnet="10.212.0") as net:
        p_host, d_host = net.hosts

        def server(role: str, host: Host, cpu: int, kv_role: str, policy: str | None = None) -> VllmServer:
            config = kv_transfer_config("nixl_async", kv_role, extra, failure_policy=policy)
            env = {"PD_SECRET": SECRET, "UCX_TLS": TCP_TLS}  # no shared memory or CMA between hosts
            return VllmServer(model, HTTP[role], SIDE[role], config, cpu=cpu, log_path=root / f"{role}.log",
                              extra_env=env, host=host.address, net_device=host.device,
                              command_prefix=host.prefix)  # fmt: skip

        servers = {
            "prefill": server("prefill", p_host, 0, "kv_producer"),
            "decode": server("decode", d_host, 1, "kv_consumer", policy="recompute"),
            "single": VllmServer(model, 18700, 16100, None, cpu=0, log_path=root / "single.log"),
        }
        proxy = ProxyProcess(18800, servers["prefill"].url, servers["decode"].url)
        with running(*servers.values()):
            proxy.start()
            try:
                yield root, servers, proxy, p_host, d_host
            finally:
                p_host.unshape()
                p_host.set_link(True)
                proxy.stop()


def _model(root) -> str:
    return str(root / "model")


def _tcp_bytes_from(host: Host, peer: str, skip_ports: set[int]) -> int:
    """Bytes `host` received on TCP connections with `peer`, but for those on `skip_ports`."""
    total = 0
    lines = host.tcp_sockets().splitlines()
    for head, info in itertools.pairwise(lines):
        fields = head.split()
        if len(fields) < 5 or fields[0] != "ESTAB":
            continue
        (local_port, remote) = (int(fields[3].rsplit(":", 1)[1]), fields[4])
        remote_addr, remote_port = remote.rsplit(":", 1)
        if remote_addr != peer or local_port in skip_ports or int(remote_port) in skip_ports:
            continue
        match = re.search(r"bytes_received:(\d+)", info)
        total += int(match.group(1)) if match else 0
    return total


async def _cut_mid_read(root, servers, p_host: Host, d_host: Host, tag: str, kv_bytes: float) -> float | None:
    """Cut prefill's link while decode reads a request's KV; seconds until decode answered it, or None
    if the read ended before the cut (or failed before it began). The answer must equal a single
    instance's (recomputed)."""
    decode, prefill = servers["decode"], servers["prefill"]
    prompt = make_prompt(tag, 260)  # ~480 tokens: 4 blocks, ~256 KiB of KV
    want = (await complete(servers["single"].url, prompt, _model(root)))["choices"][0]["text"]
    failed = counter(decode, "vllm:nixl_num_failed_transfers_total")
    params = await prefill_only(prefill, prompt, _model(root))
    body = {"model": _model(root), "prompt": prompt, "max_tokens": 12, "temperature": 0, "kv_transfer_params": params}
    skip = {*HTTP.values(), *SIDE.values()}
    before = _tcp_bytes_from(d_host, p_host.address, skip)
    request = asyncio.create_task(post(decode.url, body, timeout=60))
    deadline = time.monotonic() + 20
    while _tcp_bytes_from(d_host, p_host.address, skip) - before <= 32 << 10:  # until the read's bytes arrive
        if request.done():
            # On the shaped link TCP can leave data unacknowledged past the link timeout (its user timeout):
            # the connection was dropped under the previous read, and this one failed at its post. Its
            # failure marked prefill stale: the next attempt handshakes again.
            assert counter(decode, "vllm:nixl_num_failed_transfers_total") > failed, request.result()
            return None
        assert time.monotonic() < deadline, "the read's bytes did not arrive in 20 s"
        await asyncio.sleep(0.02)
    p_host.set_link(False)
    cut = time.monotonic()
    arrived = _tcp_bytes_from(d_host, p_host.address, skip) - before
    try:
        # Decode keeps serving requests that need nothing from prefill.
        other = await complete(decode.url, make_prompt("while the link is down", 30), _model(root))
        assert other["choices"][0]["text"]
        status, reply = await request
        answered_s = time.monotonic() - cut
    finally:
        p_host.set_link(True)
    assert status == 200, reply
    assert reply["choices"][0]["text"] == want, "decode's answer differs from the reference"
    if counter(decode, "vllm:nixl_num_failed_transfers_total") > failed:
        return answered_s
    series = ("num_failed_notifications", "num_kv_expired_reqs")
    others = {name: decode.metric(f"vllm:nixl_{name}_total") for name in series}
    assert arrived >= kv_bytes, f"the read was not cut, though {arrived} of {kv_bytes:.0f} bytes had come ({others})"
    return None


async def test_outputs_equal_a_single_instance_and_the_kv_crossed_the_wire_over_tcp(cluster):
    root, servers, proxy, p_host, d_host = cluster
    for prompt in PROMPTS:
        want = await complete(servers["single"].url, prompt, _model(root))
        got = await complete(proxy.url, prompt, _model(root))
        assert got["choices"][0]["text"] == want["choices"][0]["text"], prompt
    moved = counter(servers["decode"], "vllm:nixl_bytes_transferred_sum")
    assert moved > 0
    assert counter(servers["decode"], "vllm:nixl_num_failed_transfers_total") == 0
    # UCX carried the KV over TCP between the two hosts (not CMA or shared memory): decode's
    # TCP connections with prefill, other than HTTP and the side channel, received at least it.
    skip = {*HTTP.values(), *SIDE.values()}
    received = _tcp_bytes_from(d_host, p_host.address, skip)
    assert received >= moved, f"decode read {moved:.0f} bytes, but only {received} came over TCP from prefill"


async def test_the_side_channel_listens_on_its_host_address_only(cluster):
    _root, _servers, _proxy, p_host, d_host = cluster
    for host, port in ((p_host, SIDE["prefill"]), (d_host, SIDE["decode"])):
        listening = [line.split()[3] for line in host.listening().splitlines() if line.split()[3].endswith(f":{port}")]
        assert listening == [f"{host.address}:{port}"], listening


async def test_a_link_cut_mid_read_recomputes_in_time_and_reads_resume_once_it_is_back(cluster):
    root, servers, proxy, p_host, d_host = cluster
    decode = servers["decode"]
    p_host.shape(rate_mbit=1)  # a read takes ~2 s: really in flight when the link goes
    try:
        started = time.monotonic()
        moved = counter(decode, "vllm:nixl_bytes_transferred_sum")
        warm = await complete(proxy.url, make_prompt("a slow link", 260), _model(root))
        slow_read_s = time.monotonic() - started
        kv_bytes = counter(decode, "vllm:nixl_bytes_transferred_sum") - moved
        assert warm["choices"][0]["text"]
        assert slow_read_s > 1.0, f"a shaped P/D request took {slow_read_s:.2f}s: the read is not in flight long"
        # On a loaded machine this test's own steps can lag past a read's end: then it tries again.
        for attempt in range(3):
            answered_s = await _cut_mid_read(root, servers, p_host, d_host, f"cut mid read {attempt}", kv_bytes)
            if answered_s is not None:
                break
        else:
            pytest.fail("every read ended before the link was cut")
    finally:
        p_host.unshape()
    assert answered_s < TRANSFER_TIMEOUT_S, f"answered {answered_s:.1f}s after the cut"

    # The link is back: P/D requests read prefill's KV again, with neither server restarted (the
    # proxy's pooled connection to prefill died with the link, so its first try may fail).
    failed = counter(decode, "vllm:nixl_num_failed_transfers_total")
    deadline = time.monotonic() + 30
    while True:
        prompt = make_prompt(f"after the link is back {time.monotonic():.0f}", 150)
        want = (await complete(servers["single"].url, prompt, _model(root)))["choices"][0]["text"]
        status, reply = await post(proxy.url, {"model": _model(root), "prompt": prompt, "max_tokens": 12,
                                               "temperature": 0})  # fmt: skip
        now_failed = counter(decode, "vllm:nixl_num_failed_transfers_total")
        if status == 200 and now_failed == failed:
            assert reply["choices"][0]["text"] == want
            break
        assert time.monotonic() < deadline, f"reads never resumed after the link came back: {status} {reply}"
        failed = now_failed
        await asyncio.sleep(1)
    print(f"\nshaped read {slow_read_s:.2f}s; cut request answered {answered_s:.2f}s after the cut")
