"""Push mode's wire message and the producer's matching of registrations to finished requests.

Pure state, no I/O. In push mode decode allocates blocks first and registers them with each
prefill rank it needs; prefill WRITEs a request's KV into them once the request is done there.
Either may come first: a registration for a request prefill is still computing waits, and a
finished request waits for its registration (until its lease runs out).

Decode and prefill name a request differently: vLLM appends a random ``-<8 hex>`` to the id a
proxy gives both legs, so a registration matches a finished request by exact id, else by the
id without that suffix (vLLM's `get_base_request_id`, as its push connector matches them).

Decode plans the transfer from prefill's layout, as it does in pull mode (`tp_mapping`), and
sends the plan's views; prefill only adds its own block ids, so one planner serves both modes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import msgspec

from nixl_async import ViewSpec
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id as base_request_id

__all__ = [
    "GONE",
    "PUSH_PREFIX",
    "PUSH_TOPIC",
    "PushBook",
    "PushGroup",
    "PushRegistration",
    "base_request_id",
    "push_notification",
]

PUSH_TOPIC = "kv_push"
PUSH_PREFIX = b"push:"
GONE = "gone"  # a registration for a request prefill has freed
GONE_REMEMBERED = 4096  # freed requests remembered to answer late registrations


def push_notification(decode_request_id: str, prefill_rank: int) -> bytes:
    """What prefill rank `prefill_rank`'s WRITE carries to decode: decode counts one per writing rank."""
    return PUSH_PREFIX + f"{decode_request_id}:{prefill_rank}".encode()


class PushGroup(msgspec.Struct, frozen=True, array_like=True):
    """One KV cache group of a registration: decode's logical blocks (see `block_pairs.GroupBlocks`)."""

    kind: str
    blocks: list[int]
    hit: int | None = None


class PushRegistration(msgspec.Struct, frozen=True, kw_only=True):
    """Decode rank -> prefill rank: "write request `request_id` into these blocks of mine".

    `write` is False for a prefill rank decode does not read from (an MLA sibling, a full
    prefix hit): it only lets prefill free the request. `write_by` is decode's wall clock:
    prefill never starts a WRITE after it and cancels one still running then, and decode
    gives up on the request only once it has passed (no byte lands in blocks decode reused).
    """

    request_id: str  # prefill's, as the proxy named it (maybe without vLLM's suffix)
    decode_request_id: str
    decode_engine_id: str  # the decode rank's transfer engine
    decode_host: str
    decode_port: int
    decode_tp: int
    decode_pages: int  # kernel pages per decode block
    groups: list[PushGroup]
    write: bool
    decode_view: ViewSpec = ViewSpec()  # which bytes of decode's blocks this prefill rank fills
    prefill_view: ViewSpec = ViewSpec()  # ... from which bytes of its own
    write_by: float = 0.0


encode_registration = msgspec.msgpack.Encoder().encode
decode_registration = msgspec.msgpack.Decoder(PushRegistration).decode


@dataclass
class _Finished:
    blocks: tuple[list[int], ...]
    running: int = 0  # pushes started and not yet ended
    closing: bool = False  # to be freed: matches no more registrations


@dataclass
class PushBook:
    """Prefill side: finished requests and decode registrations, matched as they meet.

    `finished` and `register` return the pushes to start; each counts as running until
    `ended`. A request may take several registrations (several decode ranks read one prefill
    rank). `release` says whether a request's blocks may be freed: not while a push of it runs
    (the push reads them); it then matches nothing more. A registration for a request already
    released is answered `GONE`, so decode fails it at once instead of waiting. Registrations
    nobody claims are dropped once their `write_by` has passed (`expire`).
    """

    _finished: dict[str, _Finished] = field(default_factory=dict)
    _by_base: dict[str, str] = field(default_factory=dict)  # base id -> finished request
    _waiting: dict[str, list[PushRegistration]] = field(default_factory=dict)  # by base id
    _gone: dict[str, None] = field(default_factory=dict)  # base ids of released requests, oldest first
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def finished(self, request_id: str, blocks: tuple[list[int], ...]) -> list[PushRegistration]:
        """Prefill finished `request_id`: the registrations that were waiting for it (now running)."""
        base = base_request_id(request_id)
        with self._lock:
            matched = self._waiting.pop(base, [])
            self._finished[request_id] = _Finished(blocks, running=len(matched))
            self._by_base[base] = request_id
            return matched

    def register(self, registration: PushRegistration) -> tuple[str, tuple[list[int], ...]] | str | None:
        """A decode rank registered: (prefill request, its blocks) to push now, None if it waits, or `GONE`."""
        base = base_request_id(registration.request_id)
        with self._lock:
            request_id = registration.request_id
            if request_id not in self._finished:
                request_id = self._by_base.get(base, "")
            entry = self._finished.get(request_id)
            if entry is None:
                if base in self._gone:
                    return GONE
                self._waiting.setdefault(base, []).append(registration)
                return None
            if entry.closing:
                return GONE
            entry.running += 1
            return request_id, entry.blocks

    def ended(self, request_id: str) -> None:
        """One push of `request_id` ended (its transfers are quiet)."""
        with self._lock:
            entry = self._finished.get(request_id)
            if entry is not None:
                entry.running -= 1

    def release(self, request_id: str) -> bool:
        """May `request_id`'s blocks be freed? Not while a push reads them (it then matches nothing more)."""
        with self._lock:
            entry = self._finished.get(request_id)
            if entry is None:
                return True
            if entry.running > 0:
                entry.closing = True
                return False
            del self._finished[request_id]
            base = base_request_id(request_id)
            if self._by_base.get(base) == request_id:
                del self._by_base[base]
            self._gone[base] = None
            if len(self._gone) > GONE_REMEMBERED:
                del self._gone[next(iter(self._gone))]
            return True

    def closing(self) -> list[str]:
        """Requests to be freed once their running pushes end."""
        with self._lock:
            return [r for r, entry in self._finished.items() if entry.closing]

    def expire(self, wall_now: float) -> list[PushRegistration]:
        """Drop (and return) waiting registrations whose `write_by` has passed."""
        dropped = []
        with self._lock:
            for key in list(self._waiting):
                keep = [r for r in self._waiting[key] if r.write_by > wall_now]
                dropped += [r for r in self._waiting[key] if r.write_by <= wall_now]
                if keep:
                    self._waiting[key] = keep
                else:
                    del self._waiting[key]
        return dropped

    def waiting(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._waiting.values())
