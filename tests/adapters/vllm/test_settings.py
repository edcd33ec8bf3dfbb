"""`kv_connector_extra_config` -> engine settings (pure translation; vLLM's envs read for the side channel)."""

from __future__ import annotations

import asyncio
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

if os.environ.get("NIXL_ASYNC_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/setup-vllm.sh)")

from nixl_async._poller import AdaptivePacer
from nixl_async_vllm.settings import ADAPTER_POLL, AdapterSettings, UnsupportedSetting, rank_engine_id

SECRET = "correct horse battery staple"


def _config(extra, tp=2, dp_index=0, pp=1, dcp=1, pcp=1, permute=False, connector="NixlAsyncConnector", nodes=1,
            role="kv_both", routed_experts=False):  # fmt: skip
    return SimpleNamespace(
        aux_output_config=SimpleNamespace(enabled=routed_experts),
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config=extra, enable_permute_local_kv=permute, kv_connector=connector, kv_role=role
        ),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            prefill_context_parallel_size=pcp,
            pipeline_parallel_size=pp,
            data_parallel_index=dp_index,
            nnodes_within_dp=nodes,
        ),
    )


def test_extra_config_reaches_the_engine(monkeypatch):
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "6000")
    extra = {"auth_secret": SECRET, "kv_lease_duration": 12, "transfer_timeout": "7.5", "handshake_timeout": 2,
             "link_timeout": 3}  # fmt: skip
    settings = AdapterSettings.from_vllm(_config(extra, tp=2, dp_index=1))
    assert settings.lease_s == 12 and settings.side_channel_port == 6002  # DP rank 1 of TP 2: ports 6002, 6003
    config = settings.engine_config(rank_engine_id("eng", 1), {"model": "m"})
    assert config.auth_secret == SECRET.encode() and config.transfer_timeout_s == 7.5
    assert config.handshake_timeout_s == 2 and config.notify_via == "side_channel" and config.link_timeout_s == 3
    assert config.engine_id == "eng/tp1" and config.compat["model"] == "m"
    assert SECRET not in repr(settings) and SECRET not in repr(config), "the secret never shows in logs"


def test_defaults_match_vllm_nixl_connector():
    settings = AdapterSettings.from_vllm(_config({}))
    assert settings.lease_s == 30 and settings.auth_secret is None and settings.transfer_timeout_s == 120
    assert settings.engine_config("e", {}).link_timeout_s == 5
    assert AdapterSettings.from_vllm(_config({"link_timeout": None})).engine_config("e", {}).link_timeout_s is None


def test_the_tcp_segment_reaches_the_engine():
    assert AdapterSettings.from_vllm(_config({})).engine_config("e", {}).tcp_segment_bytes == 512 << 10
    for given in (None, 1 << 20):
        config = AdapterSettings.from_vllm(_config({"tcp_segment_bytes": given})).engine_config("e", {})
        assert config.tcp_segment_bytes == given


def test_the_tcp_send_buffer_reaches_the_engine():
    assert AdapterSettings.from_vllm(_config({})).engine_config("e", {}).tcp_send_buffer_bytes == 8 << 20
    for given in (None, 16 << 20):
        config = AdapterSettings.from_vllm(_config({"tcp_send_buffer_bytes": given})).engine_config("e", {})
        assert config.tcp_send_buffer_bytes == given


def test_the_switch_interval_is_left_alone_unless_asked_for_and_never_raised():
    """A process-wide setting the model thread pays for: the adapter changes it only on request."""
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        AdapterSettings.from_vllm(_config({})).apply_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        AdapterSettings.from_vllm(_config({"switch_interval_s": None})).apply_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(0.005)
        AdapterSettings.from_vllm(_config({"switch_interval_s": 0.01})).apply_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(0.005), "lowered, never raised"
        AdapterSettings.from_vllm(_config({"switch_interval_s": "0.0005"})).apply_switch_interval()
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize(
    "extra",
    [
        {"kv_lease_duration": 0},
        {"transfer_timeout": "soon"},
        {"auth_secret": "short"},
        {"switch_interval_s": -1},
        {"switch_interval_s": "fast"},
        {"link_timeout": 1},
        {"link_timeout": "never"},
        {"tcp_segment_bytes": "512k"},
        {"tcp_segment_bytes": 4096},
        {"tcp_segment_bytes": True},
        {"tcp_send_buffer_bytes": "8m"},
        {"tcp_send_buffer_bytes": 1024},
        {"etcd_endpoint": "etcd-0:2379,etcd-1:2379"},
        {"etcd_endpoint": "etcd:2379", "etcd_lease_ttl": 1},
        {"etcd_namespace": "fleet"},  # without an endpoint
    ],
)
def test_bad_settings_are_refused_with_a_clear_error(extra):
    with pytest.raises(ValueError, match=r"kv_connector_extra_config|auth_secret"):
        AdapterSettings.from_vllm(_config(extra)).engine_config("e", {})


