"""The poller's pacing policy and the latency histogram (pure logic)."""

import sys

import pytest

from nixl_async._poller import AdaptivePacer
from nixl_async._slicing import CopyRate, CopyRates, LinkRates, WireRate, slice_bytes
from nixl_async.config import EngineConfig, PollConfig, ucx_link_settings
from nixl_async.stats import LatencyHistogram


def test_spins_while_busy_and_during_linger_then_backs_off_to_idle():
    cfg = PollConfig(linger_s=0.002, backoff_start_s=0.001, idle_interval_s=0.008, waiting_interval_s=0.002)
    pacer = AdaptivePacer(cfg)
    pacer.activity(10.0)
    assert pacer.delay(10.5, busy=True, waiting=False) == 0.0
    assert pacer.delay(10.001, busy=False, waiting=False) == 0.0
    delays = [pacer.delay(11.0, busy=False, waiting=False) for _ in range(5)]
    assert delays == [0.001, 0.002, 0.004, 0.008, 0.008]
    pacer.activity(12.0)
    assert pacer.delay(12.01, busy=False, waiting=False) == 0.001


def test_without_spin_a_transfer_about_to_end_is_checked_every_busy_interval():
    pacer = AdaptivePacer(PollConfig(busy_interval_s=0.001, spin=False))
    assert pacer.delay(1.0, busy=True, waiting=False, hot_in=0.0) == 0.001
    assert pacer.delay(1.0, busy=True, waiting=False, hot_in=0.5) == 0.001
    assert AdaptivePacer(PollConfig(busy_interval_s=0.001)).delay(1.0, busy=True, waiting=False, hot_in=0.0) == 0.0


def test_without_spin_nothing_lingers_hot_after_activity():
    """`spin=False` never spins: before, the `linger_s` after each completion was spun all the same."""
    pacer = AdaptivePacer(PollConfig(linger_s=0.002, backoff_start_s=0.001, spin=False))
    pacer.activity(5.0)
    assert pacer.delay(5.0005, busy=False, waiting=False) == 0.001
    lingering = AdaptivePacer(PollConfig(linger_s=0.002, backoff_start_s=0.001))
    lingering.activity(5.0)
    assert lingering.delay(5.0005, busy=False, waiting=False) == 0.0


def test_in_flight_it_checks_every_busy_interval_until_a_transfer_may_end():
    pacer = AdaptivePacer(PollConfig(busy_interval_s=0.001, linger_s=0.002))
    pacer.activity(10.0)
    assert pacer.delay(10.0005, busy=True, waiting=False, hot_in=0.030) == 0.001  # nothing due: no spin, even lingering
    assert pacer.delay(10.5, busy=True, waiting=False, hot_in=0.0008) == 0.0  # due within one interval: hot
    assert pacer.delay(10.5, busy=True, waiting=False, hot_in=-1.0) == 0.0  # a slice to post, or overdue
    spinning = AdaptivePacer(PollConfig(busy_interval_s=0.0))  # the old policy, on request
    assert spinning.delay(10.5, busy=True, waiting=False, hot_in=0.030) == 0.0


def test_a_transfer_just_posted_is_first_checked_when_a_busy_check_would_look_again():
    """A submit that posted a read in flight need not wake the poller at once: a check then finds it in flight."""
    quiet = AdaptivePacer(PollConfig(busy_interval_s=0.001, spin=False))
    assert quiet.after_post(hot_in=-1.0) == 0.001  # never spins, even on a read already due
    assert quiet.after_post(hot_in=0.5) == 0.001
    spinning = AdaptivePacer(PollConfig(busy_interval_s=0.001))
    assert spinning.after_post(hot_in=0.0005) == 0.0  # due within the interval: checked hot, at once
    assert spinning.after_post(hot_in=0.030) == 0.001
    spinning.delay(1.0, busy=True, waiting=False, hot_in=0.030)
    spinning.delay(1.004, busy=True, waiting=False, hot_in=0.030)  # its sleeps last longer than nominal
    assert spinning.after_post(hot_in=0.0015) == 0.0
    assert AdaptivePacer(PollConfig(busy_interval_s=0.0, spin=False)).after_post(hot_in=0.5) == 0.0


