"""throughput_tcp's per-round ratio: each round's engine reads against the same round's faster raw loop (pure logic)."""

import pytest

from benchmarks.throughput_tcp import _round_ratios


def test_each_round_is_divided_by_its_own_faster_raw_loop():
    # 2 rounds of 2 reads per reader; the machine ran twice as fast in round 2 for everyone
    got = {
        "engine": [0.9, 1.1, 1.8, 2.2],
        "engine_inline_sizing": [0.1, 0.1, 0.1, 0.1],
        "raw_1ms": [1.0, 1.0, 1.0, 3.0],
        "raw_hot": [2.0, 2.0, 0.5, 0.5],
    }
    assert _round_ratios(got, per_round=2) == pytest.approx([0.5, 1.0])