def test_etcd_settings_reach_the_engine():
    extra = {"etcd_endpoint": "10.0.0.9:2379", "etcd_namespace": "fleet-a", "etcd_lease_ttl": 6}
    etcd = AdapterSettings.from_vllm(_config(extra)).engine_config("e", {}).etcd
    assert etcd is not None
    assert (etcd.host, etcd.port, etcd.namespace, etcd.lease_ttl_s) == ("10.0.0.9", 2379, "fleet-a", 6)
    assert AdapterSettings.from_vllm(_config({})).engine_config("e", {}).etcd is None


def test_secret_from_an_environment_variable_or_a_file(monkeypatch, tmp_path):
    monkeypatch.setenv("PD_SECRET", SECRET)
    assert AdapterSettings.from_vllm(_config({"auth_secret_env": "PD_SECRET"})).auth_secret == SECRET.encode()
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert AdapterSettings.from_vllm(_config({"auth_secret_file": str(path)})).auth_secret == SECRET.encode()
    for extra in ({"auth_secret_env": "NOT_SET_ANYWHERE"}, {"auth_secret_file": str(tmp_path / "missing")},
                  {"auth_secret": SECRET, "auth_secret_env": "PD_SECRET"}):  # fmt: skip
        with pytest.raises(ValueError, match="kv_connector_extra_config") as info:
            AdapterSettings.from_vllm(_config(extra))
        assert SECRET not in str(info.value)


def test_nixl_connector_settings_are_honoured():
    extra = {"backends": ["UCX"], "num_threads": 2, "engine_ttl": 60, "enforce_handshake_compat": False,
             "kv_recompute_threshold": 32}  # fmt: skip
    config = AdapterSettings.from_vllm(_config(extra)).engine_config("e", {})
    assert config.backends == ("UCX",) and config.backend_params == {"num_threads": "2"}
    assert config.peer_ttl_s == 60 and config.enforce_compat is False
    default = AdapterSettings.from_vllm(_config({})).engine_config("e", {})
    assert default.peer_ttl_s == 3600 and default.enforce_compat is True and default.backend_params == {}
    assert AdapterSettings.from_vllm(_config({"engine_ttl": 0})).engine_config("e", {}).peer_ttl_s is None


@pytest.mark.parametrize(
    ("extra", "knobs", "named"),
    [
        ({"bidirectional_kv_xfer": True}, {}, "bidirectional_kv_xfer"),
        ({"decoder_kv_blocks_ttl": 100}, {}, "decoder_kv_blocks_ttl"),
        ({"push_registration_timeout": 5}, {}, "push_registration_timeout.*push mode"),  # pull mode: no push
        ({"push_progressive": True}, {}, "push_progressive.*push mode"),
        ({"kv_lease_durration": 5}, {}, "kv_lease_durration"),  # a typo is refused, not ignored
        ({"backends": ["UCX", "GDS"], "num_threads": 2}, {}, "num_threads"),
        ({}, {"pp": 2}, "pipeline_parallel_size=2"),
        ({}, {"dcp": 2}, "decode_context_parallel_size=2"),
        ({}, {"pcp": 2}, "prefill_context_parallel_size=2"),
        ({}, {"permute": True}, "enable_permute_local_kv"),
        ({}, {"routed_experts": True}, "enable-return-routed-experts"),  # vLLM refuses it for its NIXL connectors
        ({}, {"nodes": 2, "role": "kv_producer"}, "across 2 nodes needs .*etcd_endpoint"),
        ({}, {"nodes": 2}, "across 2 nodes"),  # kv_both: dialled as a producer
        ({}, {"nodes": 2, "role": "kv_consumer", "connector": "NixlAsyncPushConnector"}, "across 2 nodes"),
    ],
)
def test_unsupported_settings_are_refused_by_name(extra, knobs, named):
    with pytest.raises(UnsupportedSetting, match=named):
        AdapterSettings.from_vllm(_config(extra, **knobs))


