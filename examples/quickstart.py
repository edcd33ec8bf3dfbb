"""The awaitable API in one file: a "prefill" and a "decode" engine exchanging KV blocks.

Both engines live in this process on one event loop (each owns its NIXL agent and its poller);
in production they run in different processes or machines and only the address changes.
Run: .venv/bin/python examples/quickstart.py
"""

import asyncio

import numpy as np

from nixl_async import EngineConfig, TransferEngine

LAYERS, BLOCKS, BLOCK_LEN = 4, 32, 16 << 10


async def main() -> None:
    prefill_kv = [
        np.random.default_rng(layer).integers(0, 255, BLOCKS * BLOCK_LEN, dtype=np.uint8) for layer in range(LAYERS)
    ]
    decode_kv = [np.zeros(BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in range(LAYERS)]
    compat = {"model": "tiny", "dtype": "bf16"}  # engines with different values refuse each other

    async with (
        TransferEngine(EngineConfig(engine_id="prefill-0", compat=compat)) as prefill,
        TransferEngine(EngineConfig(engine_id="decode-0", compat=compat)) as decode,
    ):
        prefill.register("kv", prefill_kv, block_len=BLOCK_LEN)
        decode.register("kv", decode_kv, block_len=BLOCK_LEN)
        host, port = await prefill.serve("127.0.0.1", 0)

        # decode pulls prefill blocks [7, 3, 12] into its blocks [0, 1, 2] and tells prefill it is done
        peer = await decode.connect(host, port, expected_engine_id="prefill-0", timeout=5)
        done_waiter = asyncio.ensure_future(prefill.wait_notifications(b"req-1", count=1, timeout=5))
        result = await decode.read(peer, [0, 1, 2], [7, 3, 12], notify=b"req-1", timeout=5)
        print(f"read {result.nbytes} bytes in {result.seconds * 1e3:.2f} ms; prefill heard from {await done_waiter}")

        for layer in range(LAYERS):
            for local, remote in zip([0, 1, 2], [7, 3, 12], strict=True):
                got = decode_kv[layer][local * BLOCK_LEN : (local + 1) * BLOCK_LEN]
                assert np.array_equal(got, prefill_kv[layer][remote * BLOCK_LEN : (remote + 1) * BLOCK_LEN])
        print("every byte matches; live handles:", decode.live_handles())
    print("after close:", decode.live_handles(), prefill.live_handles())


if __name__ == "__main__":
    asyncio.run(main())