def test_a_transfer_due_within_the_interval_its_sleeps_really_last_is_checked_hot():
    """A "1 ms" sleep between checks of a TCP read lasted 2-3 ms (the timer rounds up, the next check receives
    what came meanwhile): a read due in 1.5 ms was slept on and, ending during that sleep, seen late."""
    pacer = AdaptivePacer(PollConfig(busy_interval_s=0.001))
    assert pacer.delay(1.0, busy=True, waiting=False, hot_in=0.030) == 0.001
    assert pacer.delay(1.0025, busy=True, waiting=False, hot_in=0.030) == 0.001  # that sleep lasted 2.5 ms
    assert pacer.delay(1.0050, busy=True, waiting=False, hot_in=0.0015) == 0.0, "due before the next check"
    assert pacer.delay(1.0051, busy=True, waiting=False, hot_in=0.0015) == 0.0
    fresh = AdaptivePacer(PollConfig(busy_interval_s=0.001))  # never slept: the nominal interval
    assert fresh.delay(1.0, busy=True, waiting=False, hot_in=0.0015) == 0.001
    assert fresh.delay(1.0011, busy=True, waiting=False, hot_in=0.0) == 0.0
    idle = AdaptivePacer(PollConfig(busy_interval_s=0.001))
    idle.delay(1.0, busy=True, waiting=False, hot_in=0.030)
    idle.delay(2.0, busy=False, waiting=False)  # an idle spell is no check interval
    assert idle.delay(3.0, busy=True, waiting=False, hot_in=0.0015) == 0.001


def test_wire_rate_drops_at_once_and_rises_halfway():
    rate = WireRate(initial=10e9)
    rate.observe(1 << 20, 0.0002)  # too short to say anything about a rate
    assert rate.bytes_per_s == 10e9
    rate.observe(200_000_000, 0.2)  # 1 GB/s: slower than thought, believed at once
    assert rate.bytes_per_s == pytest.approx(1e9)
    rate.observe(300_000_000, 0.1)  # 3 GB/s: faster, believed halfway
    assert rate.bytes_per_s == pytest.approx(2e9)
    # 200 MB at 2 GB/s is expected to take 100 ms: hot checks start at 80 ms less the margin, and stop once
    # it is overdue by as long again and 5 ms (stalled: checked at the busy interval, not spun on)
    start, stop = rate.spin_window(5.0, 200_000_000, 0.0005)
    assert start == pytest.approx(5.0 + 0.08 - 0.0005) and stop == pytest.approx(5.0 + 0.2 + 0.005)


def test_the_first_measured_wire_rate_replaces_the_guess_even_when_faster():
    rate = WireRate(initial=1e9)
    assert not rate.measured
    rate.observe(300_000_000, 0.1)
    assert rate.measured and rate.bytes_per_s == pytest.approx(3e9)


def test_slices_are_sized_for_the_loop_on_inline_copies_and_for_the_wire_otherwise():
    cfg = EngineConfig(post_target_s=0.002, slice_flight_s=0.025, min_post_bytes=1 << 20, max_post_bytes=64 << 20)
    copy, link = CopyRate(cfg, initial=4e9), LinkRates()
    assert slice_bytes(cfg, copy, link) == 8_000_000  # 2 ms of copying at 4 GB/s
    link.posted("PROC")  # the post returned before its data moved...
    assert slice_bytes(cfg, copy, link) == 8_000_000  # ...but no wire rate is measured yet
    link.wire.observe(100_000_000, 0.1)  # 1 GB/s
    assert slice_bytes(cfg, copy, link) == 25_000_000  # 25 ms of wire
    link.wire.observe(10_000_000, 1.0)  # 10 MB/s: never below the floor
    assert slice_bytes(cfg, copy, link) == 1 << 20
    link.wire.observe(1_000_000_000, 0.05)  # 20 GB/s: never above the ceiling
    link.wire.observe(1_000_000_000, 0.05)
    assert slice_bytes(cfg, copy, link) == 64 << 20
    link.posted("ERR (remote gone)")  # says nothing about the transport
    assert slice_bytes(cfg, copy, link) == 64 << 20
    assert slice_bytes(cfg.replace(slice_flight_s=None), copy, link) == 8_000_000  # sizing by the wire is off
    link.posted("DONE")  # copied inside the post: the loop's stall bounds the slice again
    assert slice_bytes(cfg, copy, link) == 8_000_000


