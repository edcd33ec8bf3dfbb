"""Push mode, worker side: decode registers its blocks, prefill WRITEs the KV into them.

Everything that touches the network is a coroutine on the engine's loop; vLLM's worker thread
only hands work over (`start_load_kv`) and collects what ended (`get_transfer_results`).

Decode (`receive_pushed`): for each request vLLM allocated, connect to the prefill ranks it
needs, plan from their layout as in pull mode, and register with each (an acknowledged call
carrying the plan's views and decode's block ids). Then wait for each writing rank's WRITE
notification, which NIXL delivers after the WRITE's data. Registrations carry ``write_by``
(decode's wall clock): prefill starts no WRITE after it, and cancels one still running then.
Decode gives up only at ``write_by`` plus a margin, so when vLLM hears a request failed and
reuses its blocks, no WRITE can still land in them.

Prefill: registrations (answered on the loop) and finished requests (from vLLM's metadata)
meet in a `PushBook`; each match runs `push` as a request of the sync facade, so its result is
reported only once NIXL holds none of its transfers. A request's blocks go back to vLLM when
every decode rank's push ended, or its lease ran out and no push still reads them.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

from nixl_async import FinishedRequests, LayoutError, LeaseExpired, TransferEngine, TransferResult, ViewSpec

from .block_pairs import GroupBlocks, in_kernel_pages, pair_blocks
from .push_book import (
    GONE,
    PUSH_TOPIC,
    PushBook,
    PushGroup,
    PushRegistration,
    decode_registration,
    encode_registration,
    push_notification,
)
from .settings import connect_rank
from .tp_mapping import expected_consumers, remote_ranks
from .worker import ConnectorWorker, KVGeometry, RecvJob, connect_job_rank, plan_request

__all__ = ["PushConnectorWorker", "push", "receive_pushed"]

log = logging.getLogger(f"vllm.{__name__}")

PUSH_ID = "push>"  # facade request ids of prefill's pushes: "push>{request}>{decode engine}"


class PushRefused(LeaseExpired):
    """Prefill no longer holds the request (freed before decode registered): nothing will be written."""


class PushConnectorWorker(ConnectorWorker):
    TRANSFER_MODE = "push"

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._book = PushBook()
        # running push -> (its prefill request, decode ranks reading this rank); both threads, under the lock
        self._push_ids: dict[str, tuple[str, int]] = {}
        self._push_lock = threading.Lock()
        self._cancelled: set[str] = set()  # pushes cancelled because their request's lease ran out
        self.sync.handle_calls(PUSH_TOPIC, self._answer_registration)

    # -- decode ----------------------------------------------------------------------------
    def _start_receive(self, request_id: str, req: Any) -> None:
        if req.remote is None:
            return
        job = self._recv_job(request_id, req, None)  # no lease: prefill writes when it is done
        if job.local_blocks:  # vLLM waits for it (an empty one only lets prefill free the request)
            self._awaiting[request_id] = job.local_blocks
        deadline = time.time() + self.settings.push_registration_timeout_s
        try:
            self.sync.submit(request_id, self._receive_pushed, job, deadline)
        except ValueError:
            log.warning("request %s is already being received; ignoring the repeat", request_id)

    async def _receive_pushed(self, engine: TransferEngine, job: RecvJob, deadline: float) -> None:
        if self.geometry is None:
            raise LayoutError("register_kv_caches() has not run")
        await receive_pushed(engine, self.geometry, job, self.address, deadline=deadline,
                             margin_s=engine.config.release_grace_s + WRITE_MARGIN_S)  # fmt: skip

    # -- prefill ---------------------------------------------------------------------------
    def start_load_kv(self, metadata: Any) -> None:
        super().start_load_kv(metadata)
        if metadata is None:
            return
        for request_id, blocks in getattr(metadata, "push_finished_blocks", {}).items():
            grouped = tuple(list(map(int, g)) for g in blocks)
            for registration in self._book.finished(request_id, grouped):
                self._start_push(request_id, grouped, registration)

    def _answer_registration(self, _sender: str, payload: bytes) -> bytes:
        registration = decode_registration(payload)  # a malformed one raises ValueError: refused
        match = self._book.register(registration)
        if match == GONE:
            return GONE.encode()
        if isinstance(match, tuple):
            self._start_push(match[0], match[1], registration)
        return b"ok"

    def _start_push(self, request_id: str, blocks: tuple[list[int], ...], registration: PushRegistration) -> None:
        if not registration.write:  # decode reads nothing from this rank: it only lets it free
            self._served(request_id, self._readers(registration))
            return
        push_id = f"{PUSH_ID}{request_id}>{registration.decode_engine_id}"
        with self._push_lock:
            repeat = push_id in self._push_ids
            if not repeat:
                self._push_ids[push_id] = (request_id, self._readers(registration))
        if repeat:  # the same decode rank registered twice: the push under way serves it
            self._book.ended(request_id)
            return
        self.sync.submit(push_id, self._push, blocks, registration)

    async def _push(self, engine: TransferEngine, blocks: tuple[list[int], ...], reg: PushRegistration) -> None:
        if self.geometry is None:
            raise LayoutError("register_kv_caches() has not run")
        result = await push(engine, self.geometry, blocks, reg)
        self._results.put(result)

    def _readers(self, registration: PushRegistration) -> int:
        return expected_consumers(remote_tp=self.tp_size, local_tp=registration.decode_tp)

    def _served(self, request_id: str, readers: int) -> None:
        """One more of the `readers` decode ranks of `request_id` is served (or its push failed)."""
        self._sends.notified(f"{request_id}:{readers}".encode())
        self._book.ended(request_id)

    def _own_finished(self, finished: FinishedRequests) -> FinishedRequests:
        """Take prefill's pushes out of what the facade reports: they count toward freeing blocks."""
        for push_id in [r for r in (*finished.done, *finished.failed, *finished.fenced) if r.startswith(PUSH_ID)]:
            if push_id in finished.fenced:
                log.warning("push %s ended but NIXL still holds its WRITE: its blocks stay held", push_id)
                finished.fenced.pop(push_id)
                continue
            error = finished.failed.pop(push_id, None)
            finished.done.discard(push_id)
            with self._push_lock:
                entry = self._push_ids.pop(push_id, None)
            self._cancelled.discard(push_id)
            if entry is None:
                continue
            if error is not None:
                log.warning("push %s failed: %s: %s", push_id, type(error).__name__, error)
                self._record("num_failed_transfers", 1)
            self._served(*entry)
        return finished

    def _release(self, request_id: str) -> bool:
        return self._book.release(request_id)

    def _finished_sending(self) -> set[str]:
        for request_id in self._book.closing():  # lease ran out while a push reads the blocks: stop it
            with self._push_lock:
                running = [p for p, (r, _) in self._push_ids.items() if r == request_id and p not in self._cancelled]
            for push_id in running:
                self._cancelled.add(push_id)
                self.sync.cancel(push_id)
        for registration in self._book.expire(time.time()):
            log.warning("registration of %s by %s was never matched before its deadline", registration.request_id,
                        registration.decode_engine_id)  # fmt: skip
        return super()._finished_sending()


