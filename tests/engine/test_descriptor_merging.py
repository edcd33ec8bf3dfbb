"""The descriptor ids we hand NIXL let it merge runs of blocks, as NIXL itself counts them.

Two real agents in this process (no engine): the test is about what NIXL makes of our ids, read
from its own telemetry (`descCount`, the descriptors the transfer was really posted as).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from nixl_async._agent import nixl_agent, nixl_agent_config
from nixl_async.layout import BlockLayout, pair_descriptor_id_rows, pair_descriptor_ids, pair_short_ids

BLOCKS, BLOCK_LEN = 96, 256


class Pair:
    """A reader agent and a source agent, each with one region of blocks, the reader knowing the source."""

    def __init__(self) -> None:
        config = nixl_agent_config(enable_prog_thread=False, backends=["UCX"], capture_telemetry=True)
        self.reader, self.source = nixl_agent("merge-reader", config), nixl_agent("merge-source", config)
        self.dst = np.zeros(BLOCKS * BLOCK_LEN, np.uint8)
        self.src = (np.arange(BLOCKS * BLOCK_LEN) % 251).astype(np.uint8)
        self.regs = [agent.register_memory(np.array([[buf.ctypes.data, buf.nbytes, 0]], np.uint64), "DRAM")
                     for agent, buf in ((self.reader, self.dst), (self.source, self.src))]  # fmt: skip
        self.reader.add_remote_agent(self.source.get_agent_metadata())
        self.local = BlockLayout.from_regions("kv", [self.dst.ctypes.data], num_blocks=BLOCKS, block_len=BLOCK_LEN)
        self.remote = BlockLayout.from_regions("kv", [self.src.ctypes.data], num_blocks=BLOCKS, block_len=BLOCK_LEN)
        self.local_dlist = self.reader.prep_xfer_dlist("", self.local.view().descriptors(), "DRAM")
        self.remote_dlist = self.reader.prep_xfer_dlist("merge-source", self.remote.view().descriptors(), "DRAM")

    def posted_descriptors(self, lidx: Any, ridx: Any) -> int:
        """READ the pairs; check the bytes; return how many descriptors NIXL posted them as."""
        self.dst[:] = 0
        handle = self.reader.make_prepped_xfer("READ", self.local_dlist, lidx, self.remote_dlist, ridx)
        try:
            state, deadline = self.reader.transfer(handle), time.monotonic() + 10
            while state == "PROC" and time.monotonic() < deadline:
                self.source.get_new_notifs()  # (progresses the source's worker too)
                state = self.reader.check_xfer_state(handle)
            assert state == "DONE"
            for li, ri in zip(np.asarray(lidx).tolist(), np.asarray(ridx).tolist(), strict=True):
                got = self.dst[li * BLOCK_LEN : (li + 1) * BLOCK_LEN]
                assert (got == self.src[ri * BLOCK_LEN : (ri + 1) * BLOCK_LEN]).all()
            return int(self.reader.get_xfer_telemetry(handle).descCount)
        finally:
            self.reader.release_xfer_handle(handle)

    def close(self) -> None:
        for dlist in (self.local_dlist, self.remote_dlist):
            self.reader.release_dlist_handle(dlist)
        for agent, reg in zip((self.reader, self.source), self.regs, strict=True):
            agent.deregister_memory(reg)


@pytest.fixture(scope="module")
def agents() -> Iterator[Pair]:
    pair = Pair()
    yield pair
    pair.close()


# What vLLM's block pool hands out in steady state: a finished request's blocks come back last
# first, so a new request often holds runs of blocks in descending order, on either server.
DESCENDING = list(range(20, 10, -1))  # one run of 10, last first
TWO_RUNS = list(range(45, 40, -1)) + list(range(70, 64, -1))  # two runs, each last first


@pytest.mark.parametrize(("local", "remote", "runs"), [
    (DESCENDING, list(range(60, 50, -1)), 1),
    (TWO_RUNS, list(range(35, 30, -1)) + list(range(95, 89, -1)), 2),
    (list(range(90, 50, -1)), list(range(40, 0, -1)), 1),  # longer than the short path takes
])  # fmt: skip
def test_runs_given_last_first_on_both_sides_post_as_one_descriptor_each(agents, local, remote, runs):
    view, rview = agents.local.view(), agents.remote.view()
    lidx, ridx = pair_descriptor_ids(view, np.array(local), rview, np.array(remote))
    assert agents.posted_descriptors(lidx, ridx) == runs
    short = pair_short_ids(view, local, rview, remote, op="READ")
    if short is not None:
        assert agents.posted_descriptors(*short) == runs
    rows_l, rows_r = pair_descriptor_id_rows(view, np.array([local]), rview, np.array([remote]))
    assert agents.posted_descriptors(rows_l[0], rows_r[0]) == runs


def test_blocks_without_a_common_run_stay_one_descriptor_each(agents):
    """The order changes nothing where nothing runs on both sides (here the remote run goes the other way)."""
    local, remote = DESCENDING, list(range(51, 61))
    lidx, ridx = pair_descriptor_ids(agents.local.view(), np.array(local), agents.remote.view(), np.array(remote))
    assert agents.posted_descriptors(lidx, ridx) == len(local)
