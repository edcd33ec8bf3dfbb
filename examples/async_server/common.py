"""What both services share: the KV shape, the request schema, a block pool and block checksums."""

from __future__ import annotations

import zlib
from collections import deque
from typing import Annotated

import msgspec
import numpy as np

LAYERS = 4
REGIONS = 2 * LAYERS  # K and V per layer
BLOCK_LEN = 256 << 10
NUM_BLOCKS = 64


class BlocksRequest(msgspec.Struct):
    """What both services are asked (JSON): a request's id and its number of KV blocks; for decode, a deadline."""

    request_id: Annotated[str, msgspec.Meta(min_length=1)]
    num_blocks: Annotated[int, msgspec.Meta(ge=1, le=NUM_BLOCKS)]  # more could never be served
    deadline_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0


def parse_request(body: bytes) -> BlocksRequest | str:
    """The request, or why it is refused (malformed JSON, a missing field, a value out of range)."""
    try:
        return msgspec.json.decode(body, type=BlocksRequest)
    except msgspec.DecodeError as exc:
        return str(exc)


def new_kv_cache() -> list[np.ndarray]:
    """Resident (touched) memory, as a real KV cache would be."""
    return [np.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=np.uint8) + 1 for _ in range(REGIONS)]


def checksum(kv: list[np.ndarray], block_ids: list[int]) -> int:
    """CRC32 over the given blocks of every region, in order."""
    crc = 0
    for region in kv:
        for b in block_ids:
            crc = zlib.crc32(region[b * BLOCK_LEN : (b + 1) * BLOCK_LEN].data, crc)
    return crc


class BlockPool:
    """Free block ids; `take` returns None when there are not enough."""

    def __init__(self, num_blocks: int) -> None:
        self._free = deque(range(num_blocks))

    def take(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def give(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    @property
    def free(self) -> int:
        return len(self._free)