def test_tp_across_nodes_is_taken_where_no_rank_is_dialled_at_remote_host():
    """Before session 37 it was taken everywhere, and readers' handshakes to the second node's ranks timed out."""
    assert AdapterSettings.from_vllm(_config({}, nodes=2, role="kv_consumer")).etcd is None  # pull: it dials
    found_by_id = AdapterSettings.from_vllm(_config({"etcd_endpoint": "127.0.0.1:2379"}, nodes=2))
    assert found_by_id.etcd is not None


@pytest.mark.parametrize(
    "extra",
    [
        {"backends": "UCX"},
        {"backends": []},
        {"num_threads": -1},
        {"num_threads": "4"},
        {"engine_ttl": "long"},
        {"engine_ttl": "inf"},  # (before: taken, then refused by EngineConfig under its own name)
        {"kv_lease_duration": float("nan")},
        {"transfer_timeout": float("inf")},
        {"enforce_handshake_compat": "no"},
    ],
)
def test_malformed_nixl_connector_settings_are_refused(extra):
    with pytest.raises(ValueError, match=next(iter(extra))):
        AdapterSettings.from_vllm(_config(extra))


def test_refused_settings_at_their_default_are_accepted():
    AdapterSettings.from_vllm(_config({"bidirectional_kv_xfer": False}))


def test_push_mode_takes_the_registration_timeout():
    push = {"connector": "NixlAsyncPushConnector"}
    assert AdapterSettings.from_vllm(_config({}, **push)).push_registration_timeout_s == 480  # vLLM's default
    assert AdapterSettings.from_vllm(_config({"push_registration_timeout": 9}, **push)).push_registration_timeout_s == 9
    # vLLM's fallback when push_registration_timeout is unset (refused in pull mode: see above)
    fallback = AdapterSettings.from_vllm(_config({"decoder_kv_blocks_ttl": 60}, **push))
    assert fallback.push_registration_timeout_s == 60
    both = {"decoder_kv_blocks_ttl": 60, "push_registration_timeout": 9}
    assert AdapterSettings.from_vllm(_config(both, **push)).push_registration_timeout_s == 9
    unread = {"decoder_kv_blocks_ttl": 0, "push_registration_timeout": 9}  # vLLM never reads it then
    assert AdapterSettings.from_vllm(_config(unread, **push)).push_registration_timeout_s == 9
    for connector in ({}, push):  # null: its default, in either mode
        assert AdapterSettings.from_vllm(_config({"decoder_kv_blocks_ttl": None}, **connector))
    with pytest.raises(ValueError, match="push_registration_timeout"):
        AdapterSettings.from_vllm(_config({"push_registration_timeout": 0}, **push))
    # Within decode's margin for WRITEs in flight (3 s) prefill would refuse every push (before session 37: taken)
    with pytest.raises(ValueError, match=r"'push_registration_timeout'\] must be over 3 s"):
        AdapterSettings.from_vllm(_config({"push_registration_timeout": 2}, **push))
    with pytest.raises(ValueError, match=r"'decoder_kv_blocks_ttl'\] must be over 3 s"):
        AdapterSettings.from_vllm(_config({"decoder_kv_blocks_ttl": 3}, **push))


def test_push_mode_takes_progressive_push_as_a_flag():
    push = {"connector": "NixlAsyncPushConnector"}
    assert not AdapterSettings.from_vllm(_config({}, **push)).push_progressive
    assert AdapterSettings.from_vllm(_config({"push_progressive": True}, **push)).push_progressive
    with pytest.raises(ValueError, match=r"push_progressive.*true or false"):
        AdapterSettings.from_vllm(_config({"push_progressive": "yes"}, **push))
    # Its commit relies on UCX reporting a WRITE done only once decode has its bytes (before: taken with any)
    with pytest.raises(UnsupportedSetting, match=r"push_progressive.*UCX backend alone"):
        AdapterSettings.from_vllm(_config({"push_progressive": True, "backends": ["LIBFABRIC"]}, **push))
    assert AdapterSettings.from_vllm(_config({"backends": ["LIBFABRIC"]}, **push)).backends == ("LIBFABRIC",)