WHOLE = ViewSpec()  # every byte of a block
WRITE_MARGIN_S = 2.0  # decode waits this long past `write_by` (plus the engine's release grace)


async def receive_pushed(
    engine: TransferEngine,
    geometry: KVGeometry,
    job: RecvJob,
    address: tuple[str, int],
    *,
    deadline: float,
    margin_s: float,
) -> None:
    """Decode: register `job`'s blocks with every prefill rank it needs and wait for their WRITEs.

    `deadline` is this host's wall clock. Raises `PushRefused` when prefill freed the request
    already, `LayoutError` for what push cannot place, and `NotificationTimeout` at `deadline`
    (never earlier once a registration was sent: a prefill rank may write until
    ``deadline - margin_s``).
    """
    ranks = remote_ranks(local_tp=geometry.tp_size, local_rank=geometry.tp_rank, remote_tp=job.remote_tp)
    groups = [PushGroup(g.kind, list(g.local), g.local_hit) for g in job.groups]
    write_by = deadline - margin_s

    def registration(write: bool, decode_view: ViewSpec = WHOLE, prefill_view: ViewSpec = WHOLE) -> bytes:
        return encode_registration(PushRegistration(
            request_id=job.remote_request_id, decode_request_id=job.request_id, decode_engine_id=engine.engine_id,
            decode_host=address[0], decode_port=address[1], decode_tp=geometry.tp_size,
            decode_pages=geometry.pages_per_block, groups=groups, write=write, write_by=write_by,
            decode_view=decode_view, prefill_view=prefill_view,
        ))  # fmt: skip

    if not job.local_blocks:  # nothing to receive: only let prefill free the request
        peers = await asyncio.gather(*(connect_job_rank(engine, job, rank) for rank in ranks))
        await asyncio.gather(*(engine.call(peer, PUSH_TOPIC, registration(False)) for peer in peers))
        return
    first = await connect_job_rank(engine, job, ranks[0])
    plan = plan_request(geometry, job, first)
    if plan.ratio != 1:
        raise LayoutError(f"push mode: prefill blocks {plan.ratio}x smaller than decode's are not supported "
                          "(pull mode reads them)")  # fmt: skip
    peers = await asyncio.gather(*(connect_job_rank(engine, job, step.remote_rank) for step in plan.steps))
    # Wait first: a fast WRITE's notification may arrive before the registration's reply.
    waits = [
        asyncio.ensure_future(engine.wait_notifications(push_notification(job.request_id, step.remote_rank), 1,
                                                        timeout=max(0.0, deadline - time.time())))
        for step in plan.steps if step.read
    ]  # fmt: skip
    await asyncio.sleep(0)  # the waiters are registered before anything can be written
    maybe_writing = False  # some prefill rank may have taken a registration to write
    try:
        for i, (step, peer) in enumerate(zip(plan.steps, peers, strict=True)):
            maybe_writing |= step.read  # even if the reply is lost, the registration may have arrived
            reply = await engine.call(peer, PUSH_TOPIC, registration(step.read, step.local, step.remote))
            if reply == GONE.encode():
                maybe_writing = any(s.read for s in plan.steps[:i])
                raise PushRefused(f"prefill {peer.engine_id} no longer holds request {job.remote_request_id}",
                                  peer=peer.engine_id)  # fmt: skip
        await asyncio.gather(*waits)
    except BaseException:
        for wait in waits:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        if maybe_writing:  # a rank may write until write_by: vLLM must not get the blocks back before
            await asyncio.sleep(max(0.0, deadline - time.time()))
        raise