def test_inline_copies_are_timed_by_cpu_and_waiting_around_posts_stretches_the_slices():
    cfg = EngineConfig(post_target_s=0.002, min_post_bytes=1 << 20, max_post_bytes=64 << 20)
    copy = CopyRate(cfg, initial=4e9)
    copy.observe(8_000_000, 0.002, 0.002)  # 4 GB/s, nothing waited
    assert copy.wait_s == 0.0 and copy.slice_bytes() == 8_000_000
    # Another Python thread holds the GIL: each post copies 2 ms, then waits 5 ms to get it back.
    # Timed by the wall, the rate would fall to 1.1 GB/s and the slices with it (and fall again
    # on the next, smaller, equally delayed post); timed by the CPU it stays, and the slices grow.
    for _ in range(12):
        copy.observe(copy.slice_bytes(), copy.slice_bytes() / 4e9, copy.slice_bytes() / 4e9 + 0.005)
    assert copy.bytes_per_s == pytest.approx(4e9, rel=0.01)
    assert copy.wait_s == pytest.approx(0.005, rel=0.05)
    assert copy.slice_bytes() == pytest.approx(4e9 * 0.010, rel=0.05)  # 10 ms of copying: twice the wait
    copy.observe(8_000_000, 0.008, 0.008)  # a slow copy (1 GB/s) is still believed at once
    assert copy.bytes_per_s == pytest.approx(1e9)
    for _ in range(30):  # the wait goes, the slices shrink back to the loop's target
        copy.observe(2_000_000, 0.002, 0.002)
    assert copy.slice_bytes() == 2_000_000
    copy.observe(512 << 10, 0.0001, 0.005)  # too small to time a rate, but its wait counts
    assert copy.bytes_per_s == pytest.approx(1e9) and copy.wait_s > 0.001


def test_waits_count_up_to_the_switch_interval(monkeypatch):
    """Off a core half the time, a post's wait grows with its slice: the stretch must stop somewhere."""
    monkeypatch.setattr(sys, "getswitchinterval", lambda: 0.005)
    cfg = EngineConfig(post_target_s=0.002, min_post_bytes=1 << 20, max_post_bytes=1 << 30)
    copy = CopyRate(cfg, initial=4e9)
    for _ in range(40):
        seconds = copy.slice_bytes() / 4e9
        copy.observe(copy.slice_bytes(), seconds, 2 * seconds)  # the wall twice the CPU, whatever the size
    assert copy.wait_s == pytest.approx(0.005, rel=0.01)
    assert copy.slice_bytes() == pytest.approx(4e9 * 0.010, rel=0.01)  # twice the interval, not 1 GiB
    copy.observe(40_000_000, 0.010, 0.210)  # one post 200 ms late moves the mean by no more than an interval
    assert copy.wait_s <= 0.005 + 1e-9


def test_the_default_cap_lets_a_gpu_copy_post_its_target_not_64_mib():
    """cuda_ipc copied ~120 GB/s on an H100: 64 MiB slices were half a millisecond each, and beside a
    busy Python thread every post also waited for the GIL (1 GiB in 1 MiB blocks: 6 GB/s against
    23-41 GB/s with the cap at 1 GiB, docs/gpu.md). The cap still bounds a runaway estimate."""
    cfg = EngineConfig()
    copy = CopyRate(cfg, initial=120e9)
    assert copy.slice_bytes() == int(120e9 * cfg.post_target_s)  # 240 MB: 2 ms of copying
    copy.observe(1 << 30, (1 << 30) / 120e9, (1 << 30) / 120e9 + 0.005)  # each post waits 5 ms for the GIL
    assert copy.slice_bytes() > 64 << 20
    assert CopyRate(cfg, initial=1e15).slice_bytes() == cfg.max_post_bytes == 1 << 30


def test_each_route_learns_its_own_copy_rate():
    """A host copy sized by a GPU copy's rate would stall the loop ~25x its target (and the GPU's
    slices, sized by the host's, would take a dozen posts to grow back)."""
    cfg = EngineConfig()
    rates = CopyRates(cfg)
    gpu, host = rates.of(("VRAM", "VRAM")), rates.of(("DRAM", "DRAM"))
    assert rates.of(("VRAM", "VRAM")) is gpu and gpu is not host and rates.of(("DRAM", "VRAM")) not in (gpu, host)
    for _ in range(20):  # cuda_ipc at 120 GB/s
        gpu.observe(gpu.slice_bytes(), gpu.slice_bytes() / 120e9, gpu.slice_bytes() / 120e9)
    assert gpu.slice_bytes() == pytest.approx(120e9 * cfg.post_target_s, rel=0.01)
    assert host.slice_bytes() == int(host.bytes_per_s * cfg.post_target_s) < 16 << 20  # still the first guess
    host.observe(10_000_000, 0.002, 0.002)  # CMA at 5 GB/s
    assert gpu.slice_bytes() == pytest.approx(120e9 * cfg.post_target_s, rel=0.01)


