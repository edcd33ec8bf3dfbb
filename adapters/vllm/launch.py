"""Start vLLM prefill/decode servers and a P/D proxy: for the example, the tests and the benchmark.

Not part of the connector (it runs nothing inside vLLM); it encodes how P/D is run on a
CPU-only machine (shared/reference/vllm-on-cpu.md): servers started with
``python -m vllm.entrypoints.openai.api_server`` in their own process group (a new session
made the flow hang), shared-memory segments removed after a kill, one side-channel port
range per instance.

The proxy does what vLLM's example proxies do for NixlConnector: send the prompt to prefill
with ``max_tokens=1`` and ``do_remote_decode``, then to decode with the ``kv_transfer_params``
prefill returned. It works the same for either connector.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nixl_async.testing.children import dies_with_us

__all__ = [
    "ProxyProcess",
    "PushTarget",
    "VllmServer",
    "kv_transfer_config",
    "make_prompt",
    "pd_complete",
    "pd_push_complete",
    "run_proxy",
]

CONNECTORS = {
    # name -> (kv_connector, kv_connector_module_path)
    "nixl_async": ("NixlAsyncConnector", "nixl_async_vllm.connector"),
    "vllm": ("NixlConnector", "nixl_async_benchmarks.stock_nixl"),
    "nixl_async_push": ("NixlAsyncPushConnector", "nixl_async_vllm.connector"),
    "vllm_push": ("NixlPushConnector", "nixl_async_benchmarks.stock_nixl"),
    # the first two with decode's KV load time logged (nixl_async_benchmarks.load_clock)
    "nixl_async_clocked": ("ClockedNixlAsyncConnector", "nixl_async_benchmarks.load_clock"),
    "vllm_clocked": ("ClockedNixlConnector", "nixl_async_benchmarks.load_clock"),
}


def kv_transfer_config(
    connector: str,
    role: str,
    extra: Mapping[str, Any] | None = None,
    *,
    failure_policy: str | None = None,
    engine_id: str | None = None,
) -> str:
    """The ``--kv-transfer-config`` JSON: only the connector name and module differ between the two.

    `failure_policy`: vLLM's ``kv_load_failure_policy`` (``"fail"``, its default, or ``"recompute"``).
    """
    name, module = CONNECTORS[connector]
    config: dict[str, Any] = {"kv_connector": name, "kv_connector_module_path": module, "kv_role": role,
                              "kv_buffer_device": "cpu"}  # fmt: skip
    if failure_policy is not None:
        config["kv_load_failure_policy"] = failure_policy
    if engine_id is not None:  # push mode: the proxy names prefill's engine to decode
        config["engine_id"] = engine_id
    if extra:
        config["kv_connector_extra_config"] = dict(extra)
    return json.dumps(config)


def _get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return bytes(reply.read())


@dataclass
class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` process (own process group; killed with it)."""

    model: str
    port: int
    side_channel_port: int
    kv_config: str | None = None  # --kv-transfer-config JSON; None: no disaggregation
    cpu: int = 0  # VLLM_CPU_OMP_THREADS_BIND
    max_model_len: int = 512
    max_num_seqs: int = 8
    kv_cache_bytes: int = 64 << 20
    max_num_batched_tokens: int | None = None  # default: max(512, max_model_len), one chunk per prompt
    extra_env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    # Another host: the server's address (HTTP, side channel, UCX device) and a command prefix
    # that runs it there, e.g. ``["ip", "netns", "exec", "p"]`` (nixl_async.testing.netns).
    host: str = "127.0.0.1"
    net_device: str = "lo"
    command_prefix: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None
    _started_at: float = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [
            *self.command_prefix, sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
            "--host", self.host, "--port", str(self.port), "--dtype", "bfloat16",
            "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens or max(512, self.max_model_len)),
            "--enforce-eager", "--seed", "0",
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
        ]  # fmt: skip
        if self.kv_config is not None:
            cmd += ["--kv-transfer-config", self.kv_config]
        return cmd

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE" or v}
        env.update(
            VLLM_HOST_IP=self.host,
            VLLM_NIXL_SIDE_CHANNEL_HOST=self.host,
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.side_channel_port),
            UCX_NET_DEVICES=self.net_device,
            VLLM_CPU_OMP_THREADS_BIND=str(self.cpu),
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    def start(self) -> VllmServer:
        _refuse_taken(self.host, self.port)
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._started_at = time.time()
        self.process = subprocess.Popen(
            dies_with_us(self.command()), env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
            process_group=0,
        )  # fmt: skip
        return self

    def wait_ready(self, timeout: float = 240.0) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM server on port {self.port} exited with {self.process.returncode}"
                                   f"{self._log_tail()}")  # fmt: skip
            with contextlib.suppress(OSError):
                _get(f"{self.url}/health")
                return
            time.sleep(0.5)
        raise TimeoutError(f"vLLM server on port {self.port} not ready after {timeout}s{self._log_tail()}")

    def _log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n--- log tail ---\n" + self.log_path.read_text(errors="replace")[-4000:]

    def metric(self, name: str) -> float | None:
        """A gauge from /metrics (first sample), e.g. ``vllm:kv_cache_usage_perc``."""
        for line in _get(f"{self.url}/metrics").decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        return None

    def kill(self) -> None:
        """SIGKILL the whole process group (API server, engine core, workers) and clean /dev/shm."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self.process = None
        _clean_shm(since=self._started_at)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a grace period."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=15)
        self.kill()


def _clean_shm(since: float) -> None:
    """Remove shared-memory segments created since `since` by us that no live process maps."""
    uid = os.getuid()
    for path in glob.glob("/dev/shm/*"):
        with contextlib.suppress(OSError):
            info = os.stat(path)
            if info.st_uid == uid and info.st_ctime >= since - 1 and not _in_use(path):
                os.unlink(path)


def _in_use(path: str) -> bool:
    """Whether a live process of ours maps `path` (a segment of a server still running)."""
    for maps in glob.glob("/proc/[0-9]*/maps"):
        with contextlib.suppress(OSError), open(maps) as f:
            if path in f.read():
                return True
    return False


PROMPT_TEXT = (
    "the river runs past the old mill and under the stone bridge before it reaches the sea while "
    "the baker lights the oven and a computer keeps its working data in memory"
)


def make_prompt(tag: str, words: int) -> str:
    """A prompt of about `words` words whose head (`tag`) makes it unique, so no prefix cache hits it."""
    vocab = PROMPT_TEXT.split(" ")
    return f"{tag}: " + " ".join(vocab[(i * 7 + len(tag)) % len(vocab)] for i in range(words))


# -- the proxy ---------------------------------------------------------------------------------
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


async def pd_complete(session: Any, prefill_url: str, decode_url: str, body: dict[str, Any]) -> Any:
    """Prefill (one token, KV kept for decode), then decode with prefill's kv_transfer_params.

    Returns decode's response (an aiohttp response, not yet read, for streaming).
    """
    first = dict(body, max_tokens=1, stream=False, kv_transfer_params=PREFILL_PARAMS)
    first.pop("stream_options", None)
    async with session.post(f"{prefill_url}/v1/completions", json=first) as reply:
        if reply.status != 200:
            raise RuntimeError(f"prefill answered {reply.status}: {await reply.text()}")
        params = (await reply.json()).get("kv_transfer_params")
    return await session.post(f"{decode_url}/v1/completions", json=dict(body, kv_transfer_params=params))


@dataclass(frozen=True)
class PushTarget:
    """Push mode: what the proxy tells decode about prefill (decode registers there before prefill ends)."""

    engine_id: str
    host: str
    port: int  # prefill's side channel base port
    tp_size: int = 1
    order: str = "together"  # or "decode_first" / "prefill_first": when each leg is sent (for tests)

    def decode_params(self, request_id: str) -> dict[str, Any]:
        """Decode's ``kv_transfer_params`` for the request sent under ``X-Request-Id: request_id``."""
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_host": self.host, "remote_port": self.port, "tp_size": self.tp_size,
                "remote_request_id": f"cmpl-{request_id}-0", "remote_block_ids": []}  # fmt: skip