async def push(
    engine: TransferEngine, geometry: KVGeometry, blocks: tuple[list[int], ...], reg: PushRegistration
) -> TransferResult:
    """Prefill: WRITE one request's `blocks` into what decode rank `reg` registered, with its notification."""
    peer = await connect_rank(engine, reg.decode_host, reg.decode_port, reg.decode_engine_id)
    if len(blocks) != len(reg.groups):
        raise LayoutError(f"decode registered {len(reg.groups)} KV cache groups, prefill holds {len(blocks)}")
    paged = geometry.pages_per_block > 1 or reg.decode_pages > 1
    decode_ids: list[int] = []
    prefill_ids: list[int] = []
    for group, mine in zip(reg.groups, blocks, strict=True):
        pair = GroupBlocks(group.kind, list(group.blocks), list(mine), group.hit)  # as decode sees it
        if paged:
            pair = in_kernel_pages(pair, reg.decode_pages, geometry.pages_per_block)
        theirs, ours = pair_blocks(pair, 1, paged=paged)
        decode_ids += theirs
        prefill_ids += ours
    return await engine.write(
        peer, prefill_ids, decode_ids, local=reg.prefill_view, remote=reg.decode_view,
        notify=push_notification(reg.decode_request_id, geometry.tp_rank), lease_expires_at=reg.write_by,
    )  # fmt: skip
