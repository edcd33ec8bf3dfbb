"""A model thread beside KV reads: what each way of posting costs the server's own steps (docs/gpu.md).

vLLM's NixlConnector posts a request's READ from the model thread (`start_load_kv`) and checks it
there once per step (`get_finished`). A cuda_ipc READ copies inside the post, so that thread waits
the copy out before its step can go on. The engine posts from its own loop thread, which gives the
GIL up while NIXL copies. Here a thread runs a stand-in for a decode step (hundreds of small kernel
launches from Python, one large matmul, a synchronize) while READs run back to back, posted either
way, and the step times are compared with the thread's steps alone.

The vLLM side is a *model* of its pattern (one post from the stepping thread when none is in flight,
the state checked once per step, NIXL's public API over prepared lists), not vLLM's code: the
device image has no vLLM.

Two more set-ups tell where the cost comes from: READs by another process on the same GPU (its
own GIL and CUDA context), and a thread that only hands the GIL back and forth. On a GPU each
set-up also runs with the step captured once as a CUDA graph and replayed, as vLLM runs decode
steps by default.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import select
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["Between", "ModelThread", "ReaderProcess", "StepLoad", "step_times_beside_reads"]

LAUNCHES = 300  # small kernels per step: an eager-mode decode step launches hundreds
PHASE_S = 1.0  # each set-up runs this long, per round
HANDOFF_SLEEP_S = 0.0002  # the GIL-handoff thread's sleep: ~4,000 handoffs a second, 20x a READ loop's


class Between(Protocol):
    """What runs in the model thread around its steps (vLLM's connector hooks)."""

    def start(self) -> None: ...
    def __call__(self) -> None: ...
    def stop(self) -> None: ...


class ModelThread:
    """Steps a stand-in decode step until stopped, with `between` run between steps, all in its own thread."""

    def __init__(self, device: torch.device, between: Between | None = None, *, graph: bool = False) -> None:
        big = 8192 if device.type == "cuda" else 256
        self.a = torch.randn(big, big, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(big, big, device=device, dtype=torch.bfloat16)
        self.c = torch.empty(big, big, device=device, dtype=torch.bfloat16)
        self.x = torch.ones(4096, device=device)
        self.device = device
        self.between = between
        self.graph = graph and device.type == "cuda"  # captured in the thread, before its first step
        self._graph: torch.cuda.CUDAGraph | None = None
        self.steps: list[float] = []  # whole steps, `between` included
        self.launching: list[float] = []  # the part of each step spent issuing its kernels (CPU, GIL, driver)
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="model-step", daemon=True)

    def _launch(self) -> None:
        for _ in range(LAUNCHES):
            self.x.mul_(1.0000001)
        torch.mm(self.a, self.b, out=self.c)

    def _capture(self) -> None:
        """The step as one CUDA graph (warmed up on a side stream first, as capture requires)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._launch()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine's thread may call CUDA (UCX's copies) while this one captures
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._launch()
        self._graph = graph

    def step(self) -> float:
        """One step; returns when its launches were all issued (the rest is waiting for the GPU)."""
        if self._graph is not None:
            self._graph.replay()
        else:
            self._launch()
        launched = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return launched

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            if self.between is not None:
                self.between.start()
            try:
                if self.graph:
                    self._capture()
                self.step()  # warm up (allocator, kernels)
                self._ready.set()
                while not self._stop.is_set():
                    started = time.perf_counter()
                    launched = self.step()
                    if self.between is not None:
                        self.between()
                    self.steps.append(time.perf_counter() - started)
                    self.launching.append(launched - started)
            finally:
                if self.between is not None:
                    self.between.stop()
        except BaseException as exc:  # reported by __exit__
            self.error = exc
        finally:
            self._ready.set()

    def __enter__(self) -> ModelThread:
        self._thread.start()
        self._ready.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise RuntimeError(f"the model thread failed: {self.error!r}") from self.error


# One READ's worth of NIXL calls: post() -> (handle, state), state(handle), release(handle), close()
Reader = tuple[Callable[[], tuple[Any, str]], Callable[[Any], str], Callable[[Any], None], Callable[[], None]]


class StepLoad:
    """vLLM's pattern: READs posted and checked by the stepping thread itself, one per step at most.

    `open_reader` is called in that thread (a NIXL agent belongs to the thread that made it, as
    vLLM's worker makes its own).
    """

    def __init__(self, open_reader: Callable[[], Reader], nbytes: int) -> None:
        self._open, self._nbytes = open_reader, nbytes
        self._reader: Reader | None = None  # while started
        self._handle: Any = None
        self.moved = 0  # bytes of the READs that completed while the thread stepped
        self.failed: list[str] = []

    def start(self) -> None:
        self._reader = self._open()

    def __call__(self) -> None:
        assert self._reader is not None
        post, state_of, release, _ = self._reader
        if self._handle is None:  # start_load_kv: post the next request's READ
            self._handle, state = post()
        else:  # get_finished: one state check per step
            state = state_of(self._handle)
        if state == "PROC":
            return
        release(self._handle)
        self._handle = None
        if state == "DONE":
            self.moved += self._nbytes
        else:
            self.failed.append(state)

    def stop(self) -> None:
        """Wait out a READ still in flight, release it, close the reader."""
        assert self._reader is not None
        moved = self.moved
        while self._handle is not None:
            self()
        self.moved = moved  # (a READ that lands after the steps stopped is not counted)
        self._reader[3]()
        self._reader = None


class ReaderProcess:
    """Another process reading back to back while told to: the same READs with its own GIL and CUDA context.

    `spec`: what `read_forever` needs (device, blocks, the peer's address and layout, UCX settings).
    Each reply is awaited at most `REPLY_TIMEOUT_S`; a child that misses it, or dies, is killed and
    the caller gets a `RuntimeError` saying so.
    """

    REPLY_TIMEOUT_S = 60.0

    def __init__(self, spec: dict[str, Any]) -> None:
        cmd = [sys.executable, "-m", "nixl_async_benchmarks.gpu_model_step", "--reader", json.dumps(spec)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.verified: bool | None = None  # its destination held what it read (told on close)
        self.error: str | None = None  # why `close` could not hear that
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read_replies, name="reader-process-replies", daemon=True).start()
        try:
            self._expect("ready")
        except BaseException:
            self._kill()
            raise

    def _read_replies(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # (NIXL's and UCX's own lines go to stdout too)
            if line.startswith("{"):
                self._replies.put(json.loads(line))
        self._replies.put(None)  # its stdout closed: it ended

    def _expect(self, key: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.REPLY_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = self._replies.get(timeout=left)
            except queue.Empty:
                break
            if reply is None:
                raise RuntimeError(f"the reader process ended (exit {self.proc.wait()}) before saying {key!r}")
            if key in reply:
                return reply
        self._kill()
        raise RuntimeError(f"the reader process did not say {key!r} within {self.REPLY_TIMEOUT_S:.0f} s: killed")

    def _say(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            raise RuntimeError(f"the reader process ended (exit {self.proc.wait()}) before {line!r}") from None

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def go(self) -> None:
        self._say("go")

    def pause(self) -> tuple[int, float]:
        """Stop reading; the bytes it read since `go` and the seconds it read for."""
        self._say("pause")
        reply = self._expect("moved")
        return int(reply["moved"]), float(reply["seconds"])

    def close(self) -> None:
        """End it; never raises (it runs in `finally` blocks): `verified` False and `error` say what failed."""
        try:
            self._say("close")
            self.verified = bool(self._expect("verified")["verified"])
            self.proc.wait(self.REPLY_TIMEOUT_S)
        except Exception as exc:
            self.verified, self.error = False, f"{type(exc).__name__}: {exc}"
        finally:
            self._kill()


def _stdin_commands() -> Callable[[bool], str | None]:
    """Lines from stdin, read from its file descriptor (a buffered reader would hide a line from select)."""
    pending = b""

    def next_command(wait: bool) -> str | None:
        nonlocal pending
        while b"\n" not in pending:
            if not wait and not select.select([0], [], [], 0)[0]:
                return None
            chunk = os.read(0, 4096)
            if not chunk:
                return "close"  # the parent went away
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        return line.decode().strip()

    return next_command


def read_forever(spec: dict[str, Any]) -> None:
    """The reader process: READs back to back between "go" and "pause" on stdin; checks its bytes on "close"."""
    from . import gpu_check as gc
    from .common import RawReader

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    n, block_len = spec["blocks"], spec["block_len"]
    memory = gc.Memory(gc.LayoutSpec("reader", "vram", None, n, block_len=block_len), device)
    raw = RawReader(spec["name"], memory.flat_layout(), tuple(spec["address"]), progress_thread=False,
                    ucx_params=spec["ucx"], remote_layout=spec["remote_layout"])  # fmt: skip
    local, remote = np.arange(n), np.asarray(spec["order"])
    raw.read(local, remote)  # wire-up
    print(json.dumps({"ready": True}), flush=True)
    next_command = _stdin_commands()
    command = next_command(True)
    while command != "close":
        if command == "go":
            reads, started = 0, time.perf_counter()
            while (command := next_command(False)) is None:
                raw.read(local, remote)
                reads += 1
            print(json.dumps({"moved": reads * n * block_len, "seconds": time.perf_counter() - started}), flush=True)
            if command == "close":
                break
        command = next_command(True)
    raw.close()
    copy = gc.BlockCopy(spec["src_seed"], spec["src_region_len"], spec["src_block_len"], list(spec["order"]),
                        block_len, list(range(n)))  # fmt: skip
    print(json.dumps({"verified": gc.verify(memory, [copy], device)["ok"]}), flush=True)


class GilHandoffs:
    """A thread that only gives the GIL up and takes it back, thousands of times a second (no CUDA, no NIXL)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-handoffs", daemon=True)
        self.handoffs = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            time.sleep(HANDOFF_SLEEP_S)
            self.handoffs += 1

    def __enter__(self) -> GilHandoffs:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _summary(model: ModelThread, moved: int, seconds: float) -> dict[str, float]:
    ms = np.asarray(model.steps or [0.0]) * 1e3
    launch_ms = np.asarray(model.launching or [0.0]) * 1e3
    return {"step_ms_p50": float(np.percentile(ms, 50)), "step_ms_p99": float(np.percentile(ms, 99)),
            "step_ms_mean": float(ms.mean()), "launch_ms_p50": float(np.percentile(launch_ms, 50)),
            "steps": len(model.steps),
            "GB/s": moved / seconds / 1e9}  # fmt: skip


def setups(device: torch.device) -> list[str]:
    """Every set-up, in the order of a round: on a GPU each READ set-up also with graph-replayed steps."""
    eager = ["alone", "engine", "vllm_pattern", "other_process", "gil_handoffs"]
    graphs = [f"graph_{s}" for s in eager if s != "gil_handoffs"] if device.type == "cuda" else []
    return eager + graphs


async def step_times_beside_reads(device: torch.device, engine_read: Callable[[], Awaitable[int]],
                                  pattern: StepLoad, other: ReaderProcess,
                                  rounds: int = 2) -> dict[str, list[dict[str, float]]]:  # fmt: skip
    """Per set-up and round: model steps alone, beside `engine_read()` looped on this loop (it
    returns the bytes it read), with `pattern` run between the steps, beside `other` reading, and
    beside GIL handoffs, in alternating order."""
    order = setups(device)
    out: dict[str, list[dict[str, float]]] = {setup: [] for setup in order}
    for r in range(rounds):
        for setup in order if r % 2 == 0 else order[::-1]:
            what = setup.removeprefix("graph_")
            moved = 0
            handoffs = GilHandoffs() if what == "gil_handoffs" else None
            with (
                handoffs or contextlib.nullcontext(),
                ModelThread(
                    device, pattern if what == "vllm_pattern" else None, graph=setup.startswith("graph_")
                ) as model,
            ):
                if what == "other_process":
                    other.go()
                started, handed = time.perf_counter(), handoffs.handoffs if handoffs else 0
                while time.perf_counter() - started < PHASE_S:
                    if what == "engine":
                        moved += await engine_read()
                    else:
                        await asyncio.sleep(0.01)
                seconds = time.perf_counter() - started
                handed = (handoffs.handoffs if handoffs else 0) - handed
                if what == "other_process":
                    moved, seconds = other.pause()
            if what == "vllm_pattern":
                moved, pattern.moved = pattern.moved, 0
            out[setup].append(_summary(model, moved, seconds))
            if handoffs is not None:
                out[setup][-1]["GIL handoffs/s"] = handed / seconds
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--reader":
        read_forever(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: python -m nixl_async_benchmarks.gpu_model_step --reader SPEC (started by the GPU check)")


if __name__ == "__main__":
    main()