async def pd_push_complete(session: Any, prefill_url: str, decode_url: str, body: dict[str, Any],
                           target: PushTarget, request_id: str | None = None) -> Any:  # fmt: skip
    """Push mode, as vLLM's push proxies: both legs under one X-Request-Id; decode names prefill's request.

    vLLM names a completion's request ``cmpl-{X-Request-Id}-0`` plus a random suffix on each
    server; decode registers that name and prefill matches it without the suffix. `request_id`:
    the X-Request-Id (a fresh one by default; a client's retry may send its first one again).
    """
    request_id = request_id or uuid.uuid4().hex
    headers = {"X-Request-Id": request_id}
    first = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    first.pop("stream_options", None)
    params = target.decode_params(request_id)

    async def prefill() -> None:
        async with session.post(f"{prefill_url}/v1/completions", json=first, headers=headers) as reply:
            if reply.status != 200:
                raise RuntimeError(f"prefill answered {reply.status}: {await reply.text()}")
            await reply.read()

    def decode() -> Any:
        return session.post(f"{decode_url}/v1/completions", json=dict(body, kv_transfer_params=params),
                            headers=headers)  # fmt: skip

    if target.order == "prefill_first":
        await prefill()
        return await decode()
    if target.order == "decode_first":
        reply = asyncio.ensure_future(decode())
        await asyncio.sleep(0.5)  # decode has registered before prefill even starts
        await prefill()
        return await reply
    prefilled = asyncio.ensure_future(prefill())
    reply = await decode()
    await prefilled
    return reply


