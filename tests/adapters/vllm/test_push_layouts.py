"""Push mode with prefill blocks larger than decode's, over real NIXL, every byte checked.

vLLM's push connector takes one block-size ratio: prefill blocks holding k times decode's tokens,
each cut into k pieces written into k decode blocks. Caches have vLLM 0.32's shape (``[blocks,
heads, tokens, 2 * head_dim]`` bf16 per layer, head-major (LBHNC), FlashAttention's ``[tokens,
K|V]`` per head; MLA: ``[blocks, 1, tokens, latent]``). Decode ranks are peer processes holding
zeroed blocks (spawned once per block size and zeroed for each test); prefill ranks are engines in
this process whose caches hold the test pattern, answering each decode rank's registration by
running `push`. The registrations are what decode sends: `registrations_for` plans them from
prefill's first rank, as `receive_pushed` does. Decode's blocks are read back and checked (head,
token, K|V) against an oracle that places each token by its position in the prompt, from the
fill pattern, independently of the planner.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from nixl_async import EngineConfig, LayoutError, TransferEngine, TransferFenced, ViewSpec
from nixl_async.testing import (
    TCP_TLS,
    Checksums,
    Fill,
    PeerCommandError,
    PeerProcess,
    PeerSpec,
    WaitNotifications,
    fill_pattern,
    free_port_base,
    pattern_block,
)
from nixl_async_vllm.block_pairs import GroupBlocks
from nixl_async_vllm.kv_layout import describe_cache
from nixl_async_vllm.push_book import (
    PUSH_TOPIC,
    PushGroup,
    PushRegistration,
    decode_registration,
    push_failure_notification,
    push_notification,
)
from nixl_async_vllm.push_plan import WritePart, registrations_for, write_parts
from nixl_async_vllm.push_worker import WRITE_MARGIN_S, PushFailed, _landed, push, push_or_tell, receive_pushed
from nixl_async_vllm.settings import rank_engine_id
from nixl_async_vllm.tp_mapping import remote_ranks
from nixl_async_vllm.worker import KVGeometry, RecvJob, connect_job_rank

LAYERS, HEADS, HEAD_DIM, DECODE_BLOCK_SIZE = 2, 4, 8, 4
DECODE_BLOCKS, PREFILL_BLOCKS = 40, 24  # blocks in each side's cache
MLA_ROW = 64  # one latent per token, bf16
MAX_DECODE_RANKS = 2
_names = itertools.count()


@dataclass(frozen=True)
class Case:
    tp_p: int
    tp_d: int
    ratio: int  # prefill block size / decode block size
    mla: bool = False
    blocks: int = 7  # decode blocks of the request (after its prefix hit)
    hit: int | None = None  # decode's prefix hit in its blocks (vLLM's push scheduler does not tell it: None)
    heads: int = HEADS
    head_dim: int = HEAD_DIM
    block_size: int | None = None  # decode's; by default, what makes every decode block 512 bytes (one pool)
    decode_cache_blocks: int = DECODE_BLOCKS

    @property
    def backend(self) -> str:
        return "TRITON_MLA" if self.mla else "FLASH_ATTN"

    @property
    def decode_block_size(self) -> int:
        if self.block_size is not None:
            return self.block_size
        return 2 * DECODE_BLOCK_SIZE if self.mla else DECODE_BLOCK_SIZE * self.tp_d

    @property
    def prefill_block_size(self) -> int:
        return self.decode_block_size * self.ratio

    @property
    def kv_heads(self) -> int:
        return 1 if self.mla else self.heads

    def rank_heads(self, tp: int) -> int:
        return self.heads // tp

    def row(self) -> int:
        """Bytes one token adds to one head slot: K and V (bf16), or the MLA latent."""
        return MLA_ROW if self.mla else 4 * self.head_dim

    def shape(self, tp: int, block_size: int, blocks: int) -> tuple[int, int, int, int]:
        heads = 1 if self.mla else self.rank_heads(tp)
        return blocks, heads, block_size, self.row() // 2

    def page(self, tp: int, block_size: int) -> int:
        _, heads, tokens, content = self.shape(tp, block_size, 1)
        return heads * tokens * content * 2

    @property
    def decode_ids(self) -> list[int]:
        """Decode's blocks of the request, scattered over its cache."""
        return [(i * 37 + 11) % self.decode_cache_blocks for i in range(self.blocks)]

    @property
    def prefill_ids(self) -> list[int]:
        """Prefill's blocks of the whole prompt (the last one partly filled unless the ratio divides)."""
        count = -(-((self.hit or 0) + self.blocks) // self.ratio)
        return [(i * 7 + 5) % PREFILL_BLOCKS for i in range(count)]


def _seed(case: Case, prefill_rank: int) -> int:
    return 100 if case.mla else 100 + prefill_rank  # the MLA latent is the same on every rank


def _geometry(case: Case, tp: int, rank: int, block_size: int, backend: str | None = None) -> KVGeometry:
    shape = case.shape(tp, block_size, 1)
    stride = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
    cache = describe_cache(backend or case.backend, "LBHNC", shape, stride, 2, num_kv_heads=shape[1], mla=case.mla)
    return KVGeometry(
        tp_size=tp, tp_rank=rank, block_size=block_size, part_len=cache.block_len, run_len=cache.run_len,
        mla=case.mla, kv_heads=case.kv_heads, head_window=cache.head_window, ratio_refusal=cache.ratio_refusal,
    )  # fmt: skip


def _job(case: Case, prefill_name: str, port: int, request_id: str) -> RecvJob:
    """Decode's job as its push worker builds it (vLLM's push scheduler gives no prefill blocks)."""
    return RecvJob(
        request_id=request_id, remote_request_id="req-p", remote_engine_id=prefill_name, host="127.0.0.1", port=port,
        remote_tp=case.tp_p, groups=(GroupBlocks("full", case.decode_ids, [], case.hit),), expires_at=None,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _prefill_block(seed: int, layer: int, block: int, page: int) -> np.ndarray:
    return pattern_block(seed, layer, block, page)


def _expected(case: Case, decode_rank: int, layer: int, index: int) -> np.ndarray:
    """Bytes of decode rank `decode_rank`'s `index`-th block of the request, placed by token position."""
    bs_d, bs_p = case.decode_block_size, case.prefill_block_size
    first_token = ((case.hit or 0) + index) * bs_d  # in the prompt
    block, token = divmod(first_token, bs_p)  # a decode block lies inside one prefill block
    source = case.prefill_ids[block]
    page_p = case.page(case.tp_p, bs_p)
    if case.mla:
        src = _prefill_block(_seed(case, 0), layer, source, page_p).reshape(bs_p, MLA_ROW)
        return src[token : token + bs_d].reshape(-1)
    heads_p, heads_d = case.rank_heads(case.tp_p), case.rank_heads(case.tp_d)
    out = np.zeros((heads_d, bs_d, 2, 2 * case.head_dim), np.uint8)  # (head, token, K|V, bytes)
    for h in range(heads_d):
        prefill_rank, head = divmod(decode_rank * heads_d + h, heads_p)  # by the model's head index
        src = _prefill_block(_seed(case, prefill_rank), layer, source, page_p)
        out[h] = src.reshape(heads_p, bs_p, 2, 2 * case.head_dim)[head, token : token + bs_d]
    return out.reshape(-1)


# -- the two sides -------------------------------------------------------------------------------
class DecodePool:
    """Decode ranks: peer processes with zeroed blocks, spawned once per block size and transport."""

    def __init__(self) -> None:
        self.peers: dict[tuple[int, int, bool], list[PeerProcess]] = {}

    async def take(self, case: Case, count: int, *, tcp: bool = False) -> list[PeerProcess]:
        page = case.page(case.tp_d, case.decode_block_size)
        have = self.peers.setdefault((page, case.decode_cache_blocks, tcp), [])
        spawn = max(count, 1 if tcp else MAX_DECODE_RANKS) - len(have)  # at once: their start-ups overlap
        fresh = [
            PeerProcess(
                PeerSpec(engine_id=f"push-decode-{page}-{len(have) + i}{'-tcp' if tcp else ''}", num_regions=LAYERS,
                         num_blocks=case.decode_cache_blocks, block_len=page, seed=None),
                env={"UCX_TLS": TCP_TLS} if tcp else None,
            )
            for i in range(spawn)
        ]  # fmt: skip
        have += fresh
        await asyncio.gather(*(peer.astart() for peer in fresh))
        taken = have[:count]
        await asyncio.gather(*(peer.request(Fill(seed=None)) for peer in taken))  # zeroed for this test
        return taken


@pytest.fixture(scope="module")
def decode_pool() -> Iterator[DecodePool]:
    pool = DecodePool()
    yield pool
    with concurrent.futures.ThreadPoolExecutor() as stopping:
        list(stopping.map(lambda peer: peer.stop(timeout=5.0), itertools.chain(*pool.peers.values())))


@dataclass
class Prefill:
    name: str
    port: int
    engines: list[TransferEngine]
    geometries: list[KVGeometry]


@contextlib.asynccontextmanager
async def _prefill(case: Case, backend: str | None = None, block_size: int | None = None,
                   **config: Any) -> AsyncIterator[Prefill]:  # fmt: skip
    """Prefill ranks in this process: caches filled with the pattern, serving at port + rank (EngineConfig `config`)."""
    name, port = f"push-prefill-{next(_names)}", free_port_base(case.tp_p)
    block_size = block_size or case.prefill_block_size
    async with contextlib.AsyncExitStack() as stack:
        engines, geometries = [], []
        for p in range(case.tp_p):
            caches = [torch.zeros(case.shape(case.tp_p, block_size, PREFILL_BLOCKS), dtype=torch.bfloat16)
                      for _ in range(LAYERS)]  # fmt: skip
            fill_pattern([c.view(torch.uint8).numpy().reshape(-1) for c in caches], _seed(case, p))
            engine = await stack.enter_async_context(TransferEngine(EngineConfig(engine_id=rank_engine_id(name, p),
                                                                                 **config)))  # fmt: skip
            engine.register("kv", caches, num_blocks=PREFILL_BLOCKS)
            engine.set_extra(block_size=str(block_size))
            await engine.serve("127.0.0.1", port + p)
            engines.append(engine)
            geometries.append(_geometry(case, case.tp_p, p, block_size, backend))
        yield Prefill(name, port, engines, geometries)


async def _plan(
    case: Case, inspector: Inspector, prefill: Prefill, decode: list[PeerProcess], request_id: str
) -> list[list[tuple[int, PushRegistration]]]:
    """Each decode rank's registrations, as decode plans them from prefill's first rank."""
    out = []
    for d, peer in enumerate(decode):
        geometry = _geometry(case, case.tp_d, d, case.decode_block_size)
        job = _job(case, prefill.name, prefill.port, request_id)
        first = await connect_job_rank(inspector.engine, job, remote_ranks(local_tp=case.tp_d, local_rank=d,
                                                                    remote_tp=case.tp_p)[0])  # fmt: skip
        out.append(registrations_for(geometry, job, first, decode_engine_id=peer.engine_id,
                                     decode_address=peer.address, write_by=time.time() + 30))  # fmt: skip
    return out


@dataclass
class Inspector:
    """An engine here that plans as decode would (`first`) and reads decode's blocks back (into `back`)."""

    engine: TransferEngine
    back: list[np.ndarray]

    async def fetch(self, peer: PeerProcess) -> list[np.ndarray]:
        """Decode rank `peer`'s whole cache: per layer, (block, bytes)."""
        remote = await self.engine.connect(*peer.address)
        ids = list(range(len(self.back[0]) // remote.layout("kv").block_len))
        await self.engine.read(remote, ids, ids, local="back", remote="kv")
        return [region.reshape(len(ids), -1).copy() for region in self.back]


@contextlib.asynccontextmanager
async def _inspector(case: Case) -> AsyncIterator[Inspector]:
    async with TransferEngine(EngineConfig(engine_id=f"push-inspector-{next(_names)}")) as engine:
        page = case.page(case.tp_d, case.decode_block_size)
        back = [np.zeros(case.decode_cache_blocks * page, np.uint8) for _ in range(LAYERS)]
        engine.register("back", back, block_len=page)
        yield Inspector(engine, back)


def _check_bytes(case: Case, rank: int, caches: list[np.ndarray]) -> None:
    for layer, cache in enumerate(caches):
        for i, block in enumerate(case.decode_ids):
            assert np.array_equal(cache[block], _expected(case, rank, layer, i)), (rank, layer, i)
        untouched = [b for b in range(case.decode_cache_blocks) if b not in case.decode_ids]
        assert not cache[untouched].any(), "blocks outside the request must stay untouched"


# -- every byte in place -------------------------------------------------------------------------
CASES = [
    Case(1, 1, 2),  # 7 decode blocks: the last prefill block holds one of its two pieces
    Case(1, 1, 4),
    Case(1, 2, 2),
    Case(1, 2, 4, blocks=6),
    Case(2, 1, 2),
    Case(2, 1, 4, blocks=8),  # every prefill block full
    Case(1, 1, 2, mla=True),
    Case(2, 1, 2, mla=True, blocks=5),  # decode reads prefill rank 0; rank 1 only frees
    Case(1, 1, 4, blocks=6, hit=3),  # decode's prefix hit ends inside a prefill block
    Case(1, 2, 2, blocks=5, hit=1),
]


def _case_id(case: Case) -> str:
    hit = "" if case.hit is None else f"-hit{case.hit}"
    return f"{'mla-' if case.mla else ''}p{case.tp_p}-d{case.tp_d}-ratio{case.ratio}-blocks{case.blocks}{hit}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
async def test_each_prefill_block_lands_cut_into_decode_blocks(decode_pool, case):
    decode = await decode_pool.take(case, case.tp_d)
    request_id = f"req-d-{next(_names)}"
    async with _prefill(case) as prefill, _inspector(case) as inspector:
        plans = await _plan(case, inspector, prefill, decode, request_id)
        pushes = [
            push(prefill.engines[rank], prefill.geometries[rank], (case.prefill_ids,), registration)
            for registrations in plans for rank, registration in registrations if registration.write
        ]  # fmt: skip
        results = await asyncio.gather(*pushes)
        assert all(r.nbytes for r in results)
        heard = []
        for d, (peer, registrations) in enumerate(zip(decode, plans, strict=True)):
            writers = [rank for rank, registration in registrations if registration.write]
            assert writers, "some prefill rank writes to every decode rank"
            for rank in writers:
                message = push_notification(request_id, rank)
                assert await peer.request(WaitNotifications(message=message, count=1, timeout=10)) == [
                    rank_engine_id(prefill.name, rank)
                ]
                heard.append(peer.request(WaitNotifications(message=message, count=1, timeout=0.2)))
            _check_bytes(case, d, await inspector.fetch(peer))
        for again in await asyncio.gather(*heard, return_exceptions=True):  # exactly once: no second one
            assert isinstance(again, PeerCommandError) and "NotificationTimeout" in str(again), again


async def test_receive_pushed_registers_and_returns_once_every_cut_block_landed():
    """Both sides in this process: decode runs `receive_pushed`, prefill answers its registrations."""
    case = Case(1, 2, 4, blocks=7)
    async with _prefill(case) as prefill, contextlib.AsyncExitStack() as stack:
        pushes: list[asyncio.Task] = []
        engine, geometry = prefill.engines[0], prefill.geometries[0]

        def answer(_sender: str, payload: bytes) -> bytes:
            registration = decode_registration(payload)
            if registration.write:
                pushes.append(asyncio.get_running_loop().create_task(push(engine, geometry, (case.prefill_ids,),
                                                                          registration)))  # fmt: skip
            return b"ok"

        engine.handle_calls(PUSH_TOPIC, answer)
        caches, waits = [], []
        for d in range(case.tp_d):
            decode = await stack.enter_async_context(TransferEngine(EngineConfig(engine_id=f"push-decode-e2e/tp{d}")))
            mine = [torch.zeros(case.shape(case.tp_d, case.decode_block_size, DECODE_BLOCKS), dtype=torch.bfloat16)
                    for _ in range(LAYERS)]  # fmt: skip
            decode.register("kv", mine, num_blocks=DECODE_BLOCKS)
            address = await decode.serve("127.0.0.1", 0)
            job = _job(case, prefill.name, prefill.port, "req-d")
            waits.append(receive_pushed(decode, _geometry(case, case.tp_d, d, case.decode_block_size), job, address,
                                        deadline=time.time() + 20, margin_s=2.0))  # fmt: skip
            caches.append(mine)
        await asyncio.gather(*waits)
        assert len(pushes) == case.tp_d
        await asyncio.gather(*pushes)
    for d, mine in enumerate(caches):
        _check_bytes(case, d, [c.view(torch.uint8).numpy().reshape(DECODE_BLOCKS, -1) for c in mine])


async def test_decode_fails_at_once_when_a_prefill_of_the_earlier_protocol_answers_gone():
    """Prefill no longer answers "gone" (it waits a lease for a retry, then tells); one not upgraded yet
    still does, and a decode that ignored that answer would wait out its whole deadline."""
    case = Case(1, 1, 1, blocks=2)
    async with _prefill(case) as prefill, TransferEngine(EngineConfig(engine_id="push-decode-gone")) as decode:
        prefill.engines[0].handle_calls(PUSH_TOPIC, lambda _sender, _payload: b"gone")
        decode.register("kv", [torch.zeros(case.shape(1, case.decode_block_size, DECODE_BLOCKS), dtype=torch.bfloat16)
                               for _ in range(LAYERS)], num_blocks=DECODE_BLOCKS)  # fmt: skip
        address = await decode.serve("127.0.0.1", 0)
        job = _job(case, prefill.name, prefill.port, "req-gone")
        started = time.monotonic()
        with pytest.raises(PushFailed, match="no longer holds"):
            await receive_pushed(decode, _geometry(case, 1, 0, case.decode_block_size), job, address,
                                 deadline=time.time() + 20, margin_s=2.0)  # fmt: skip
        assert time.monotonic() - started < 5


# -- the notification comes once, after every part's data (UCX over TCP: data in flight) ---------
BIG = Case(1, 1, 4, blocks=62, head_dim=128, block_size=64, decode_cache_blocks=64)  # 16 MiB in 8 WRITEs


def _sums(case: Case) -> list[list[int]]:
    """What decode's blocks of the request must checksum to, per layer."""
    return [[zlib.crc32(_expected(case, 0, layer, i).data) for i in range(case.blocks)] for layer in range(LAYERS)]


async def test_decode_hears_a_push_once_and_only_after_all_its_parts(monkeypatch, decode_pool):
    monkeypatch.setenv("UCX_TLS", TCP_TLS)  # read when the agents' UCX workers are created
    (decode,) = await decode_pool.take(BIG, 1, tcp=True)
    async with _prefill(BIG) as prefill, _inspector(BIG) as inspector:
        ((rank, registration),) = (await _plan(BIG, inspector, prefill, [decode], "req-big"))[0]
        engine = prefill.engines[0]
        assert len(write_parts(prefill.geometries[0], (BIG.prefill_ids,), registration)) == 8  # 4 heads x 2 groups
        started, notifying = [], []
        plain_start = engine.start_write

        async def start_write(*args, notify=None, **kwargs):
            if notify is not None:  # every other part must have completed by now
                notifying.append(all(t.done() and t.exception() is None for t in started))
            transfer = await plain_start(*args, notify=notify, **kwargs)
            started.append(transfer)
            return transfer

        monkeypatch.setattr(engine, "start_write", start_write)
        pushing = asyncio.create_task(push(engine, prefill.geometries[0], (BIG.prefill_ids,), registration))
        message = push_notification("req-big", rank)
        assert await decode.request(WaitNotifications(message=message, count=1, timeout=20)) == [engine.engine_id]
        landed = await decode.request(Checksums(blocks=BIG.decode_ids))  # at once: nothing may still be on its way
        result = await pushing
        assert landed == _sums(BIG)
        assert notifying == [True] and len(started) == 8
        assert result.nbytes == LAYERS * BIG.blocks * BIG.page(1, BIG.decode_block_size)
        with pytest.raises(PeerCommandError, match="NotificationTimeout"):
            await decode.request(WaitNotifications(message=message, count=1, timeout=0.3))


async def test_a_failed_part_settles_the_others_and_decode_is_never_notified(monkeypatch, decode_pool):
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    (decode,) = await decode_pool.take(BIG, 1, tcp=True)
    async with _prefill(BIG) as prefill, _inspector(BIG) as inspector:
        ((rank, registration),) = (await _plan(BIG, inspector, prefill, [decode], "req-fail"))[0]
        engine = prefill.engines[0]
        plain_start = engine.start_write
        calls = itertools.count()

        async def start_write(*args, **kwargs):
            if next(calls) == 2:  # two parts are under way
                async with asyncio.timeout(10):
                    while not engine.live_handles().get("xfers"):  # posted: bytes on the wire (before: not yet)
                        await asyncio.sleep(0)
                raise RuntimeError("injected: the third part cannot start")
            return await plain_start(*args, **kwargs)

        monkeypatch.setattr(engine, "start_write", start_write)
        with pytest.raises(RuntimeError, match="injected"):
            await push(engine, prefill.geometries[0], (BIG.prefill_ids,), registration)
        assert engine.live_handles().get("xfers", 0) == 0, "push raised while NIXL still held a WRITE"
        ended = await decode.request(Checksums(blocks=BIG.decode_ids))
        with pytest.raises(PeerCommandError, match="NotificationTimeout"):
            await decode.request(WaitNotifications(message=push_notification("req-fail", rank), count=1, timeout=0.5))
        assert await decode.request(Checksums(blocks=BIG.decode_ids)) == ended, "bytes landed after the push failed"


@pytest.mark.parametrize(("landed_notice", "a_write_errs"), [(True, False), (True, True), (False, False)],
                         ids=["told-landed", "a-write-ended-in-error", "older-decode"])  # fmt: skip
async def test_decode_hears_a_failed_push_and_gives_up_without_waiting_for_write_by(monkeypatch, landed_notice,
                                                                                  a_write_errs):  # fmt: skip
    """Prefill's push fails partway (UCX over TCP, WRITEs in flight): it settles its WRITEs, then
    tells decode, which fails the request, not at ``write_by`` a minute away; nothing lands in
    decode's blocks after that. The WRITEs it cancelled ended DONE (their bytes are in place), so
    decode gives up at once; where NIXL ended a WRITE in error (injected: its first DONE is reported
    ERR), or the registration did not ask to hear that (an older decode), decode waits
    `WRITE_MARGIN_S` for bytes such a WRITE may have sent."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)  # read when the agents' UCX workers are created
    async with _prefill(BIG) as prefill, contextlib.AsyncExitStack() as stack:
        engine, geometry = prefill.engines[0], prefill.geometries[0]
        plain_start, calls, pushes = engine.start_write, itertools.count(), []

        async def start_write(*args, **kwargs):
            if next(calls) == 2:  # two parts are under way
                async with asyncio.timeout(10):
                    while not engine.live_handles().get("xfers"):  # posted: bytes on the wire (before: not yet)
                        await asyncio.sleep(0)
                raise RuntimeError("injected: the third part cannot start")
            return await plain_start(*args, **kwargs)

        monkeypatch.setattr(engine, "start_write", start_write)
        if a_write_errs:
            agent, errs = engine._agent, [True]
            plain_state = agent.state

            def state(handle):
                answer = plain_state(handle)
                return "ERR" if answer == "DONE" and errs and errs.pop() else answer

            monkeypatch.setattr(agent, "state", state)

        def answer(_sender: str, payload: bytes) -> bytes:
            registration = msgspec.structs.replace(decode_registration(payload), landed_notice=landed_notice)
            pushes.append(asyncio.get_running_loop().create_task(
                push_or_tell(engine, geometry, (BIG.prefill_ids,), registration)))  # fmt: skip
            return b"ok"

        engine.handle_calls(PUSH_TOPIC, answer)
        decode = await stack.enter_async_context(TransferEngine(EngineConfig(engine_id="push-decode-told")))
        mine = [torch.zeros(BIG.shape(1, BIG.decode_block_size, BIG.decode_cache_blocks), dtype=torch.bfloat16)
                for _ in range(LAYERS)]  # fmt: skip
        decode.register("kv", mine, num_blocks=BIG.decode_cache_blocks)
        address = await decode.serve("127.0.0.1", 0)
        job = _job(BIG, prefill.name, prefill.port, "req-told")
        began = time.monotonic()
        with pytest.raises(PushFailed):
            await receive_pushed(decode, _geometry(BIG, 1, 0, BIG.decode_block_size), job, address,
                                 deadline=time.time() + 60, margin_s=2.0)  # fmt: skip
        took = time.monotonic() - began
        if landed_notice and not a_write_errs:
            assert took < 1.0, f"decode gave up after {took:.1f}s"
        else:
            assert WRITE_MARGIN_S <= took < WRITE_MARGIN_S + 10, f"decode gave up after {took:.1f}s"
        with pytest.raises(RuntimeError, match="injected"):
            await pushes[0]
        assert not a_write_errs or not errs, "no WRITE was seen ending, so none ended in error"
        ended = [c.clone() for c in mine]
        await asyncio.sleep(0.5)  # decode's poller keeps progressing UCX meanwhile
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ended, mine, strict=True)), (
            "bytes landed after decode gave up"
        )  # (bytes: bf16 NaNs compare unequal)


def test_only_the_ucx_backend_s_done_says_a_write_landed():
    """The landed notice rests on NIXL's UCX backend flushing the endpoint before a WRITE is DONE; another
    backend's DONE may be local completion, so its pushes keep decode's margin."""
    ended, errored = SimpleNamespace(quiet=True, slices_errored=0), SimpleNamespace(quiet=True, slices_errored=1)
    ucx = SimpleNamespace(config=EngineConfig(engine_id="ucx"))
    mixed = SimpleNamespace(config=EngineConfig(engine_id="mixed", backends=("UCX", "LIBFABRIC")))
    assert _landed(ucx, [ended, ended]) and _landed(ucx, [])  # (nothing posted: nothing can land)
    assert not _landed(ucx, [ended, errored])
    assert not _landed(mixed, [ended]) and not _landed(mixed, [])


ONE = Case(1, 1, 1, blocks=24, head_dim=128, block_size=256, decode_cache_blocks=24)  # 24 MiB in one WRITE


async def test_a_cancelled_push_tells_decode_only_once_nixl_let_go_of_its_write(monkeypatch, decode_pool):
    """A push of one WRITE cancelled in flight (prefill's lease ran out), with no grace: the WRITE is
    fenced at once and the cancelled task resumes then. Decode must hear of the failure only once
    NIXL holds the WRITE no more: told earlier, it would hand back blocks the WRITE still fills."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    (decode,) = await decode_pool.take(ONE, 1, tcp=True)
    async with _prefill(ONE, release_grace_s=0.0) as prefill, _inspector(ONE) as inspector:
        ((rank, registration),) = (await _plan(ONE, inspector, prefill, [decode], "req-cancelled"))[0]
        engine, geometry = prefill.engines[0], prefill.geometries[0]
        assert len(write_parts(geometry, (ONE.prefill_ids,), registration)) == 1
        writes_held_when_told = []
        plain_notify = engine.notify

        async def notify(peer, message):
            writes_held_when_told.append(engine.live_handles().get("xfers", 0))
            await plain_notify(peer, message)

        monkeypatch.setattr(engine, "notify", notify)
        pushing = asyncio.create_task(push_or_tell(engine, geometry, (ONE.prefill_ids,), registration))
        while not engine.live_handles().get("xfers"):  # the WRITE is posted
            await asyncio.sleep(0)
        pushing.cancel()
        with pytest.raises((asyncio.CancelledError, TransferFenced)) as info:
            await pushing
        if isinstance(info.value, TransferFenced):  # still held after the settle: nothing said
            assert writes_held_when_told == []
            return
        assert writes_held_when_told == [0], "decode was told while NIXL still held the WRITE"
        # (cancelled, not failed: the WRITE ended DONE, its bytes in place; decode's plan asked to hear that)
        told = push_failure_notification("req-cancelled", rank, registration.write_by, landed=True)
        assert await decode.request(WaitNotifications(message=told, count=1, timeout=10)) == [engine.engine_id]


async def test_a_push_stopped_after_its_notifying_write_went_out_tells_decode_no_failure(monkeypatch, decode_pool):
    """The one WRITE, carrying decode's notice, is out with decode paused (SIGSTOP) when the push is
    cancelled; decode resumes and the WRITE lands: decode hears that it landed, and no failure notice
    after it (before: the WRITE ended cancelled and decode was also told the push failed)."""
    monkeypatch.setenv("UCX_TLS", TCP_TLS)
    (decode,) = await decode_pool.take(ONE, 1, tcp=True)
    async with _prefill(ONE, min_post_bytes=64 << 20) as prefill, _inspector(ONE) as inspector:  # one slice
        ((rank, registration),) = (await _plan(ONE, inspector, prefill, [decode], "req-stopped"))[0]
        engine, geometry = prefill.engines[0], prefill.geometries[0]
        pushing = asyncio.create_task(push_or_tell(engine, geometry, (ONE.prefill_ids,), registration))
        while not engine.live_handles().get("xfers"):  # the WRITE is posted
            await asyncio.sleep(0)
        decode.pause()
        try:
            pushing.cancel()
            await asyncio.sleep(0.3)
        finally:
            decode.resume()
        with pytest.raises(asyncio.CancelledError):
            await pushing
        landed = push_notification("req-stopped", rank)
        assert await decode.request(WaitNotifications(message=landed, count=1, timeout=10)) == [engine.engine_id]
        failed = push_failure_notification("req-stopped", rank, registration.write_by, landed=True)
        with pytest.raises(PeerCommandError, match="NotificationTimeout"):
            await decode.request(WaitNotifications(message=failed, count=1, timeout=1.0))


# -- refused before anything is sent or written --------------------------------------------------
async def _receive_refused(case: Case, prefill: Prefill, backend: str | None = None) -> None:
    """Run `receive_pushed` for decode rank 0 against `prefill`, which must get no registration."""
    got: list[PushRegistration] = []
    for engine in prefill.engines:
        engine.handle_calls(PUSH_TOPIC, lambda _sender, payload: got.append(decode_registration(payload)) or b"ok")
    async with TransferEngine(EngineConfig(engine_id=f"push-decode-refused-{next(_names)}")) as decode:
        address = await decode.serve("127.0.0.1", 0)
        geometry = _geometry(case, case.tp_d, 0, case.decode_block_size, backend)
        job = _job(case, prefill.name, prefill.port, "req-refused")
        try:
            await receive_pushed(decode, geometry, job, address, deadline=time.time() + 5, margin_s=1.0)
        finally:
            assert got == [], "decode registered before refusing"


def _registration(decode: PeerProcess, case: Case, decode_block_size: int) -> PushRegistration:
    host, port = decode.address
    return PushRegistration(
        request_id="req-p", decode_request_id="req-refused", decode_engine_id=decode.engine_id, decode_host=host,
        decode_port=port, decode_tp=case.tp_d, decode_pages=1, groups=[PushGroup("full", case.decode_ids)],
        write=True, write_by=time.time() + 30, decode_block_size=decode_block_size,
    )  # fmt: skip


async def _nothing_written(decode: PeerProcess, case: Case) -> None:
    zero = zlib.crc32(bytes(case.page(case.tp_d, case.decode_block_size)))
    sums = await decode.request(Checksums(blocks=list(range(case.decode_cache_blocks))))
    assert sums == [[zero] * case.decode_cache_blocks] * LAYERS, "decode's blocks were written"
    with pytest.raises(PeerCommandError, match="NotificationTimeout"):
        await decode.request(WaitNotifications(message=push_notification("req-refused", 0), count=1, timeout=0.2))


async def test_a_ratio_into_the_cpu_backend_is_refused_on_both_sides_before_anything_moves(decode_pool):
    # The CPU backend stores each head's K per ISA (transposed or tiled): a block cannot be cut by token runs.
    case = Case(1, 1, 2)
    (decode,) = await decode_pool.take(case, 1)
    async with _prefill(case, backend="CPU_ATTN") as prefill:
        with pytest.raises(LayoutError, match="CPU backend"):
            await _receive_refused(case, prefill, backend="CPU_ATTN")
        with pytest.raises(LayoutError, match="CPU backend"):
            await push(prefill.engines[0], prefill.geometries[0], (case.prefill_ids,),
                       _registration(decode, case, case.decode_block_size))  # fmt: skip
    await _nothing_written(decode, case)


async def test_prefill_blocks_smaller_than_decodes_are_refused_on_both_sides(decode_pool):
    # vLLM's push connector takes none either; pull mode reads them.
    case = Case(1, 1, 2)
    (decode,) = await decode_pool.take(case, 1)
    async with _prefill(case, block_size=case.decode_block_size // 2) as prefill:
        with pytest.raises(LayoutError, match="smaller than decode's"):
            await _receive_refused(case, prefill)
        with pytest.raises(LayoutError, match="smaller than decode's"):
            await push(prefill.engines[0], prefill.geometries[0], (case.prefill_ids,),
                       _registration(decode, case, case.decode_block_size))  # fmt: skip
    await _nothing_written(decode, case)


# -- what write_parts makes of a registration (pure) ---------------------------------------------
def _pure_registration(groups: list[PushGroup], decode_block_size: int, **views: ViewSpec) -> PushRegistration:
    return PushRegistration(
        request_id="r", decode_request_id="r-d", decode_engine_id="d/tp0", decode_host="127.0.0.1", decode_port=1,
        decode_tp=1, decode_pages=1, groups=groups, write=True, decode_block_size=decode_block_size, **views,
    )  # fmt: skip


def test_equal_block_sizes_write_once_through_the_registration_views():
    case = Case(1, 1, 1)
    geometry = _geometry(case, 1, 0, DECODE_BLOCK_SIZE)
    view = ViewSpec(chunk_offset=64, chunk_len=64)
    reg = _pure_registration([PushGroup("full", [7, 8], None)], 0, decode_view=view)
    assert write_parts(geometry, ([1, 2, 3],), reg) == [WritePart([2, 3], [7, 8], ViewSpec(), view)]
    assert write_parts(geometry, ([1, 2, 3],), msgspec.structs.replace(reg, groups=[PushGroup("full", [])])) == []


@pytest.mark.parametrize(
    ("kinds", "match"),
    [(("full", "state"), "state"), (("window",), "sliding-window"), (("full", "full"), "several KV cache groups")],
)
def test_groups_that_cannot_be_cut_are_refused_by_name(kinds, match):
    case = Case(1, 1, 2)
    geometry = replace(_geometry(case, 1, 0, case.prefill_block_size), group_kinds=kinds)
    reg = _pure_registration([PushGroup(kind, [7, 8]) for kind in kinds], DECODE_BLOCK_SIZE)
    with pytest.raises(LayoutError, match=match):
        write_parts(geometry, tuple([1] for _ in kinds), reg)


def test_decode_blocks_of_unknown_start_are_refused():
    """Without decode's prefix hit, blocks that stop short of prefill's last block cannot be placed."""
    case = Case(1, 1, 4)
    geometry = _geometry(case, 1, 0, case.prefill_block_size)
    reg = _pure_registration([PushGroup("full", [7, 8, 9, 10, 11])], DECODE_BLOCK_SIZE)
    with pytest.raises(LayoutError, match="without its prefix hit"):
        write_parts(geometry, ([1, 2, 3],), reg)  # a prompt of 3 prefill blocks fills 9 to 12 decode blocks
    assert write_parts(geometry, ([1, 2],), reg), "5 decode blocks for 2 prefill blocks: the whole prompt"


def test_a_window_group_in_other_pages_per_block_is_refused_as_decode_refuses_it():
    """Prefill in 1 kernel page per block, decode in 2, a window group: paired from the end as they stand,
    each prefill page went one page later on decode (tokens 64-127 into decode's slot for 128-191).
    Decode's own plan refuses this (no prompt length); prefill wrote it all the same."""
    geometry = KVGeometry(tp_size=1, tp_rank=0, block_size=64, part_len=4096, run_len=None, mla=False, kv_heads=2,
                          pages_per_block=1, group_kinds=("window", "full"))  # fmt: skip
    reg = PushRegistration(request_id="r", decode_request_id="r", decode_engine_id="d/tp0", decode_host="h",
                           decode_port=1, decode_tp=1, decode_pages=2, write=True, decode_block_size=64,
                           groups=[PushGroup("window", [20, 21], None), PushGroup("full", [30, 31], 0)])  # fmt: skip
    with pytest.raises(LayoutError, match="sliding-window group in blocks of 2 pages"):
        write_parts(geometry, ([11, 12], [10, 11, 12]), reg)
