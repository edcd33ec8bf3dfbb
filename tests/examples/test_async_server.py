"""The async server example, run for real: two services, concurrent requests, a prefill crash."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from nixl_async.testing import TCP_TLS

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "async_server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, script: str, *args: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE / script), *args],
            cwd=EXAMPLE, env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip

    async def wait_ready(self, url: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"service exited: {self.proc.stderr.read().decode()[-2000:]}")
                try:
                    async with http.get(url + "/health") as resp:
                        if resp.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise TimeoutError(f"{url} not ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _generate(http, url, request_id, num_blocks, deadline_s):
    started = time.monotonic()
    async with http.post(
        url + "/generate", json={"request_id": request_id, "num_blocks": num_blocks, "deadline_s": deadline_s}
    ) as resp:
        body = await resp.json()
    return resp.status, body, time.monotonic() - started


async def _health(http, url) -> dict:
    async with http.get(url + "/health") as resp:
        return await resp.json()


async def _counters(http, url) -> dict:
    async with http.get(url + "/health") as resp:
        return (await resp.json())["counters"]


def _in_flight(counters: dict) -> int:
    ended = sum(counters.get(f"transfers_{kind}", 0) for kind in ("done", "cancelled", "timeouts", "failures"))
    return counters.get("transfers_submitted", 0) - ended


async def _wait_for(http, url, condition, until=None, timeout: float = 5.0) -> dict | None:
    """Poll decode's counters until `condition` holds (-> them); None if `until` finished or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (until is not None and until.done()):
        counters = await _counters(http, url)
        if condition(counters):
            return counters
        await asyncio.sleep(0.002)
    return None


async def _a_read_in_flight(http, decode_url: str, tag: str) -> asyncio.Future:
    """A request of 48 blocks (deadline 1 s) whose read decode has in flight (tried up to 3 times: a read can
    end before it is seen); the client's future."""
    for attempt in range(3):
        client = asyncio.ensure_future(_generate(http, decode_url, f"{tag}-{attempt}", 48, 1.0))
        if await _wait_for(http, decode_url, lambda c: _in_flight(c) > 0, until=client):
            break
        await client
    return client


@pytest.fixture
def ports():
    return {"prefill_http": _free_port(), "handshake": _free_port(), "decode_http": _free_port()}