def run_proxy(port: int, prefill_url: str, decode_url: str, push: PushTarget | None = None) -> None:
    """Serve ``POST /v1/completions`` as one P/D request (streaming passes through)."""
    import aiohttp
    from aiohttp import web

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session: aiohttp.ClientSession = request.app["session"]
        try:
            if push is None:
                reply = await pd_complete(session, prefill_url, decode_url, body)
            else:
                reply = await pd_push_complete(session, prefill_url, decode_url, body, push)
        except (RuntimeError, aiohttp.ClientError) as exc:
            return web.json_response({"error": str(exc)}, status=502)
        async with reply:
            out = web.StreamResponse(status=reply.status, headers={"Content-Type": reply.content_type})
            await out.prepare(request)
            async for chunk in reply.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def lifespan(app: web.Application) -> Any:
        app["session"] = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600))
        yield
        await app["session"].close()

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    app.cleanup_ctx.append(lifespan)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


@dataclass
class ProxyProcess:
    port: int
    prefill_url: str
    decode_url: str
    push: PushTarget | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ProxyProcess:
        _refuse_taken("127.0.0.1", self.port)
        cmd = [sys.executable, "-m", "nixl_async_vllm.launch", "proxy", "--port", str(self.port),
               "--prefill", self.prefill_url, "--decode", self.decode_url]  # fmt: skip
        if self.push is not None:
            cmd += ["--push", json.dumps(dataclasses.asdict(self.push))]
        self.process = subprocess.Popen(dies_with_us(cmd), process_group=0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                _get(f"{self.url}/health")
                return self
            time.sleep(0.1)
        raise TimeoutError("proxy did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None


def _refuse_taken(host: str, port: int) -> None:
    """Raise if something already answers at host:port: a server left by another run would pass our
    readiness check (its /health answers) and take this run's requests (404s for a model path it lacks)."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
        raise RuntimeError(f"{host}:{port} is taken by another process (a server left running by another run?)")


@contextlib.contextmanager
def running(*servers: VllmServer, timeout: float = 300.0) -> Iterator[None]:
    """Start servers together (they load in parallel), wait for all, stop them on exit."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(timeout)
        yield
    finally:
        for server in servers:
            server.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nixl_async_vllm.launch")
    sub = parser.add_subparsers(dest="what", required=True)
    proxy = sub.add_parser("proxy", help="run the P/D proxy")
    proxy.add_argument("--port", type=int, required=True)
    proxy.add_argument("--prefill", required=True)
    proxy.add_argument("--decode", required=True)
    proxy.add_argument("--push", help="push mode: PushTarget fields as JSON")
    args = parser.parse_args(argv)
    if args.what == "proxy":
        run_proxy(args.port, args.prefill, args.decode, PushTarget(**json.loads(args.push)) if args.push else None)


if __name__ == "__main__":
    main()
