"""The deterministic fill pattern peers are filled with.

The pattern is a function of (seed, region, byte offset), so either side of a transfer can check any
block without shipping data: see `pattern_block` and `verify_blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["fill_pattern", "pattern_block", "verify_blocks"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xBF58476D1CE4E5B9)


def _pattern_words(seed: int, region: int, start_word: int, count: int) -> npt.NDArray[np.uint64]:
    x = np.arange(start_word, start_word + count, dtype=np.uint64) * _GOLDEN
    x += np.uint64((seed * 1_000_003 + region * 7_919 + 1) & 0xFFFFFFFFFFFFFFFF)
    x ^= x >> np.uint64(31)
    x *= _MIX
    x ^= x >> np.uint64(29)
    return x


def pattern_block(seed: int, region: int, block: int, block_len: int) -> npt.NDArray[np.uint8]:
    """The bytes block `block` of region `region` holds when filled with `seed`."""
    if block_len % 8:
        raise ValueError("pattern blocks must be a multiple of 8 bytes")
    words = block_len // 8
    return _pattern_words(seed, region, block * words, words).view(np.uint8)


def fill_pattern(regions: Sequence[npt.NDArray[Any]], seed: int) -> None:
    """Fill each region (a flat uint8 array or tensor-backed view) with the pattern."""
    for r, region in enumerate(regions):
        flat = np.asarray(region).reshape(-1).view(np.uint8)
        if flat.nbytes % 8:
            raise ValueError("pattern regions must be a multiple of 8 bytes")
        flat.view(np.uint64)[:] = _pattern_words(seed, r, 0, flat.nbytes // 8)


def verify_blocks(
    regions: Sequence[npt.NDArray[Any]],
    block_len: int,
    blocks: Sequence[int] | npt.NDArray[np.integer[Any]],
    source_blocks: Sequence[int] | npt.NDArray[np.integer[Any]],
    seed: int,
) -> list[int]:
    """Blocks (of `blocks`) whose bytes differ from the pattern of the paired source block."""
    bad: list[int] = []
    for r, region in enumerate(regions):
        flat = np.asarray(region).reshape(-1).view(np.uint8)
        for block, source in zip(blocks, source_blocks, strict=True):
            got = flat[block * block_len : (block + 1) * block_len]
            if not np.array_equal(got, pattern_block(seed, r, source, block_len)):
                bad.append(int(block))
    return sorted(set(bad))