def test_idle_step_wait_is_bounded_and_can_be_turned_off():
    assert AdapterSettings.from_vllm(_config({})).idle_step_wait_s == 0.002
    assert AdapterSettings.from_vllm(_config({"idle_step_wait_s": 0})).idle_step_wait_s == 0
    assert AdapterSettings.from_vllm(_config({"idle_step_wait_s": 0.01})).idle_step_wait_s == 0.01
    for bad in (0.5, -1, "soon"):
        with pytest.raises(ValueError, match="idle_step_wait_s"):
            AdapterSettings.from_vllm(_config({"idle_step_wait_s": bad}))


def test_after_its_own_reads_end_the_poller_waits_its_idle_interval_but_stays_brisk_for_a_notification():
    """A decode server's loop does not check at 1, 2, 4, ... ms after each KV load (`small_reads`)."""
    pacer = AdaptivePacer(ADAPTER_POLL)
    pacer.activity(10.0)  # a read just ended
    assert pacer.delay(10.0001, busy=False, waiting=False) == ADAPTER_POLL.idle_interval_s
    pacer.activity(11.0)
    assert pacer.delay(11.0001, busy=False, waiting=True) == ADAPTER_POLL.waiting_interval_s
    assert pacer.delay(11.0002, busy=True, waiting=False) == ADAPTER_POLL.busy_interval_s  # in flight: never spins


@pytest.mark.nixl_engine_config(poll=ADAPTER_POLL, notify_via="side_channel")
async def test_after_a_read_over_tcp_ends_the_adapters_loop_sleeps_until_there_is_something_to_do(
    nixl_engine, nixl_peer_factory
):
    """The same with a real read in flight over UCX/TCP: once it ended (and its notification went out
    through the side channel), the loop does not wake to check on nothing for the next 40 ms."""
    block = 32 << 10
    proc = nixl_peer_factory(num_regions=1, num_blocks=8, block_len=block, tcp=True)
    nixl_engine.register("kv", [np.zeros(8 * block, dtype=np.uint8)], block_len=block)
    peer = await nixl_engine.connect(*proc.address)
    transfer = await nixl_engine.start_read(peer, [0, 1, 2, 3], [4, 5, 6, 7], notify=b"read")
    assert (await transfer).notified
    assert transfer.last_pending_at  # a check saw it in flight (over CMA it would be copied inside the post)
    polls = nixl_engine.snapshot().counters["polls"]
    await asyncio.sleep(0.04)
    assert nixl_engine.snapshot().counters["polls"] - polls <= 1  # the engine's own back-off: 4 or more


