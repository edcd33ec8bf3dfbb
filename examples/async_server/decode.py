"""The "decode" service: pulls a prompt's KV blocks from prefill, through the awaitable API.

POST /generate {"request_id": str, "num_blocks": int, "deadline_s": float} asks prefill for the
blocks, connects to it (one handshake per peer, cached by the engine and repeated on its own
after a failure), reads the blocks within prefill's lease, tells prefill it is done (the
notification rides on the read), and checks the bytes. A malformed request is 400, as is one
prefill refuses (409: its id's blocks are still lent). Everything runs under the request's deadline; if the client
disconnects, aiohttp cancels the handler and with it the transfer (its NIXL handles are freed). A
request's blocks go back to the pool only once NIXL holds none of its reads.
Many requests share one engine; a slow or dead prefill affects only the requests that use it.

Run: python examples/async_server/decode.py --http-port 8200 --prefill-url http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from common import BLOCK_LEN, NUM_BLOCKS, BlockPool, checksum, new_kv_cache, parse_request

from nixl_async import (
    EngineConfig,
    HandshakeError,
    LeaseExpired,
    NixlAsyncError,
    Peer,
    PeerUnknownError,
    Transfer,
    TransferEngine,
    TransferError,
)

log = logging.getLogger("decode")
ENGINE = web.AppKey("engine", TransferEngine)
STATE = web.AppKey("state", dict)


async def generate(request: web.Request) -> web.Response:
    engine, state = request.app[ENGINE], request.app[STATE]
    asked = parse_request(await request.read())
    if isinstance(asked, str):
        return web.json_response({"ok": False, "error": "BadRequest", "message": asked}, status=400)
    request_id, deadline_s = asked.request_id, asked.deadline_s
    local = state["pool"].take(asked.num_blocks)
    if local is None:
        return web.json_response({"request_id": request_id, "error": "out of KV blocks"}, status=503)
    peer: Peer | None = None
    read = False  # the read landed (its notification told prefill)
    with engine.collect_transfers() as started:
        try:
            async with asyncio.timeout(deadline_s):
                async with state["http"].post(state["prefill_url"] + "/prefill", data=msgspec.json.encode(asked),
                                              headers={"Content-Type": "application/json"}) as resp:  # fmt: skip
                    if resp.status in (400, 409):
                        return _error(request_id, 400, "Refused", (await resp.json())["error"])
                    if resp.status == 503:  # out of blocks: the client may retry later
                        return _error(request_id, 503, "PrefillBusy", (await resp.json())["error"])
                    resp.raise_for_status()
                    info = await resp.json()
                peer = await _connect(engine, info)
                await engine.read(peer, local, info["block_ids"], notify=info["notify"].encode(),
                                  lease_expires_at=info["lease_expires_at"])  # fmt: skip
                read = True
            ok = checksum(state["kv"], local) == info["checksum"]
            return web.json_response(
                {"request_id": request_id, "ok": ok, "bytes": asked.num_blocks * BLOCK_LEN * len(state["kv"])}
            )
        except LeaseExpired as exc:  # prefill may have given the blocks to another prompt: never read them
            return _error(request_id, 504, type(exc).__name__, str(exc))
        except TimeoutError as exc:  # our deadline, or the engine's own (a handshake, a transfer)
            if isinstance(exc, NixlAsyncError):
                return _error(request_id, 504, type(exc).__name__, str(exc))
            return _error(request_id, 504, "DeadlineExceeded", f"no KV within {deadline_s}s")
        except (TransferError, HandshakeError, aiohttp.ClientError) as exc:
            return _error(request_id, 502, type(exc).__name__, str(exc))
        finally:
            # Not read: tell prefill it may free the blocks now, rather than hold them for its whole lease.
            unread = None if read or peer is None else (peer, info["notify"], info["lease_expires_at"])
            _give_back(engine, state["pool"], local, started, unread)


async def _connect(engine: TransferEngine, info: dict[str, Any]) -> Peer:
    """The prefill named in `info`; handshaken again if it restarted (a new agent) since we last read from it."""
    try:
        known = engine.peer(info["engine_id"])
    except PeerUnknownError:
        known = None
    restarted = known is not None and known.agent_name != info["agent_name"]
    return await engine.connect(info["host"], info["port"], expected_engine_id=info["engine_id"], refresh=restarted)


def _give_back(engine: TransferEngine, pool: BlockPool, blocks: list[int], started: list[Transfer],
               unread: tuple[Peer, str, float] | None) -> None:  # fmt: skip
    """Blocks go back to the pool only once NIXL holds none of the request's reads: a read that was
    stopped (deadline, disconnect) may still be landing in them, reported `TransferFenced`. A request
    whose read did not land (`unread`: its prefill, the lease's notification and its end) tells prefill, within
    the lease."""
    if all(t.quiet for t in started) and unread is None:
        pool.give(blocks)
        return

    async def when_quiet() -> None:
        if await engine.settle(started):  # (False: the engine closed with NIXL holding one: never reused)
            pool.give(blocks)
        landed = any(t.done() and not t.future.cancelled() and t.exception() is None for t in started)  # notified
        if unread is not None and not landed and time.time() < unread[2]:  # (past the lease prefill freed them)
            peer, notice, _ = unread
            try:
                await engine.notify(peer, notice.encode())
            except Exception as exc:  # prefill gone, or unreachable: its lease frees them
                log.info("telling prefill %s is not read failed: %s", notice, exc)

    task = asyncio.get_running_loop().create_task(when_quiet())
    _SETTLING.add(task)
    task.add_done_callback(_SETTLING.discard)


_SETTLING: set[asyncio.Task[None]] = set()  # (a task nobody holds may be collected before it ends)


def _error(request_id: str, status: int, kind: str, message: str) -> web.Response:
    log.warning("%s failed: %s: %s", request_id, kind, message)
    return web.json_response({"request_id": request_id, "ok": False, "error": kind, "message": message}, status=status)


async def health(request: web.Request) -> web.Response:
    snap = request.app[ENGINE].snapshot()
    free = request.app[STATE]["pool"].free
    return web.json_response({"counters": snap.counters, "live_handles": snap.live_handles, "free_blocks": free})


def make_app(prefill_url: str) -> web.Application:
    app = web.Application()

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        config = EngineConfig(engine_id="decode-0", compat={"model": "demo"}, handshake_timeout_s=2.0)
        async with TransferEngine(config) as engine, aiohttp.ClientSession() as http:
            kv = new_kv_cache()
            engine.register("kv", kv, block_len=BLOCK_LEN)
            app[ENGINE] = engine
            app[STATE] = {"kv": kv, "pool": BlockPool(NUM_BLOCKS), "http": http, "prefill_url": prefill_url.rstrip("/")}
            yield

    app.cleanup_ctx.append(lifespan)
    app.router.add_post("/generate", generate)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8200)
    parser.add_argument("--prefill-url", default="http://127.0.0.1:8100")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    web.run_app(make_app(args.prefill_url), host=args.host, port=args.http_port, handler_cancellation=True,
                print=lambda *_: print("decode ready", flush=True))  # fmt: skip


if __name__ == "__main__":
    main()
