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
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["Between", "ModelThread", "StepLoad", "step_times_beside_reads"]

LAUNCHES = 300  # small kernels per step: an eager-mode decode step launches hundreds
PHASE_S = 1.0  # each set-up runs this long, per round


class Between(Protocol):
    """What runs in the model thread around its steps (vLLM's connector hooks)."""

    def start(self) -> None: ...
    def __call__(self) -> None: ...
    def stop(self) -> None: ...


class ModelThread:
    """Steps a stand-in decode step until stopped, with `between` run between steps, all in its own thread."""

    def __init__(self, device: torch.device, between: Between | None = None) -> None:
        big = 8192 if device.type == "cuda" else 256
        self.a = torch.randn(big, big, device=device, dtype=torch.bfloat16)
        self.b = torch.randn(big, big, device=device, dtype=torch.bfloat16)
        self.c = torch.empty(big, big, device=device, dtype=torch.bfloat16)
        self.x = torch.ones(4096, device=device)
        self.device = device
        self.between = between
        self.steps: list[float] = []  # whole steps, `between` included
        self.launching: list[float] = []  # the part of each step spent issuing its kernels (CPU, GIL, driver)
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="model-step", daemon=True)

    def step(self) -> float:
        """One step; returns when its launches were all issued (the rest is waiting for the GPU)."""
        for _ in range(LAUNCHES):
            self.x.mul_(1.0000001)
        torch.mm(self.a, self.b, out=self.c)
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


def _summary(model: ModelThread, moved: int, seconds: float) -> dict[str, float]:
    ms = np.asarray(model.steps or [0.0]) * 1e3
    launch_ms = np.asarray(model.launching or [0.0]) * 1e3
    return {"step_ms_p50": float(np.percentile(ms, 50)), "step_ms_p99": float(np.percentile(ms, 99)),
            "launch_ms_p50": float(np.percentile(launch_ms, 50)), "steps": len(model.steps),
            "GB/s": moved / seconds / 1e9}  # fmt: skip


async def step_times_beside_reads(device: torch.device, engine_read: Callable[[], Awaitable[int]],
                                  pattern: StepLoad, rounds: int = 2) -> dict[str, list[dict[str, float]]]:  # fmt: skip
    """Per set-up and round: model steps alone, beside `engine_read()` looped on this loop (it
    returns the bytes it read), and with `pattern` run between the steps, in alternating order."""
    out: dict[str, list[dict[str, float]]] = {"alone": [], "engine": [], "vllm_pattern": []}
    for r in range(rounds):
        order = ["alone", "engine", "vllm_pattern"]
        for setup in order if r % 2 == 0 else order[::-1]:
            moved = 0
            with ModelThread(device, pattern if setup == "vllm_pattern" else None) as model:
                started = time.perf_counter()
                while time.perf_counter() - started < PHASE_S:
                    if setup == "engine":
                        moved += await engine_read()
                    else:
                        await asyncio.sleep(0.01)
                seconds = time.perf_counter() - started
            if setup == "vllm_pattern":
                moved, pattern.moved = pattern.moved, 0
            out[setup].append(_summary(model, moved, seconds))
    return out
