"""`bench vllm_hosts` splits decode's logged KV loads by its own phases (pure parsing, no vLLM)."""

from __future__ import annotations

import math

from nixl_async_benchmarks.vllm import load_times, summarize_loads


def test_loads_are_taken_from_the_phase_they_began_in(tmp_path):
    log = tmp_path / "loads.txt"
    # start (ns), duration (ns): a warm-up load, two in the phase from 10 s to 20 s, one after it
    log.write_text("1000000000 5000000\n10500000000 2000000\n19000000000 4000000\n21000000000 9000000\n")
    assert load_times(log, 10.0, 20.0) == [0.002, 0.004]
    assert load_times(tmp_path / "missing.txt", 0.0, 1e9) == []


def test_summary_in_ms_and_nan_without_loads():
    figures = summarize_loads([0.001 * n for n in range(1, 11)], "c1")
    assert math.isclose(figures["c1_load_p50_ms"], 5.5)
    assert math.isclose(figures["c1_load_mean_ms"], 5.5)
    assert 9.0 <= figures["c1_load_p90_ms"] <= 10.0
    assert all(math.isnan(v) for v in summarize_loads([], "c4").values())


def test_inter_token_gaps_are_told_apart_by_whether_a_kv_load_overlapped_them(tmp_path):
    """#13 asks for decode's ITL while other requests' KV is pulled: every gap mixed steps with and without."""
    from nixl_async_benchmarks.vllm import Load, itl_beside_loads, load_spans

    log = tmp_path / "loads.txt"
    log.write_text("10000000000 5000000\n20000000000 1000000\n")  # loads over 10.000-10.005 s and 20.000-20.001 s
    spans = [(9.990, 10.001), (10.004, 10.010), (10.010, 10.013), (19.9995, 20.0035), (30.0, 30.002)]
    load = Load([], [], spans, 1.0)
    figures = itl_beside_loads(load, load_spans(log), "c4")
    assert math.isclose(figures["c4_itl_during_load_p50_ms"], 6.0)  # 11, 6 and 4 ms overlap a load
    assert math.isclose(figures["c4_itl_other_p50_ms"], 2.5)  # 3 and 2 ms do not
    assert math.isclose(figures["c4_itl_during_load_share"], 0.6)
    assert load_spans(tmp_path / "missing.txt") == []