def test_a_peer_is_hinted_busy_unless_its_posts_copy_inline_and_renewed_before_the_hint_runs_out():
    link = LinkRates()
    assert link.busy_hint_due(10.0)  # nothing known yet: the first transfer may be in flight
    assert not link.busy_hint_due(10.4)  # the hint lasts BUSY_HINT_S (1 s)...
    assert link.busy_hint_due(10.5)  # ...and is renewed with half of it left
    link.posted("DONE")
    assert not link.busy_hint_due(20.0)  # inline copies leave nothing in flight for the peer to serve
    link.posted("PROC")
    assert link.busy_hint_due(20.0)


def test_waiting_and_brisk_windows_cap_the_interval():
    cfg = PollConfig(linger_s=0, backoff_start_s=0.001, idle_interval_s=0.05, waiting_interval_s=0.002)
    pacer = AdaptivePacer(cfg)
    for _ in range(10):
        pacer.delay(1.0, busy=False, waiting=False)
    assert pacer.delay(1.0, busy=False, waiting=False) == 0.05
    assert pacer.delay(1.0, busy=False, waiting=True) == 0.002
    pacer.stay_brisk(2.0)
    assert pacer.delay(1.5, busy=False, waiting=False) == 0.002
    assert pacer.delay(2.5, busy=False, waiting=False) == 0.05


def test_config_validation():
    with pytest.raises(ValueError):
        PollConfig(linger_s=-1)
    with pytest.raises(ValueError):
        PollConfig(busy_interval_s=-0.001)
    with pytest.raises(ValueError):
        PollConfig(backoff_start_s=1, idle_interval_s=0.1)
    with pytest.raises(ValueError):
        EngineConfig(max_post_bytes=0)
    with pytest.raises(ValueError):
        EngineConfig(engine_id="")
    with pytest.raises(ValueError, match="slice_flight_s"):
        EngineConfig(slice_flight_s=0)
    assert EngineConfig(engine_id="a").replace(engine_id="b").engine_id == "b"
    with pytest.raises(ValueError, match="link_timeout_s"):
        EngineConfig(link_timeout_s=1)
    # A NaN deadline is never reached (before: every connect failed "within nan s"; a NaN grace never fenced)
    for name in ("handshake_timeout_s", "transfer_timeout_s", "release_grace_s", "peer_ttl_s", "post_target_s",
                 "slice_flight_s", "link_timeout_s", "max_inflight_bytes"):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: float("nan")})
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        EngineConfig(transfer_timeout_s=float("inf"))  # no limit is None
    assert EngineConfig(release_grace_s=0, link_timeout_s=2, transfer_timeout_s=None).release_grace_s == 0
    for backends in ("UCX", (), ("UCX", "")):  # a string would be read letter by letter
        with pytest.raises(ValueError, match="backends"):
            EngineConfig(backends=backends)
    assert EngineConfig(backends=["UCX"]).backends == EngineConfig(backends=(b for b in ["UCX"])).backends == ("UCX",)
    for name in ("enforce_compat", "cuda_ipc_get"):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: "false"})  # a non-empty string is true


def test_the_link_timeout_becomes_ucx_settings_of_the_ucx_backend_only():
    assert ucx_link_settings(5) == {"TCP_KEEPIDLE": "2s", "TCP_KEEPINTVL": "1s", "TCP_KEEPCNT": "3",
                                    "TCP_USER_TIMEOUT": "5000ms"}  # fmt: skip
    config = EngineConfig(link_timeout_s=2, backend_params={"num_threads": "2"}, cuda_ipc_get=False,
                          tcp_segment_bytes=None)  # fmt: skip
    assert config.backend_settings("UCX") == {
        "num_threads": "2",
        "engine_config": "TCP_KEEPIDLE=1s,TCP_KEEPINTVL=1s,TCP_KEEPCNT=1,TCP_USER_TIMEOUT=2000ms",
    }
    assert config.backend_settings("GDS") == {"num_threads": "2"}
    bare = EngineConfig(link_timeout_s=None, cuda_ipc_get=False, tcp_segment_bytes=None)
    assert bare.backend_settings("UCX") == {}
    only_ipc = {"engine_config": "CUDA_IPC_ENABLE_GET_ZCOPY=on"}
    assert EngineConfig(link_timeout_s=None, tcp_segment_bytes=None).backend_settings("UCX") == only_ipc
    # The caller's own UCX settings win, key by key.
    mine = EngineConfig(backend_params={"engine_config": "tcp_user_timeout=9s,RNDV_THRESH=8k"})
    assert mine.backend_settings("UCX")["engine_config"] == (
        "TCP_USER_TIMEOUT=9s,RNDV_THRESH=8k,TCP_KEEPIDLE=2s,TCP_KEEPINTVL=1s,TCP_KEEPCNT=3,CUDA_IPC_ENABLE_GET_ZCOPY=on,"
        "TCP_RX_SEG_SIZE=524288,TCP_TX_SEG_SIZE=524288"
    )
    off = EngineConfig(
        link_timeout_s=None, tcp_segment_bytes=None, backend_params={"engine_config": "cuda_ipc_enable_get_zcopy=auto"}
    )
    # (forwarded upper-cased: UCX matches setting names exactly, and would refuse the lower-case one)
    assert off.backend_settings("UCX")["engine_config"] == "CUDA_IPC_ENABLE_GET_ZCOPY=auto"