def test_the_adapters_calls_carry_the_push_registration_of_a_million_token_prompt():
    """16-token blocks, ids past 65,535 (5 bytes each). Before session 37 the engine's 64 KiB took ~13 k ids:
    the call was refused unsent, and decode held the request's blocks until its deadline."""
    from nixl_async.engine import _CALL_ENVELOPE
    from nixl_async_vllm.push_book import PUSH_TOPIC, PushGroup, PushRegistration, encode_registration

    engine_id = "decode-engine-0"
    config = AdapterSettings.from_vllm(_config({})).engine_config(engine_id, {})
    ids = list(range(100_000, 100_000 + 1_000_000 // 16))
    registration = PushRegistration(request_id="r", decode_request_id="d", decode_engine_id=engine_id,
                                    decode_host="10.0.0.3", decode_port=5600, decode_tp=1, decode_pages=1,
                                    groups=[PushGroup("full", ids)], write=True)  # fmt: skip
    room = config.max_request_bytes - len(PUSH_TOPIC) - len(engine_id) - _CALL_ENVELOPE
    assert len(encode_registration(registration)) <= room


@pytest.mark.parametrize("given, bound", [("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("[::1]", "::1"),
                                          ("localhost", None)])  # fmt: skip
def test_the_side_channel_binds_ipv4_and_ipv6_hosts(monkeypatch, given, bound):
    """`gethostbyname` knew IPv4 alone: an IPv6 VLLM_NIXL_SIDE_CHANNEL_HOST failed vLLM's start (found by a review)."""
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", given)
    host = AdapterSettings.from_vllm(_config({})).bind_host()
    assert host == bound if bound is not None else host in ("127.0.0.1", "::1")


@pytest.mark.parametrize(
    "extra",
    [
        {"auth_secret": 20},  # (before: bytes(20), twenty zero bytes, passed the 16-byte minimum)
        {"auth_secret": [1] * 16},
        {"auth_secret": ""},  # (before: read as "no secret": authentication quietly off)
        {"auth_secret_env": ""},
        {"auth_secret_file": ""},
        {"auth_secret_env": 5},  # (before: a bare TypeError naming no key)
        {"transfer_timeout": True},  # (before: a 1 s timeout)
        {"kv_lease_duration": True},
        {"kv_lease_duration": "30"},  # vLLM's scheduler divides it: a string stopped its constructor
        {"kv_recompute_threshold": "abc"},
        {"kv_recompute_threshold": "²"},  # (str.isdigit() takes it; vLLM's int() does not)
        {"kv_recompute_threshold": [64]},
        {"engine_ttl": float("nan")},  # (before: eviction quietly off)
        {"idle_step_wait_s": False},  # (before: taken as 0, off)
        {"etcd_endpoint": "etcd:99999"},
        {"etcd_endpoint": "etcd:0"},
        {"etcd_endpoint": "etcd:2379", "etcd_lease_ttl": 10.5},
    ],
)
def test_settings_of_the_wrong_kind_are_refused_naming_the_key(extra):
    """A settings audit of session 39: each of these was taken as something else, or failed naming no key."""
    extra = dict(extra)
    knobs = {"connector": extra.pop("connector")} if "connector" in extra else {}
    key = next(k for k in extra if k != "etcd_endpoint" or len(extra) == 1)
    with pytest.raises(ValueError, match=key) as refused:
        AdapterSettings.from_vllm(_config(extra, **knobs)).engine_config("e", {})
    assert SECRET not in str(refused.value)


def test_settings_of_a_near_kind_are_taken_as_meant():
    assert AdapterSettings.from_vllm(_config({"engine_ttl": float("inf")})).peer_ttl_s is None  # never evict
    etcd = AdapterSettings.from_vllm(_config({"etcd_endpoint": "etcd:2379", "etcd_lease_ttl": 10.0})).etcd
    assert etcd is not None and etcd.lease_ttl_s == 10  # (before: refused, naming EtcdConfig.lease_ttl_s)
    assert AdapterSettings.from_vllm(_config({"idle_step_wait_s": "0"})).idle_step_wait_s == 0  # (before: refused)
    assert AdapterSettings.from_vllm(_config({"transfer_timeout": "7.5"})).transfer_timeout_s == 7.5  # ours alone
    for threshold in ("32", "+32", 64.0):  # vLLM's int() takes them
        assert AdapterSettings.from_vllm(_config({"kv_recompute_threshold": threshold}))
    push = _config({"push_registration_timeout": "600"}, connector="NixlAsyncPushConnector")  # vLLM's float() too
    assert AdapterSettings.from_vllm(push).push_registration_timeout_s == 600


@pytest.mark.parametrize(("variable", "value"), [("VLLM_NIXL_SIDE_CHANNEL_PORT", "0"),
                                                 ("VLLM_NIXL_SIDE_CHANNEL_PORT", "65535"),  # rank 1 at 65536
                                                 ("VLLM_NIXL_SIDE_CHANNEL_HOST", " ")])  # fmt: skip
def test_side_channel_addresses_no_rank_can_serve_are_refused_naming_the_variable(monkeypatch, variable, value):
    """Port 0 made rank 0 listen on a random port while the scheduler announced 0 (readers failed later,
    "remote_host/remote_port unset"); an empty host failed with a bare gaierror."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=variable):
        AdapterSettings.from_vllm(_config({}, tp=2))