async def test_requests_survive_a_prefill_crash_and_restart(ports):
    prefill_url = f"http://127.0.0.1:{ports['prefill_http']}"
    decode_url = f"http://127.0.0.1:{ports['decode_http']}"
    prefill_args = ["--http-port", str(ports["prefill_http"]), "--handshake-port", str(ports["handshake"]),
                    "--lease-s", "3"]  # fmt: skip
    tcp = {"UCX_TLS": TCP_TLS}  # transfers really in flight, so a crash can interrupt them
    prefill = Service("prefill.py", *prefill_args, env=tcp)
    decode = Service("decode.py", "--http-port", str(ports["decode_http"]), "--prefill-url", prefill_url, env=tcp)
    try:
        await asyncio.gather(prefill.wait_ready(prefill_url), decode.wait_ready(decode_url))
        async with aiohttp.ClientSession() as http:
            # 1) concurrent requests share one engine; every byte is checked
            results = await asyncio.gather(*(_generate(http, decode_url, f"warm-{i}", 2, 10) for i in range(12)))
            assert all(status == 200 and body["ok"] for status, body, _ in results), results

            # 2) kill prefill while large reads are in flight: they fail clearly, within their deadline
            deadline = 3.0
            inflight = [asyncio.ensure_future(_generate(http, decode_url, f"crash-{i}", 8, deadline)) for i in range(6)]
            # (not a fixed pause: on a loaded machine all six had finished within 0.15 s once)
            await _wait_for(http, decode_url, lambda c: _in_flight(c) > 0)
            prefill.proc.kill()
            prefill.proc.wait()
            outcomes = await asyncio.gather(*inflight)
            for status, body, elapsed in outcomes:
                assert elapsed < deadline + 1.5, (status, body, elapsed)
                if status != 200:
                    assert status in (502, 504) and body["error"] and body["message"], body
            assert any(status != 200 for status, _, _ in outcomes), "expected at least one interrupted request"

            # 3) decode keeps serving: a restarted prefill (new NIXL agent, same address) is used at once
            prefill = Service("prefill.py", *prefill_args, env=tcp)
            await prefill.wait_ready(prefill_url)
            results = await asyncio.gather(*(_generate(http, decode_url, f"after-{i}", 2, 10) for i in range(6)))
            assert all(status == 200 and body["ok"] for status, body, _ in results), results

            # 4) a client that disconnects while its read is in flight cancels the read; nothing leaks
            before = await _counters(http, decode_url)
            for attempt in range(3):  # the read must be caught in flight (96 MiB over TCP: ~0.1 s)
                client = asyncio.ensure_future(_generate(http, decode_url, f"gone-{attempt}", 48, 10))
                caught = await _wait_for(http, decode_url, lambda c: _in_flight(c) > 0, until=client)
                client.cancel()  # the client goes away: aiohttp cancels the handler, and with it the read
                await asyncio.gather(client, return_exceptions=True)
                if caught:
                    break
            assert caught, "no read was ever seen in flight"
            after = await _wait_for(http, decode_url, lambda c: _in_flight(c) == 0)
            assert after and after.get("transfers_cancelled", 0) == before.get("transfers_cancelled", 0) + 1, after
            async with http.get(decode_url + "/health") as resp:
                health = await resp.json()
            assert health["live_handles"].get("xfers", 0) == 0, health
            async with http.get(prefill_url + "/health") as resp:
                assert (await resp.json())["free_blocks"] > 0

            # 5) a read stopped at its deadline while prefill is frozen stays fenced: its blocks stay out of the
            #    pool until NIXL lets go of them (they would be handed to the next request while bytes can land)
            assert (await _health(http, decode_url))["free_blocks"] == 64
            for _ in range(500):  # prefill's leases on the blocks of step 4 run out (3 s)
                if (await _health(http, prefill_url))["free_blocks"] == 64:
                    break
                await asyncio.sleep(0.02)
            client = await _a_read_in_flight(http, decode_url, "frozen")
            prefill.proc.send_signal(signal.SIGSTOP)
            try:
                status, body, _ = await client
                assert status == 504, body
                health = await _health(http, decode_url)
                # fenced: NIXL cannot let go of a read from a frozen peer (UCX cancels no GET over TCP)
                assert health["live_handles"].get("xfers", 0) > 0, health
                assert health["free_blocks"] == 64 - 48, health
            finally:
                prefill.proc.send_signal(signal.SIGCONT)
            for _ in range(500):
                health = await _health(http, decode_url)
                if health["free_blocks"] == 64 and not health["live_handles"].get("xfers", 0):
                    break
                await asyncio.sleep(0.02)
            assert health["free_blocks"] == 64, health
    finally:
        prefill.stop()
        decode.stop()
    assert decode.proc.returncode in (0, -signal.SIGINT), decode.proc.stderr.read().decode()[-2000:]