def test_histogram_percentiles_within_a_bucket():
    hist = LatencyHistogram()
    for us in range(1, 1001):
        hist.record(us * 1e-6)
    snap = hist.snapshot()
    assert snap.count == 1000 and snap.max_us == pytest.approx(1000)
    assert 500 <= snap.p50_us <= 500 * 1.19 + 1
    assert 990 <= snap.p99_us <= 1000
    assert LatencyHistogram().snapshot().p50_us == 0.0


def test_an_idle_back_off_from_zero_is_refused():
    with pytest.raises(ValueError, match="backoff_start_s must be > 0"):
        PollConfig(backoff_start_s=0.0, idle_interval_s=0.05)
    PollConfig(backoff_start_s=0.0, idle_interval_s=0.0)  # never idle: nothing to back off to


@pytest.mark.parametrize(
    "fields",
    [{"busy_interval_s": float("inf"), "spin": False}, {"busy_interval_s": float("nan")}, {"linger_s": float("inf")},
     {"idle_interval_s": float("nan")}, {"waiting_interval_s": True}, {"spin": "False"}, {"follow_busy_hints": 1},
     {"busy_interval_s": "1"}],
)  # fmt: skip
def test_poll_settings_that_would_hang_or_spin_are_refused_by_name(fields):
    """Before, an infinite busy interval never checked a transfer again (its deadline, a cancel's release: a
    hang for good), an infinite linger spun an idle engine for ever, and "False" turned spinning on."""
    with pytest.raises(ValueError, match=f"PollConfig.{next(iter(fields))}"):
        PollConfig(**fields)


@pytest.mark.parametrize("value", [True, 1.5, float("inf"), "4", 0, -1])
def test_whole_number_limits_are_refused_unless_whole_and_positive(value):
    """Before, 1.5 made every transfer fail in the poller (slice indices), 4e6 frames made ZMQ raise a raw
    TypeError naming no setting, and True passed as 1."""
    for name in ("max_post_descriptors", "max_frame_bytes", "max_inflight_transfers"):
        with pytest.raises(ValueError, match=f"EngineConfig.{name} must be a whole number"):
            EngineConfig(**{name: value})
    with pytest.raises(ValueError, match=r"EngineConfig\.poll must be a PollConfig"):
        EngineConfig(poll={"spin": False})


@pytest.mark.parametrize("block", [18432, 73728, 32 << 10, 3 << 20])
def test_one_slow_post_never_keeps_the_slices_at_the_floor(block):
    """An audit of session 39: only posts of at least `min_post_bytes` were measured, and at the floor a slice of
    whole blocks that do not divide it (MLA's 18,432-byte blocks: 56 of them, 1,032,192 bytes) falls short of
    it: after one slow copy the rate was never measured again, and that route posted ~1 MiB slices for good."""
    from nixl_async.transfer import descriptors_per_slice

    cfg = EngineConfig()
    copy = CopyRate(cfg, initial=4e9)

    def post() -> int:
        nbytes = block * descriptors_per_slice(block, copy.slice_bytes(), cfg.max_post_descriptors)
        return nbytes

    nbytes = post()
    copy.observe(nbytes, nbytes / 0.2e9, nbytes / 0.2e9)  # one slow copy (a first mapping, a busy core)
    assert copy.slice_bytes() == cfg.min_post_bytes
    for _ in range(100):  # then copies at 10 GB/s
        nbytes = post()
        copy.observe(nbytes, nbytes / 10e9, nbytes / 10e9)
    assert copy.bytes_per_s > 5e9 and post() > 8 * cfg.min_post_bytes
