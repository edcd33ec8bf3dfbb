"""`nixl_async.testing.netns`: what the helper removes is only what it made (a fake `ip` on PATH records the calls)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nixl_async.testing.netns import NetnsUnavailable, network


def _fake_ip(tmp_path: Path, bridge_exists: bool) -> Path:
    log = tmp_path / "ip.log"
    script = tmp_path / "bin" / "ip"
    script.parent.mkdir()
    refuse = 'case "$*" in "link add "*" type bridge") echo "RTNETLINK answers: File exists" >&2; exit 2;; esac\n'
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\n' + (refuse if bridge_exists else "") + "exit 0\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return log


def test_a_bridge_that_already_exists_is_left_alone(tmp_path, monkeypatch):
    """Another run's bridge (a killed run's, or a tag that collides): the helper says it cannot make its own
    and deletes nothing (before, its cleanup deleted the other run's bridge)."""
    log = _fake_ip(tmp_path, bridge_exists=True)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(NetnsUnavailable, match="File exists"), network(2, tag="T1"):
        pytest.fail("a network came up on a bridge that was not ours")
    assert not [call for call in log.read_text().splitlines() if call.startswith("link del")]


def test_a_network_it_made_is_removed_whole(tmp_path, monkeypatch):
    log = _fake_ip(tmp_path, bridge_exists=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with network(2, tag="T2") as net:
        assert [h.address for h in net.hosts] == ["10.213.0.2", "10.213.0.3"]
    calls = log.read_text().splitlines()
    assert "link del nxbrT2" in calls and {"netns del nxhT2-0", "netns del nxhT2-1"} <= set(calls)


def test_no_iproute2_is_namespaces_unavailable(tmp_path, monkeypatch):
    """No `ip` binary: `NetnsUnavailable` (a test skips), not the cleanup's FileNotFoundError (a test failed)."""
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(NetnsUnavailable), network(1, tag="T3"):
        pytest.fail("a network came up without iproute2")