async def test_bad_requests_are_refused_and_hold_nothing(ports):
    """Malformed bodies, missing fields and block counts that could never be served are 400 on both
    services (before: 500s, an empty lease for -3 blocks, and "retry later" for 1000); a second request
    under an id whose blocks are lent is 409 (before: taken, and one reader's notice freed the other's
    blocks while it might still read them)."""
    prefill_url = f"http://127.0.0.1:{ports['prefill_http']}"
    decode_url = f"http://127.0.0.1:{ports['decode_http']}"
    prefill = Service("prefill.py", "--http-port", str(ports["prefill_http"]), "--handshake-port",
                      str(ports["handshake"]), "--lease-s", "30")  # fmt: skip
    decode = Service("decode.py", "--http-port", str(ports["decode_http"]), "--prefill-url", prefill_url)
    try:
        await asyncio.gather(prefill.wait_ready(prefill_url), decode.wait_ready(decode_url))
        bad = [b"not json", b'{"num_blocks": 2}', b'{"request_id": "r", "num_blocks": -3}',
               b'{"request_id": "r", "num_blocks": 1000}', b'{"request_id": "", "num_blocks": 2}',
               b'{"request_id": "r", "num_blocks": 2, "deadline_s": 0}']  # fmt: skip
        async with aiohttp.ClientSession() as http:
            for url in (prefill_url + "/prefill", decode_url + "/generate"):
                for body in bad:
                    async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                        assert resp.status == 400, (url, body, resp.status)
            assert (await _health(http, prefill_url))["free_blocks"] == 64
            assert (await _health(http, decode_url))["free_blocks"] == 64
            async with http.post(prefill_url + "/prefill", json={"request_id": "dup", "num_blocks": 8}) as resp:
                assert resp.status == 200
            async with http.post(prefill_url + "/prefill", json={"request_id": "dup", "num_blocks": 8}) as resp:
                assert resp.status == 409
            status, body, _ = await _generate(http, decode_url, "dup", 2, 5.0)  # prefill's 409, passed on
            assert status == 400 and body["error"] == "Refused"
            assert (await _health(http, prefill_url))["free_blocks"] == 56
            status, body, _ = await _generate(http, decode_url, "fine", 2, 5.0)
            assert status == 200 and body["ok"], body
    finally:
        prefill.stop()
        decode.stop()


async def test_an_idle_restart_and_an_abandoned_request_cost_no_request_and_no_lease(ports):
    """Before: decode read from the killed prefill's agent after an idle restart (the first request failed,
    502), and a request decode gave up on held prefill's blocks for the whole lease (every request after
    it refused for 30 s once the pool was empty). Also: a trailing slash on `--prefill-url` was a 404."""
    prefill_url = f"http://127.0.0.1:{ports['prefill_http']}"
    decode_url = f"http://127.0.0.1:{ports['decode_http']}"
    prefill_args = ["--http-port", str(ports["prefill_http"]), "--handshake-port", str(ports["handshake"]),
                    "--lease-s", "30"]  # fmt: skip
    tcp = {"UCX_TLS": TCP_TLS}
    prefill = Service("prefill.py", *prefill_args, env=tcp)
    decode = Service("decode.py", "--http-port", str(ports["decode_http"]), "--prefill-url", prefill_url + "/",
                     env=tcp)  # fmt: skip
    try:
        await asyncio.gather(prefill.wait_ready(prefill_url), decode.wait_ready(decode_url))
        async with aiohttp.ClientSession() as http:
            status, body, _ = await _generate(http, decode_url, "before", 2, 10)
            assert status == 200 and body["ok"], body
            prefill.proc.kill()  # idle: no read in flight
            prefill.proc.wait()
            prefill = Service("prefill.py", *prefill_args, env=tcp)
            await prefill.wait_ready(prefill_url)
            status, body, _ = await _generate(http, decode_url, "after", 2, 10)
            assert status == 200 and body["ok"], body

            # Decode gives up while prefill computes (64 blocks: 0.2-1 s): prefill sees the hang-up.
            await _all_free(http, prefill_url, "the requests read")  # (their notices reach prefill a moment later)
            status, body, _ = await _generate(http, decode_url, "gave-up", 64, 0.01)
            assert status == 504, body
            await _all_free(http, prefill_url, "a request given up before prefill answered")

            # Decode gives up on a read in flight (prefill frozen): it tells prefill once NIXL let go.
            client = await _a_read_in_flight(http, decode_url, "frozen")
            prefill.proc.send_signal(signal.SIGSTOP)
            try:
                status, body, _ = await client
            finally:
                prefill.proc.send_signal(signal.SIGCONT)
            assert status == 504, body
            await _all_free(http, prefill_url, "a read given up")
            status, body, _ = await _generate(http, decode_url, "next", 48, 10)
            assert status == 200 and body["ok"], body
    finally:
        prefill.stop()
        decode.stop()


async def _all_free(http, prefill_url: str, after: str) -> None:
    """Prefill's blocks all come back within 5 s, long before its 30 s lease."""
    for _ in range(250):
        if (await _health(http, prefill_url))["free_blocks"] == 64:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"prefill still holds blocks 5 s after {after}: {await _health(http, prefill_url)}")


