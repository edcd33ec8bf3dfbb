"""The "prefill" service: computes (here: fills) KV blocks and lends them to a reader.

POST /prefill {"request_id": str, "num_blocks": int} fills that many blocks, keeps them under a
lease until the reader's notification arrives (or the lease expires, if the reader vanished),
and answers where to read them: handshake address, engine id, block ids, a checksum, when the
lease ends (wall clock) and the notification that ends it (the request id and the lease's number:
a reader's notice that came after an earlier lease of the id ran out never frees a later one's
blocks). A malformed request is 400; a request id whose blocks are held, 409.

Run: python examples/async_server/prefill.py --http-port 8100 --handshake-port 5600
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import time
import zlib
from collections.abc import AsyncIterator

import numpy as np
from aiohttp import web
from common import BLOCK_LEN, NUM_BLOCKS, BlockPool, checksum, new_kv_cache, parse_request

from nixl_async import EngineConfig, NotificationTimeout, TransferEngine

log = logging.getLogger("prefill")
ENGINE = web.AppKey("engine", TransferEngine)


class PrefillState:
    def __init__(self, engine: TransferEngine, kv: list[np.ndarray], leases: asyncio.TaskGroup, lease_s: float):
        self.engine, self.kv, self.leases, self.lease_s = engine, kv, leases, lease_s
        self.pool = BlockPool(NUM_BLOCKS)
        self.holding: set[asyncio.Task[None]] = set()
        self.held: set[str] = set()  # request ids whose blocks are lent
        self.leases_given = itertools.count(1)
        self.expired = 0
        self.released = 0

    async def hold(self, request_id: str, notice: str, block_ids: list[int]) -> None:
        """Keep the blocks until the reader says it is done (`notice`), or the lease runs out."""
        try:
            await self.engine.wait_notifications(notice.encode(), count=1, timeout=self.lease_s)
            self.released += 1
        except NotificationTimeout:
            self.expired += 1
            log.warning("lease of %s expired: the reader never confirmed", request_id)
        finally:
            self.pool.give(block_ids)
            self.held.discard(request_id)


STATE = web.AppKey("state", PrefillState)


async def prefill(request: web.Request) -> web.Response:
    state = request.app[STATE]
    asked = parse_request(await request.read())
    if isinstance(asked, str):
        return web.json_response({"error": asked}, status=400)
    request_id = asked.request_id
    if request_id in state.held:
        return web.json_response({"error": f"the blocks of {request_id!r} are still lent"}, status=409)
    block_ids = state.pool.take(asked.num_blocks)
    if block_ids is None:
        return web.json_response({"error": "out of KV blocks, retry later"}, status=503)
    state.held.add(request_id)
    rng = np.random.default_rng(zlib.crc32(request_id.encode()))
    for region in state.kv:  # "compute" the KV cache of this prompt
        for b in block_ids:
            region[b * BLOCK_LEN : (b + 1) * BLOCK_LEN] = rng.integers(0, 256, BLOCK_LEN, dtype=np.uint8)
            await asyncio.sleep(0)  # (the loop goes on meanwhile: NIXL's progress, other requests, a hang-up)
    if request.transport is None or request.transport.is_closing():  # the reader gave up while we computed
        state.pool.give(block_ids)
        state.held.discard(request_id)
        return web.json_response({"error": "the reader went away"}, status=499)
    lease_expires_at = time.time() + state.lease_s
    notice = f"{request_id}#{next(state.leases_given)}"
    lease = state.leases.create_task(state.hold(request_id, notice, block_ids))
    state.holding.add(lease)
    lease.add_done_callback(state.holding.discard)
    host, port = state.engine.address or ("", 0)
    return web.json_response(
        {
            "engine_id": state.engine.engine_id,
            "agent_name": state.engine.agent_name,  # a new one after a restart: readers handshake again
            "host": host,
            "port": port,
            "block_ids": block_ids,
            "checksum": checksum(state.kv, block_ids),
            "lease_s": state.lease_s,
            "lease_expires_at": lease_expires_at,
            "notify": notice,  # what the reader sends once done (or once it gives up)
        }
    )


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"free_blocks": state.pool.free, "released": state.released, "expired": state.expired})


def make_app(handshake_host: str, handshake_port: int, lease_s: float) -> web.Application:
    app = web.Application()

    async def lifespan(app: web.Application) -> AsyncIterator[None]:
        # The engine lives exactly as long as the app; leases are tasks of one group.
        config = EngineConfig(engine_id="prefill-0", compat={"model": "demo"})
        async with TransferEngine(config) as engine, asyncio.TaskGroup() as leases:
            kv = new_kv_cache()
            engine.register("kv", kv, block_len=BLOCK_LEN)
            await engine.serve(handshake_host, handshake_port)
            app[ENGINE] = engine
            app[STATE] = state = PrefillState(engine, kv, leases, lease_s)
            yield
            for lease in list(state.holding):  # shutting down: stop waiting for readers
                lease.cancel()

    app.cleanup_ctx.append(lifespan)
    app.router.add_post("/prefill", prefill)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8100)
    parser.add_argument("--handshake-port", type=int, default=5600)
    parser.add_argument("--lease-s", type=float, default=30.0)
    args = parser.parse_args()
    if args.host in ("0.0.0.0", "::", ""):  # its answers name this address for readers to dial
        parser.error(f"--host {args.host!r} cannot be dialled by readers: give this machine's address")
    if not 0 < args.lease_s < float("inf"):  # (NaN too: its answers would not be JSON, its lease task would fail)
        parser.error(f"--lease-s must be a finite number of seconds > 0, not {args.lease_s!r}")
    logging.basicConfig(level=logging.INFO)
    web.run_app(make_app(args.host, args.handshake_port, args.lease_s), host=args.host, port=args.http_port,
                print=lambda *_: print("prefill ready", flush=True))  # fmt: skip


if __name__ == "__main__":
    main()
