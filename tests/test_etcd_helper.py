"""`nixl_async.testing.etcd`: an etcd that cannot start fails the test that needs it, and leaves nothing behind."""

from __future__ import annotations

import glob
import os
import tempfile

import pytest

from nixl_async.testing.etcd import EtcdStartError, etcd_or_skip


def _etcd_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "nixl-async-etcd-*")))


def test_an_etcd_that_will_not_start_fails_and_leaves_no_data_directory():
    """Before, any start failure (a bad flag, a port another server took) was a skip for everyone but
    root, and its data directory and log stayed in /tmp."""
    before = _etcd_dirs()
    with (
        pytest.raises(EtcdStartError, match="max-request-bytes"),  # (the binary's own words, from its log)
        etcd_or_skip(options=["--max-request-bytes=not-a-number"]),
    ):
        pytest.fail("etcd started with a flag it cannot parse")
    assert _etcd_dirs() == before


def test_a_started_etcd_answers_and_its_directory_goes_with_it():
    before = _etcd_dirs()
    with etcd_or_skip() as server:
        server.put(b"k", b"v")
        assert server.get(b"k") == b"v"
    assert _etcd_dirs() == before
