"""Scheduler side: vLLM's own pull scheduler, with two changes.

vLLM's `NixlPullConnectorScheduler` already implements the request semantics users rely on
(``do_remote_prefill``/``do_remote_decode``, prefix-cache hits, prompts shorter than a block,
leases on blocks held for a reader), so it is reused as is. What differs:

- no side channel here: each worker's transfer engine answers handshakes itself, at
  ``base port + tp_rank``, so `set_xfer_handshake_metadata` does nothing;
- heartbeats are packed every ``lease / 6`` seconds as vLLM does (the worker sends them as
  acknowledged calls, see `leases`);
- the producer tells the reader when its blocks expire (``remote_blocks_expiry_time``, wall
  clock), and the reader refuses a read that would land after it instead of reading blocks
  that may already belong to another request;
- each step's metadata says whether it schedules anything (``idle_step``): a worker may then
  wait for its transfers instead of returning to a loop that calls it again at once;
- a prefill offers its reader only the blocks holding computed tokens (with speculative decoding
  vLLM's also offers the lookahead slots past the prompt, which shift a reader's pairing);
- host staging (``kv_buffer_device=cpu`` on a GPU) copies, each step, every block the step wrote
  to the host copy NIXL serves. vLLM's lists only the blocks new in a step, so a block one chunk
  of a chunked prefill left part-filled was never copied again once the next chunk filled it
  (nor at all when the prompt's last chunk needed no new block): the reader got stale KV;
- push mode with ``push_progressive``: prefill's scheduler also tells its workers, every step,
  which requests for decode it computes, in which blocks and up to which token
  (``push_steps``), so they can push each layer as soon as it is computed;
- push mode, decode: a request vLLM finishes while it still waits for its push (its client went
  away) is named to the workers (``push_withdrawn``), which withdraw its registrations from
  prefill. vLLM's only word to prefill is a stub registration that reads nothing, under the
  client's own id: the registration made first stays, and its push lands in blocks decode holds
  for nobody until then (or until the watchdog).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import HeartbeatInfo
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
from vllm.v1.kv_cache_interface import AttentionSpec

from .progressive import PrefillFollower, PrefillStep
from .settings import AdapterSettings

__all__ = ["AdapterPushScheduler", "AdapterScheduler"]

log = logging.getLogger(f"vllm.{__name__}")  # under "vllm", so it shows in vLLM's log


def _adapt(scheduler: Any, settings: AdapterSettings) -> None:
    """Our settings on vLLM's scheduler: side channel address, lease, heartbeat cadence.

    The settings are read before vLLM's constructor runs: it reads some keys itself (the lease with
    ``//``, ``kv_recompute_threshold`` with ``int()``) and would fail first, naming none.
    """
    scheduler.side_channel_host = settings.side_channel_host
    scheduler.side_channel_port = settings.side_channel_port
    scheduler._kv_lease_duration = settings.lease_s
    # vLLM's integer division makes leases under 6 s heartbeat every step; keep lease / 6.
    scheduler._heartbeat_interval = settings.lease_s / 6


class _WorkersServeHandshakes:
    def set_xfer_handshake_metadata(self, metadata: Any) -> None:
        """Workers serve their own handshakes; nothing to publish from the scheduler."""


class _MarksIdleSteps:
    """Tell the workers when a step schedules nothing: vLLM steps back to back while KV is in
    flight, and such a step may wait for the transfer instead (`idle_step_wait_s`)."""

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        meta.idle_step = scheduler_output.total_num_scheduled_tokens == 0
        return meta


def _no_blocks(block_ids: Any) -> bool:
    """No block to read: none named, or (vLLM's per-group form) only empty groups. (Anything else that is not a
    list is "some", and mistyped: `_mistyped` says so.)"""
    if not isinstance(block_ids, list | tuple):
        return not block_ids
    return not block_ids or all(isinstance(group, list | tuple) and not group for group in block_ids)


def _count(value: Any, low: int, high: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value and (high is None or value <= high)


MAX_REMOTE_TP = 1024  # a producer's TP size beyond any deployment (the workers make one entry per rank)
MAX_ID_CHARS = 1024  # an engine or request id: lease renewals carry 512 request ids per call (1 MiB at most)


def _mistyped(params: dict[str, Any], groups: int) -> list[str]:
    """Fields present but of a kind the workers cannot use (a client's kv_transfer_params come as JSON:
    a flat block list or a string TP size would stop the decode worker's step)."""
    bad = [f"{key} (not a string)" for key in ("remote_engine_id", "remote_request_id", "remote_host")
           if params.get(key) is not None and not isinstance(params[key], str)]  # fmt: skip
    bad += [f"{key} (over {MAX_ID_CHARS} characters)" for key in ("remote_engine_id", "remote_request_id")
            if isinstance(params.get(key), str) and len(params[key]) > MAX_ID_CHARS]  # fmt: skip
    if params.get("tp_size") is not None and not _count(params["tp_size"], 1, MAX_REMOTE_TP):
        bad.append(f"tp_size (not an integer from 1 to {MAX_REMOTE_TP})")
    if params.get("remote_num_tokens") is not None and not _count(params["remote_num_tokens"], 0):
        bad.append("remote_num_tokens (not a token count)")
    expiry = params.get("remote_blocks_expiry_time")
    if expiry is not None and not (isinstance(expiry, int | float) and not isinstance(expiry, bool)
                                   and math.isfinite(expiry)):  # fmt: skip
        bad.append("remote_blocks_expiry_time (not a number of seconds)")
    if params.get("remote_port") is not None and not _count(params["remote_port"], 1, 65535):
        bad.append("remote_port (not a port number)")
    blocks = params.get("remote_block_ids")
    if not _no_blocks(blocks) and not (
        isinstance(blocks, list | tuple) and len(blocks) == groups
        and all(isinstance(ids, list | tuple) and all(_count(b, 0) for b in ids) for ids in blocks)
    ):  # fmt: skip
        bad.append(f"remote_block_ids (not {groups} list(s) of block ids, one per KV cache group)")
    return bad


def _lacking(params: dict[str, Any], groups: int, etcd: bool, *, blocks: bool) -> str:
    """What a request whose KV comes from a producer lacks (or mistypes) to be served ("" if nothing);
    `blocks`: the producer's block ids must be named (pull; push learns them from prefill)."""
    lacking = [key for key in ("remote_engine_id", "remote_request_id", "tp_size") if params.get(key) is None]
    lacking += [key for key in ("remote_host", "remote_port") if key not in params]  # null: found through etcd
    if blocks and _no_blocks(params.get("remote_block_ids")):
        lacking.append("remote_block_ids")
    lacking += _mistyped(params, groups)
    if not lacking and not etcd and None in (params["remote_host"], params["remote_port"]):
        lacking.append("remote_host/remote_port (or an etcd_endpoint to find the producer by id)")
    return ", ".join(lacking)


class _RefusesUnservedProducers:
    """Both schedulers: a request to receive KV that names no producer it could be served from is
    computed here, with a warning naming what it lacks."""

    kv_cache_config: Any
    settings: Any

    def _prefill_here_if_unserved(self, request: Any, *, blocks: bool) -> None:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return
        groups = len(self.kv_cache_config.transfer_group_ids)
        if lacking := _lacking(params, groups, self.settings.etcd is not None, blocks=blocks):
            log.warning("request %s: its kv_transfer_params lack (or mistype) %s: prefilling it here",
                        request.request_id, lacking)  # fmt: skip
            params["do_remote_prefill"] = False


class _StagesWrittenBlocks:
    """Host staging (``kv_buffer_device=cpu`` with CUDA caches), pull and push alike: after each step
    the workers copy to the registered host copy every block the step wrote. vLLM's schedulers copy
    only the blocks new in a step, so a block one chunk of a chunked prefill left part-filled kept
    that chunk's bytes on the host, and the reader (or decode, written to) got stale KV for the rest.
    """

    _saving: PrefillFollower
    _reqs_need_save: dict[str, Any]
    kv_cache_config: Any

    def _follow_staged(self, request: Any) -> None:
        if request.request_id in self._reqs_need_save:  # host staging, a request for decode
            self._saving.follow(request.request_id, request.num_prompt_tokens)

    def _build_save_meta(self, meta: Any, scheduler_output: Any) -> None:
        """Host staging: which blocks the workers copy to the host after this step's forward pass.

        Every block the step's tokens went into, the one an earlier chunk left part-filled
        included; in a request's first step (or once resumed) also the blocks its prefix hit
        found, as vLLM's does. A request leaves once its prompt is computed.
        """
        sizes = [group.kv_cache_spec.block_size for group in self.kv_cache_config.kv_cache_groups]
        for request_id, step, fresh in list(self._saving.steps(scheduler_output)):
            request = self._reqs_need_save.get(request_id)
            if request is None:  # aborted (vLLM's request_finished dropped it)
                self._saving.forget(request_id)
                continue
            written = tuple(blocks[0 if fresh else step.start // size : -(-step.stop // size)]
                            for blocks, size in zip(step.blocks, sizes, strict=True))  # fmt: skip
            clipped = self.get_exchange_clipped_blocks(written, clip_ssm=False)  # type: ignore[attr-defined]
            meta.add_new_req_to_save(request_id=request_id, local_block_ids=clipped,
                                     kv_transfer_params=request.kv_transfer_params)  # fmt: skip
            if step.stop >= step.prompt_len:
                self._reqs_need_save.pop(request_id, None)
                self._saving.forget(request_id)


class AdapterScheduler(
    _MarksIdleSteps,
    _RefusesUnservedProducers,
    _StagesWrittenBlocks,
    _WorkersServeHandshakes,
    NixlPullConnectorScheduler,
):
    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        self.settings = AdapterSettings.from_vllm(vllm_config)
        super().__init__(vllm_config, engine_id, kv_cache_config)
        _adapt(self, self.settings)
        self._saving = PrefillFollower()  # host staging: requests for decode still computing

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params or {}
        # vLLM 0.32 would park it waiting for KV no job ever loads (or stop its engine on an assert,
        # for empty block lists): compute it here instead.
        self._prefill_here_if_unserved(request, blocks=True)
        if params.get("do_remote_decode") and not params.get("do_remote_prefill") and params.get("remote_block_ids"):
            # A turn-2 readback (a NixlConnector decode with bidirectional_kv_xfer names the blocks it
            # kept): vLLM 0.32 would promise the load and never start it, so the request would wait
            # forever. Reading KV back from decode is not implemented: compute the prompt here.
            if not _no_blocks(params["remote_block_ids"]):
                log.warning("request %s: its kv_transfer_params ask to read KV back from decode "
                            "(bidirectional_kv_xfer, not implemented): prefilling it here",
                            request.request_id)  # fmt: skip
            del params["remote_block_ids"]
        super().on_new_request(request)
        if (self.settings.etcd is None or not params.get("do_remote_prefill")
                or request.request_id in self._heartbeat_req_engine):  # fmt: skip
            return
        # vLLM renews a producer's leases only given its address; found through etcd, its id will do.
        engine_id, remote_id, tp = (params.get(k) for k in ("remote_engine_id", "remote_request_id", "tp_size"))
        if engine_id is None or remote_id is None or tp is None:
            return
        info = self._heartbeat_by_engine.get(engine_id)
        if info is None:
            info = self._heartbeat_by_engine[engine_id] = HeartbeatInfo(
                req_ids=set(), host="", port=0, tp_size=tp, dcp_size=params.get("dcp_size", 1),
                pp_size=params.get("pp_size", 1),
            )  # fmt: skip
        info.req_ids.add(remote_id)
        self._heartbeat_req_engine[request.request_id] = (engine_id, remote_id)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        self._follow_staged(request)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        self._saving.forget(request.request_id)
        delay, params = super().request_finished(request, block_ids)
        deadline = self._reqs_need_send.get(request.request_id)
        if delay and params is not None and deadline is not None and params.get("do_remote_prefill"):
            params["remote_blocks_expiry_time"] = time.time() + (deadline - time.perf_counter())
        if delay and params is not None and params.get("do_remote_prefill"):
            tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
            if isinstance(params.get("remote_num_tokens"), int):  # (the prompt's, as the blocks: decode pairs by it)
                params["remote_num_tokens"] = min(params["remote_num_tokens"], tokens)
            computed = self._computed_blocks(tokens, block_ids)
            if computed is not None:
                params["remote_block_ids"] = computed
        return delay, params

    def _computed_blocks(self, tokens: int, block_ids: Any) -> Any:
        """The blocks to offer a reader: those holding the prompt's first `tokens` (the ones computed),
        clipped as vLLM clips; None if that is every block.

        With speculative decoding vLLM gives a prefill lookahead slots past the prompt, often a
        block more. Offered, that block ends the list: a reader pairing a sliding window from the
        end would read every block one off, and one pairing from its prefix hit would find a block
        too many (vLLM's own reader trims from the end, one off too).
        """
        cut = prompt_blocks(self.kv_cache_config.kv_cache_groups, tokens, block_ids)
        return None if cut is None else self.get_exchange_clipped_blocks(cut)


def prompt_blocks(groups: Any, tokens: int, block_ids: Any) -> tuple[list[int], ...] | None:
    """Each attention group's blocks holding the first `tokens` (state groups as they are); None if that
    is every block (no lookahead slot past them)."""
    cut = [list(ids)[: -(-tokens // group.kv_cache_spec.block_size)]
           if isinstance(group.kv_cache_spec, AttentionSpec) else list(ids)
           for ids, group in zip(block_ids, groups, strict=True)]  # fmt: skip
    if all(len(mine) == len(ids) for mine, ids in zip(cut, block_ids, strict=True)):
        return None
    return tuple(cut)


class AdapterPushScheduler(
    _MarksIdleSteps,
    _RefusesUnservedProducers,
    _StagesWrittenBlocks,
    _WorkersServeHandshakes,
    NixlPushConnectorScheduler,
):
    """vLLM's push scheduler: decode stages registrations, prefill hands over finished blocks.

    Decode's registrations also carry its prefix hit per KV cache group (vLLM's leave it out).

    With progressive push, prefill's requests for decode are followed while they compute: each
    step's metadata carries a `PrefillStep` per such request scheduled in it.
    """

    def __init__(self, vllm_config: Any, engine_id: str, kv_cache_config: Any) -> None:
        self.settings = AdapterSettings.from_vllm(vllm_config)
        super().__init__(vllm_config, engine_id, kv_cache_config)
        _adapt(self, self.settings)
        self._push_registration_timeout = self.settings.push_registration_timeout_s
        self._computing = PrefillFollower()  # prefill's requests for decode, with progressive push
        self._saving = PrefillFollower()  # host staging: requests for decode still computing
        self._awaiting_push: set[str] = set()  # decode: requests registered with prefill, not yet received
        self._to_withdraw: list[str] = []  # decode: ... that vLLM finished meanwhile (for the next metadata)
        self._held_after_abort: list[str] = []  # prefill: aborted while followed (for the next metadata)

    def on_new_request(self, request: Any) -> None:
        # vLLM 0.32's push scheduler would raise KeyError inside schedule() (or its worker on a
        # mistyped port), stopping the engine and every request in it: compute it here instead.
        self._prefill_here_if_unserved(request, blocks=False)
        super().on_new_request(request)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params or {}
        if self.settings.push_progressive and params.get("do_remote_decode"):
            self._computing.follow(request.request_id, request.num_prompt_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        self._follow_staged(request)
        staged = self._reqs_need_recv.get(request.request_id)
        if staged is None or num_external_tokens <= 0:
            return
        self._awaiting_push.add(request.request_id)
        if staged[2] == ():
            # vLLM's push scheduler leaves decode's prefix hit out; say it, so prefill places decode's
            # blocks exactly (with a block-size ratio their start cannot be told from their count).
            hits = tuple(sum(b.block_hash is not None and not b.is_null for b in group) for group in blocks.blocks)
            self._reqs_need_recv[request.request_id] = (staged[0], staged[1], hits, staged[3])

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        followed = request.request_id in self._computing
        self._computing.forget(request.request_id)
        self._saving.forget(request.request_id)
        if request.request_id in self._awaiting_push:  # finished (aborted) before its push arrived
            self._awaiting_push.discard(request.request_id)
            self._to_withdraw.append(request.request_id)
        pushed = block_ids
        if (request.kv_transfer_params or {}).get("do_remote_decode"):
            # Speculative decoding's lookahead slots past the prompt are not pushed (as a pull offers
            # none, `_computed_blocks`): decode pairs a window group from its end, one block off.
            tokens = min(request.num_computed_tokens, request.num_prompt_tokens)
            pushed = prompt_blocks(self.kv_cache_config.kv_cache_groups, tokens, block_ids) or block_ids
        delay, params = super().request_finished(request, pushed)
        if followed and not delay and any(len(group) for group in block_ids):
            # Aborted while computed: vLLM would free its blocks now, and a progressive push may still
            # be reading them (its WRITEs end only once cancelled and settled). The workers report it
            # sent once none of theirs reads them.
            self._held_after_abort.append(request.request_id)
            return True, None
        return delay, params

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        self._awaiting_push.difference_update(connector_output.finished_recving or ())

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._computing:
            meta.push_steps = self._prefill_steps(scheduler_output)  # type: ignore[attr-defined]
        if self._to_withdraw:
            meta.push_withdrawn, self._to_withdraw = self._to_withdraw, []  # type: ignore[attr-defined]
        if self._held_after_abort:
            meta.push_held_after_abort, self._held_after_abort = self._held_after_abort, []  # type: ignore[attr-defined]
        return meta

    def _prefill_steps(self, out: Any) -> dict[str, PrefillStep]:
        """What each followed request computes in this step (its blocks as the step's forward sees them)."""
        return {request_id: step for request_id, step, _fresh in self._computing.steps(out)}