async def test_decode_names_a_handshake_timeout_and_passes_prefill_busy_on(ports):
    """Before: a handshake that timed out was reported as the request's deadline ("no KV within 10.0s", after
    2 s), and prefill's "out of blocks, retry later" (503) reached the client as a 502."""
    from aiohttp import web

    answers = {"prefill": None}
    dead_port = _free_port()  # nothing listens there: the handshake times out

    async def fake_prefill(request: web.Request) -> web.Response:
        if answers["prefill"] == "busy":
            return web.json_response({"error": "out of KV blocks, retry later"}, status=503)
        return web.json_response({"engine_id": "prefill-0", "agent_name": "prefill-0/1", "host": "127.0.0.1",
                                  "port": dead_port, "block_ids": [0], "checksum": 0,
                                  "lease_expires_at": time.time() + 30, "notify": "h#1"})  # fmt: skip

    app = web.Application()
    app.router.add_post("/prefill", fake_prefill)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", ports["prefill_http"]).start()
    decode_url = f"http://127.0.0.1:{ports['decode_http']}"
    decode = Service("decode.py", "--http-port", str(ports["decode_http"]), "--prefill-url",
                     f"http://127.0.0.1:{ports['prefill_http']}")  # fmt: skip
    try:
        await decode.wait_ready(decode_url)
        async with aiohttp.ClientSession() as http:
            status, body, _ = await _generate(http, decode_url, "h", 1, 10)
            assert (status, body["error"]) == (504, "HandshakeTimeout") and str(dead_port) in body["message"], body
            answers["prefill"] = "busy"
            status, body, _ = await _generate(http, decode_url, "b", 1, 10)
            assert (status, body["error"]) == (503, "PrefillBusy"), body
    finally:
        decode.stop()
        await runner.cleanup()


async def test_a_readers_notice_after_its_lease_ran_out_frees_no_later_lease_of_the_same_id(ports):
    """An audit of session 39: a reader's notice that came after its lease ran out stayed unclaimed in the
    engine, and the next request under that id was released by it at once, its blocks free before anyone read."""
    from nixl_async import EngineConfig, TransferEngine

    prefill_url = f"http://127.0.0.1:{ports['prefill_http']}"
    prefill = Service("prefill.py", "--http-port", str(ports["prefill_http"]), "--handshake-port",
                      str(ports["handshake"]), "--lease-s", "1")  # fmt: skip
    try:
        await prefill.wait_ready(prefill_url)
        config = EngineConfig(engine_id="late-reader", compat={"model": "demo"})
        async with aiohttp.ClientSession() as http, TransferEngine(config) as reader:
            free = (await _health(http, prefill_url))["free_blocks"]
            async with http.post(prefill_url + "/prefill", json={"request_id": "r1", "num_blocks": 2}) as resp:
                first = await resp.json()
            while (await _health(http, prefill_url))["expired"] < 1:  # the reader never came in time
                await asyncio.sleep(0.05)
            peer = await reader.connect("127.0.0.1", ports["handshake"], expected_engine_id=first["engine_id"])
            await reader.notify(peer, first.get("notify", "r1").encode())  # what that lease's reader sends, late
            async with http.post(prefill_url + "/prefill", json={"request_id": "r1", "num_blocks": 2}) as resp:
                assert resp.status == 200
            await asyncio.sleep(0.3)
            health = await _health(http, prefill_url)
            assert (health["released"], health["free_blocks"]) == (0, free - 2), health
    finally:
        prefill.stop()


@pytest.mark.parametrize("lease", ["nan", "inf", "0", "-5"])
def test_prefill_refuses_a_lease_that_is_not_a_positive_number(lease):
    """Before, `--lease-s nan` started: the first answer was not JSON (`NaN`) and the lease task then ended the
    server; 0 or less expired every lease at once."""
    done = subprocess.run([sys.executable, str(EXAMPLE / "prefill.py"), "--lease-s", lease], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "--lease-s must be a finite number of seconds > 0" in done.stderr
