"""The GPU check (issue 15): VRAM and host-staging paths on one lent GPU, every byte checked.

Run on a machine with a CUDA GPU (see docs/gpu.md; ``bash scripts/gpu-check.sh`` on the device)::

    python -m nixl_async_benchmarks.gpu_check --out DIR [--quick]

Two processes share GPU 0. A *peer* process (this module with ``--role peer``) registers CUDA
tensors shaped like FlashAttention's KV cache (``[2, blocks, heads, block_size, head_dim]`` bf16
per layer, K and V registered as two regions, as the vLLM adapter does) plus pinned host memory,
fills them with a deterministic pattern on the GPU, serves handshakes and obeys JSON commands on
its stdin (verify a layout, zero it, wait for notifications). The main process then checks:

- READ and WRITE between VRAM regions: whole blocks, a TP head slice (``ViewSpec(chunk_offset,
  chunk_len)`` on either side), a block-size ratio (``ViewSpec(split=2)``), with notifications;
- VRAM <-> DRAM both ways, with either side holding the host memory;
- the adapter's read path (`nixl_async_vllm.worker.receive`) between VRAM caches with a TP 1 -> 2
  fan-out and a block-size ratio of 2, against a head/token oracle;
- the adapter's host staging (``kv_buffer_device=cpu`` with CUDA caches) through
  `ConnectorWorker` itself, vLLM replaced by stand-ins for the three things it imports;
- cancellation and a deadline mid-transfer: the error arrives, no NIXL handle is left and the
  destination memory no longer changes afterwards (the engine's memory-quiet contract);
- READ throughput against a raw NIXL loop over the same descriptors, and the engine's CPU share;
- a model thread's step times beside READs posted by the engine's loop, or from that thread itself as
  vLLM's connector posts them (`gpu_model_step`).

Every destination is compared in full with what it must hold (copied bytes from the pattern,
zeros elsewhere) with torch on the GPU. Results go to ``DIR/gpu-check.json`` and
``DIR/gpu-check.md``, rewritten after every check so a run cut short still reports.

Without CUDA (or with ``--cpu-dry-run``) it checks imports, argument parsing, the pattern and the
oracles on the CPU, writes the summary and stops before the GPU checks: exit 0 under
``--cpu-dry-run``, 2 otherwise. ``--device cpu`` runs every check with host memory instead, to
develop this script on a machine without a GPU (it proves the plumbing, not the VRAM paths).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime
import faulthandler
import functools
import importlib
import importlib.metadata
import json
import os
import platform
import queue
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from nixl_async import BlockLayout

CUDA_MISSING = "CUDA not available: stopping before the GPU checks"
DRY_RUN = "--cpu-dry-run: stopping before the GPU checks"
_READY = "GPUCHECK-READY "
_REPLY = "GPUCHECK-REPLY "

# Caches as vLLM 0.32 hands FlashAttention's to a connector: per layer one view [blocks, heads,
# block_size, 2 * head_dim] bf16, head-major (KV cache layout LBHNC), a token's K and V side by side.
LAYERS, HEADS, HEAD_DIM, ELT = 2, 8, 128, 2
ROW = 2 * HEAD_DIM * ELT  # bytes of one head's K and V for one token
PEER_BS, DECODE_BS = 16, 32  # tokens per block: producer, and a reader with block-size ratio 2
BLOCKS = 64
TPUT_BLOCK_LENS = (64 << 10, 1 << 20)
OLD_POST_BYTES = 64 << 20  # the throughput check's second engine: max_post_bytes as it was until 2026-11-27
QUIET_POST_BYTES = 32 << 20  # the cancel and deadline checks' engine: reads of several slices on any device
CHECK_TIMEOUT_S = 150.0
ENGINE_CHECKS = frozenset({
    "vram_read_blocks", "vram_write_blocks", "vram_read_tp_head_slice", "vram_write_tp_head_slice",
    "vram_read_block_ratio_split2", "read_remote_vram_into_dram", "write_dram_into_remote_vram",
    "read_remote_dram_into_vram", "write_vram_into_remote_dram", "cancel_mid_transfer_memory_quiet",
    "deadline_mid_transfer_memory_quiet", "throughput_vs_raw_nixl", "model_steps_beside_reads",
})  # fmt: skip
MODEL_STEP_READ_BYTES = 256 << 20  # one request's KV, read again and again beside the model thread

# -- the pattern --------------------------------------------------------------------------------
_P1, _P2, _MASK = 2654435761, 0x45D9F3B, 0xFFFFFFFF
_CHUNK_WORDS = 1 << 24


def _salt(seed: int, region: int) -> int:
    return (seed * 1_000_003 + region * 7_919 + 1) & _MASK


def pattern(seed: int, region: int, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The `nbytes` bytes region `region` holds when filled with `seed` (uint8, on `device`).

    A function of (seed, region, byte offset) only, computed in int64 without overflow so the
    GPU and the CPU agree; any process can check any byte range without shipping data.
    """
    if nbytes % 4:
        raise ValueError("pattern regions must be a multiple of 4 bytes")
    words = nbytes // 4
    out = torch.empty((words, 4), dtype=torch.uint8, device=device)
    salt = _salt(seed, region)
    for start in range(0, words, _CHUNK_WORDS):
        stop = min(words, start + _CHUNK_WORDS)
        x = (torch.arange(start, stop, dtype=torch.int64, device=device) * _P1 + salt) & _MASK
        x = x ^ (x >> 16)
        x = (x * _P2) & _MASK
        x = x ^ (x >> 16)
        x = (x * _P2) & _MASK
        x = x ^ (x >> 16)
        for k in range(4):
            out[start:stop, k] = ((x >> (8 * k)) & 0xFF).to(torch.uint8)
    return out.view(-1)


def pattern_numpy(seed: int, region: int, nbytes: int) -> np.ndarray:
    """The same pattern written independently with numpy (the reference for the self-test)."""
    x = (np.arange(nbytes // 4, dtype=np.int64) * _P1 + _salt(seed, region)) & _MASK
    for _ in range(2):
        x ^= x >> 16
        x = (x * _P2) & _MASK
    x ^= x >> 16
    return x.astype("<u4").view(np.uint8)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor."""
    return tensor.reshape(-1).view(torch.uint8)


# -- layouts both processes build ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayoutSpec:
    """Memory one process registers as a layout.

    ``heads > 0``: FlashAttention's caches as vLLM 0.32 hands them over, LAYERS tensors
    ``[num_blocks, heads, block_size, 2 * HEAD_DIM]`` bf16, one region per layer. Otherwise
    ``regions`` flat byte regions of ``num_blocks * block_len``.
    """

    name: str
    mem: str  # "vram" or "dram"
    seed: int | None  # None: zero-filled
    num_blocks: int
    heads: int = 0
    block_size: int = 0
    block_len: int = 0
    regions: int = 1
    pages: int = 1  # kernel pages per block: the view has num_blocks * pages rows of block_size / pages tokens

    @property
    def block_bytes(self) -> int:
        return self.heads * self.block_size * ROW if self.heads else self.block_len

    @property
    def region_len(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def num_regions(self) -> int:
        return LAYERS if self.heads else self.regions


def fa(name: str, mem: str, seed: int | None, *, heads: int = HEADS, block_size: int = PEER_BS,
       num_blocks: int = BLOCKS, pages: int = 1) -> LayoutSpec:  # fmt: skip
    return LayoutSpec(name, mem, seed, num_blocks, heads=heads, block_size=block_size, pages=pages)


def logical_blocks(flat: torch.Tensor, spec: LayoutSpec) -> torch.Tensor:
    """A cache's bytes as ``(block, head, token, ROW)``, its kernel pages put back together."""
    k = spec.pages
    paged = flat.view(spec.num_blocks, k, spec.heads, spec.block_size // k, ROW)
    return paged.permute(0, 2, 1, 3, 4).reshape(spec.num_blocks, spec.heads, spec.block_size, ROW)


def paged_bytes(logical: torch.Tensor, spec: LayoutSpec) -> torch.Tensor:
    """The inverse of `logical_blocks`: flat bytes in the order of the cache's kernel pages."""
    k = spec.pages
    split = logical.reshape(spec.num_blocks, spec.heads, k, spec.block_size // k, ROW)
    return split.permute(0, 2, 1, 3, 4).reshape(-1)


class Memory:
    """The tensors of one layout: `caches` (FlashAttention-shaped, or the flat regions) and `regions`."""

    def __init__(self, spec: LayoutSpec, device: torch.device) -> None:
        self.spec = spec
        where = device if spec.mem == "vram" else torch.device("cpu")
        pin = spec.mem == "dram" and device.type == "cuda"
        if spec.heads:
            shape = (spec.num_blocks * spec.pages, spec.heads, spec.block_size // spec.pages, 2 * HEAD_DIM)
            self.caches = [
                torch.zeros(shape, dtype=torch.bfloat16, device=where, pin_memory=pin) for _ in range(LAYERS)
            ]
            self.regions = list(self.caches)
        else:
            self.caches = [torch.zeros(spec.region_len, dtype=torch.uint8, device=where, pin_memory=pin)
                           for _ in range(spec.regions)]  # fmt: skip
            self.regions = list(self.caches)

    def flat_layout(self, num_blocks: int | None = None) -> BlockLayout:
        """Its first region as a NIXL layout of `num_blocks` (all) blocks, for a raw NIXL agent of its own."""
        from nixl_async import BlockLayout, MemType

        region = self.regions[0]
        return BlockLayout.from_regions(
            self.spec.name, [region.data_ptr()], num_blocks=num_blocks or self.spec.num_blocks,
            block_len=self.spec.block_bytes, mem_type=MemType.VRAM if region.is_cuda else MemType.DRAM,
            device_id=region.device.index or 0,
        )  # fmt: skip

    def fill(self, seed: int | None, compute: torch.device) -> None:
        for r, region in enumerate(self.regions):
            if seed is None:
                region.zero_()
            else:
                as_bytes(region).copy_(pattern(seed, r, self.spec.region_len, compute))
        synchronize(compute)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- what a destination must hold ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BlockCopy:
    """In every region r: ``dst[dst_blocks[i]][dst_off:+length] == src_pattern[src_blocks[i]][src_off:+length]``.

    The source is the pattern `src_seed` of a region of `src_region_len` bytes cut into
    `src_block_len`-byte blocks; the destination is cut into `dst_block_len`-byte blocks.
    """

    src_seed: int
    src_region_len: int
    src_block_len: int
    src_blocks: list[int]
    dst_block_len: int
    dst_blocks: list[int]
    src_off: int = 0
    dst_off: int = 0
    length: int = 0  # 0: the whole source block

    @classmethod
    def of(cls, payload: dict[str, Any]) -> BlockCopy:
        return cls(**payload)


def expected_regions(num_regions: int, region_len: int, copies: Sequence[BlockCopy],
                     device: torch.device) -> list[torch.Tensor]:  # fmt: skip
    """Zeros, with every copy applied: what each destination region must hold."""
    out = []
    sources: dict[tuple[int, int, int], torch.Tensor] = {}
    for r in range(num_regions):
        exp = torch.zeros(region_len, dtype=torch.uint8, device=device)
        for c in copies:
            key = (c.src_seed, r, c.src_region_len)
            if key not in sources:
                sources[key] = pattern(c.src_seed, r, c.src_region_len, device)
            length = c.length or c.src_block_len
            src = sources[key].view(-1, c.src_block_len)[:, c.src_off : c.src_off + length]
            dst = exp.view(-1, c.dst_block_len)[:, c.dst_off : c.dst_off + length]
            dst[torch.as_tensor(c.dst_blocks, device=device)] = src[torch.as_tensor(c.src_blocks, device=device)]
        out.append(exp)
    return out


def compare(regions: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """Compare every byte of `regions` with `expected` on `device`."""
    bad, first = 0, None
    checked = 0
    for r, (region, exp) in enumerate(zip(regions, expected, strict=True)):
        got = as_bytes(region).to(device)
        diff = got != exp
        n = int(diff.sum())
        checked += got.numel()
        if n and first is None:
            first = {"region": r, "offset": int(diff.nonzero()[0, 0]),
                     "got": int(got[diff][0]), "want": int(exp[diff][0])}  # fmt: skip
        bad += n
    return {"ok": bad == 0, "checked_bytes": checked, "bad_bytes": bad, "first_bad": first}


def verify(memory: Memory, copies: Sequence[BlockCopy], device: torch.device) -> dict[str, Any]:
    expected = expected_regions(memory.spec.num_regions, memory.spec.region_len, copies, device)
    return compare(memory.regions, expected, device)


def expected_fa_read(src: LayoutSpec, src_seed: int, dst: LayoutSpec, *, rank: int, remote_blocks: Sequence[int],
                     local_blocks: Sequence[int], device: torch.device) -> list[torch.Tensor]:  # fmt: skip
    """What a reader's FlashAttention cache holds after reading a request, head by head and token by token.

    The reader (rank `rank`, ``dst.heads`` heads, ``dst.block_size`` tokens per block) gets the
    producer's heads ``rank * dst.heads ...`` of the request's tokens: token t of its local block
    i is token ``i * dst.block_size + t`` of the request, found in remote block ``pos //
    src.block_size``. This oracle knows nothing of descriptors or views.
    """
    out = []
    n_local = len(local_blocks)
    need = n_local * dst.block_size
    for r in range(src.num_regions):
        prod = logical_blocks(pattern(src_seed, r, src.region_len, device), src)
        mine = prod[torch.as_tensor(list(remote_blocks), device=device)][:, rank * dst.heads : (rank + 1) * dst.heads]
        tokens = mine.permute(1, 0, 2, 3).reshape(dst.heads, -1, ROW)  # (head, position, bytes)
        if tokens.shape[1] < need:
            pad = torch.zeros(dst.heads, need - tokens.shape[1], ROW, dtype=torch.uint8, device=device)
            tokens = torch.cat([tokens, pad], dim=1)
        blocks = tokens[:, :need].reshape(dst.heads, n_local, dst.block_size, ROW).permute(1, 0, 2, 3)
        exp = torch.zeros(dst.num_blocks, dst.heads, dst.block_size, ROW, dtype=torch.uint8, device=device)
        exp[torch.as_tensor(list(local_blocks), device=device)] = blocks
        out.append(paged_bytes(exp, dst))
    return out


# -- the peer process ------------------------------------------------------------------------------
def peer_layouts(tput_bytes: int) -> list[LayoutSpec]:
    return [
        fa("kv", "vram", 11),
        fa("kv_w", "vram", None),
        fa("dram", "dram", 12),
        fa("dram_w", "dram", None),
        *(LayoutSpec(f"tput_{b >> 10}k", "vram", 13 + i, tput_bytes // b, block_len=b)
          for i, b in enumerate(TPUT_BLOCK_LENS)),
    ]  # fmt: skip


def producer_layouts() -> list[LayoutSpec]:
    """The adapter's producer: one layout, named as the adapter names it."""
    return [fa("kv", "vram", 41)]


async def _peer_main(spec: dict[str, Any]) -> None:
    from nixl_async import EngineConfig, TransferEngine

    device = torch.device(spec["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.init()  # before NIXL: UCX's CUDA transports need the runtime loaded
    layouts = {d["name"]: Memory(LayoutSpec(**d), device) for d in spec["layouts"]}
    async with TransferEngine(EngineConfig(engine_id=spec["engine_id"], transfer_timeout_s=60.0)) as engine:
        for mem in layouts.values():
            mem.fill(mem.spec.seed, device)
            engine.register(mem.spec.name, mem.regions, block_len=mem.spec.block_bytes)
        engine.set_extra(**{k: str(v) for k, v in spec.get("extra", {}).items()})
        host, port = await engine.serve("127.0.0.1", 0)
        print(_READY + json.dumps({"host": host, "port": port, "pid": os.getpid()}), flush=True)
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            try:
                result = await _peer_command(engine, layouts, device, cmd)
                reply: dict[str, Any] = {"ok": True, "result": result}
            except Exception as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            print(_REPLY + json.dumps(reply), flush=True)
            if cmd["op"] == "exit":
                break


async def _peer_command(engine: Any, layouts: dict[str, Memory], device: torch.device, cmd: dict[str, Any]) -> Any:
    op = cmd["op"]
    if op == "exit":
        return None
    if op == "zero":
        layouts[cmd["layout"]].fill(None, device)
        return None
    if op == "verify":
        return verify(layouts[cmd["layout"]], [BlockCopy.of(c) for c in cmd["copies"]], device)
    if op == "wait_notifications":
        senders = await engine.wait_notifications(cmd["message"].encode(), cmd["count"], timeout=cmd["wait_s"])
        return {"senders": list(senders)}
    if op == "wait_then_verify":  # a WRITE's notification must come after its data
        senders = await engine.wait_notifications(cmd["message"].encode(), 1, timeout=cmd["wait_s"])
        synchronize(device)
        outcome = verify(layouts[cmd["layout"]], [BlockCopy.of(c) for c in cmd["copies"]], device)
        return {"senders": list(senders), **outcome}
    if op == "live_handles":
        return engine.live_handles()
    raise ValueError(f"unknown command {op!r}")


class PeerProc:
    """The parent's handle on a peer process: start, command (JSON lines), stop."""

    def __init__(self, spec: dict[str, Any], time_limit: float) -> None:
        self.spec = spec
        cmd = [sys.executable, "-m", "nixl_async_benchmarks.gpu_check", "--role", "peer",
               "--peer-spec", json.dumps(spec), "--time-limit", str(time_limit + 30)]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name=f"peer-{spec['engine_id']}", daemon=True)
        self._reader.start()
        self.address: tuple[str, int] = ("", 0)
        self._lock = asyncio.Lock()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            for mark in (_READY, _REPLY):
                if line.startswith(mark):
                    self._lines.put({"mark": mark, **json.loads(line[len(mark) :])})
                    break
            else:  # UCX and NIXL log to stdout: pass it on
                sys.stderr.write(f"[peer {self.spec['engine_id']}] {line}")
        self._lines.put({"mark": "eof"})

    async def _next(self, timeout: float) -> dict[str, Any]:
        try:
            msg = await asyncio.to_thread(self._lines.get, True, timeout)
        except queue.Empty:
            raise TimeoutError(f"peer {self.spec['engine_id']} did not answer within {timeout}s") from None
        if msg["mark"] == "eof":
            raise RuntimeError(f"peer {self.spec['engine_id']} exited (rc {self.proc.poll()})")
        return msg

    async def ready(self, timeout: float = 180.0) -> tuple[str, int]:
        msg = await self._next(timeout)
        self.address = (msg["host"], int(msg["port"]))
        return self.address

    async def request(self, op: str, timeout: float = 120.0, **args: Any) -> Any:
        async with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
            msg = await self._next(timeout)
        if not msg["ok"]:
            raise RuntimeError(f"peer command {op} failed: {msg['error']}\n{msg.get('trace', '')}")
        return msg["result"]

    async def stop(self) -> int | None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                await self.request("exit", timeout=10)
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            await asyncio.to_thread(self.proc.wait, 20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait)
        return self.proc.returncode


# -- reporting -------------------------------------------------------------------------------------
@dataclasses.dataclass
class CheckResult:
    name: str
    ok: bool
    seconds: float
    details: dict[str, Any]
    error: str | None = None


class Report:
    """Check results, written to DIR/gpu-check.json and DIR/gpu-check.md after every check."""

    def __init__(self, out: Path, meta: dict[str, Any], only: frozenset[str] = frozenset()) -> None:
        self.out = out
        self.meta = meta
        self.only = only  # empty: every check (the handshake always runs before engine checks)
        self.checks: list[CheckResult] = []
        out.mkdir(parents=True, exist_ok=True)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    async def run(self, name: str, fn: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any] | None:
        if self.only and name not in self.only and name != "handshake":
            return None
        print(f"--- {name}", flush=True)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):  # one hung check must not cost the rest of the run
                details = await fn()
            result = CheckResult(name, bool(details.get("ok", True)), time.perf_counter() - started, details)
        except Exception as exc:
            trace = traceback.format_exc()
            print(trace, file=sys.stderr, flush=True)
            result = CheckResult(name, False, time.perf_counter() - started, {}, f"{type(exc).__name__}: {exc}")
        self.add(result)
        return result.details if result.error is None else None

    def add(self, result: CheckResult) -> None:
        self.checks.append(result)
        verdict = "ok" if result.ok else "FAILED"
        print(f"    {verdict} in {result.seconds:.2f}s {result.error or _short(result.details)}", flush=True)
        self.write()

    def write(self) -> None:
        data = {**self.meta, "all_ok": self.ok, "checks": [dataclasses.asdict(c) for c in self.checks]}
        (self.out / "gpu-check.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
        (self.out / "gpu-check.md").write_text(self.markdown())

    def markdown(self) -> str:
        m = self.meta
        lines = [
            "# nixl_async GPU check",
            "",
            f"- when: {m.get('started_utc')}",
            f"- mode: {m.get('mode')}",
            f"- device: {m.get('device_name')} (torch {m.get('torch')}, CUDA {m.get('torch_cuda')}, "
            f"driver {m.get('driver')})",
            f"- nixl {m.get('versions', {}).get('nixl')}, nixl_async {m.get('versions', {}).get('nixl_async')}, "
            f"Python {m.get('python')}",
            f"- command: `{m.get('command')}`",
            f"- result: {'all checks passed' if self.ok else 'SOME CHECKS FAILED'} ({len(self.checks)} run)",
            "",
            "| check | result | seconds | details |",
            "|---|---|---|---|",
        ]
        for c in self.checks:
            lines.append(f"| {c.name} | {'ok' if c.ok else '**FAILED**'} | {c.seconds:.2f} | "
                         f"{(c.error or _short(c.details)).replace('|', '/')} |")  # fmt: skip
        for c in self.checks:
            rows = c.details.get("rows")
            if rows:
                cols = list(rows[0])
                lines += ["", f"## {c.name}", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                lines += ["| " + " | ".join(_fmt(r.get(k)) for k in cols) + " |" for r in rows]
                lines += [f"- {note}" for note in c.details.get("notes", [])]
        return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _short(details: dict[str, Any], limit: int = 240) -> str:
    skip = {"ok", "rows", "notes"}
    text = ", ".join(f"{k}={_fmt(v)}" for k, v in details.items() if k not in skip)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- environment -----------------------------------------------------------------------------------
def check_imports() -> dict[str, Any]:
    """Import everything the checks need; versions of what is installed."""
    out: dict[str, Any] = {"ok": True, "versions": {}, "errors": {}}
    modules = ["numpy", "torch", "msgspec", "zmq", "nixl", "nixl_async", "nixl_async.testing",
               "nixl_async_vllm.worker"]  # fmt: skip
    for name in modules:
        try:
            if name == "nixl_async_vllm.worker":
                _import_adapter_worker()
            else:
                importlib.import_module(name)
        except Exception as exc:
            out["ok"] = False
            out["errors"][name] = f"{type(exc).__name__}: {exc}"
    for dist in ("torch", "numpy", "nixl", "nixl-cu13", "nixl-cu12", "msgspec", "pyzmq", "nixl-async", "uvloop"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out["versions"][dist] = importlib.metadata.version(dist)
    with contextlib.suppress(Exception):
        import nixl_async

        out["versions"]["nixl_async"] = nixl_async.__version__
    return out


def _import_adapter_worker() -> None:
    """The adapter's worker, over vLLM's stand-ins where vLLM is not installed (the device has none).

    Its modules keep what they bound at import (e.g. the push book's request-id helper).
    """
    try:
        importlib.import_module("vllm")
    except ImportError:
        with _VllmStandIns().installed():
            importlib.import_module("nixl_async_vllm.worker")
    else:
        importlib.import_module("nixl_async_vllm.worker")


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "host": socket.gethostname(),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_", "PYTORCH_CUDA", "CUDA_"))},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device_name=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}")  # fmt: skip
        with contextlib.suppress(Exception):
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20, check=False,
            ).stdout.strip()  # fmt: skip
    else:
        env["device_name"] = f"cpu ({platform.processor() or platform.machine()})"
    return env


# -- self-tests that need no GPU (run in the dry run too) ------------------------------------------
def self_test(device: torch.device) -> dict[str, Any]:
    """The pattern matches its numpy reference; both oracles match naive loops on small data."""
    nbytes = 1 << 16
    ref = torch.from_numpy(pattern_numpy(7, 3, nbytes))
    got = pattern(7, 3, nbytes, device).cpu()
    pattern_ok = torch.equal(ref, got) and not torch.equal(got, pattern(7, 4, nbytes, device).cpu())

    # BlockCopy: the vectorised oracle against a block-by-block loop in numpy.
    src_bl, dst_bl, nb = 64, 128, 8
    copy = BlockCopy(5, nb * src_bl, src_bl, [3, 1, 6], dst_bl, [0, 7, 2], src_off=16, dst_off=40, length=32)
    (exp,) = expected_regions(1, nb * dst_bl, [copy], device)
    naive = np.zeros(nb * dst_bl, np.uint8)
    src = pattern_numpy(5, 0, nb * src_bl)
    for s, d in zip(copy.src_blocks, copy.dst_blocks, strict=True):
        naive[d * dst_bl + 40 : d * dst_bl + 72] = src[s * src_bl + 16 : s * src_bl + 48]
    block_copy_ok = np.array_equal(exp.cpu().numpy(), naive)

    # FlashAttention oracle: against a token-by-token loop (TP 1 -> 2, block-size ratio 2).
    prod = fa("p", "vram", 9, num_blocks=6)
    dec = fa("d", "vram", None, heads=HEADS // 2, block_size=DECODE_BS, num_blocks=5)
    remote, local, rank = [4, 0, 2, 5], [3, 1], 1
    exp_fa = expected_fa_read(prod, 9, dec, rank=rank, remote_blocks=remote, local_blocks=local, device=device)
    fa_ok = True
    for r in range(prod.num_regions):
        src4 = pattern_numpy(9, r, prod.region_len).reshape(prod.num_blocks, HEADS, PEER_BS, ROW)
        want = np.zeros((dec.num_blocks, dec.heads, DECODE_BS, ROW), np.uint8)
        for i, block in enumerate(local):
            for t in range(DECODE_BS):
                rb, tok = divmod(i * DECODE_BS + t, PEER_BS)
                for h in range(dec.heads):
                    want[block, h, t] = src4[remote[rb], rank * dec.heads + h, tok]
        fa_ok = fa_ok and np.array_equal(exp_fa[r].cpu().numpy(), want.reshape(-1))
    ok = pattern_ok and block_copy_ok and fa_ok
    return {"ok": ok, "pattern": pattern_ok, "block_copy_oracle": block_copy_ok, "fa_oracle": fa_ok}


# -- the checks ------------------------------------------------------------------------------------
class Checks:
    """Every check, sharing one main engine connected to one peer."""

    def __init__(self, args: argparse.Namespace, device: torch.device, report: Report) -> None:
        self.args = args
        self.device = device
        self.report = report
        self.rng = np.random.default_rng(15)
        self.tput_bytes = args.tput_mib << 20
        self.engine: Any = None
        self.peer: Any = None  # nixl_async.Peer
        self.proc: PeerProc | None = None
        self.mem: dict[str, Memory] = {}
        self._raw_agents = 0

    # helpers
    def ids(self, n: int, of: int = BLOCKS) -> list[int]:
        return [int(b) for b in self.rng.choice(of, size=n, replace=False)]

    def local(self, spec: LayoutSpec) -> Memory:
        mem = Memory(spec, self.device)
        mem.fill(spec.seed, self.device)
        self.engine.register(spec.name, mem.regions, block_len=spec.block_bytes)
        self.mem[spec.name] = mem
        return mem

    async def peer_verify(self, layout: str, copies: Sequence[BlockCopy]) -> dict[str, Any]:
        assert self.proc is not None
        result: dict[str, Any] = await self.proc.request(
            "verify", layout=layout, copies=[dataclasses.asdict(c) for c in copies]
        )
        return result

    def peer_spec(self, name: str) -> LayoutSpec:
        return next(s for s in peer_layouts(self.tput_bytes) if s.name == name)

    def whole(self, src_seed: int, src: LayoutSpec, dst: LayoutSpec, dst_blocks: list[int],
              src_blocks: list[int]) -> BlockCopy:  # fmt: skip
        return BlockCopy(src_seed, src.region_len, src.block_bytes, src_blocks, dst.block_bytes, dst_blocks)

    # the run
    async def run(self) -> None:
        from nixl_async import EngineConfig, TransferEngine

        dev = str(self.device)
        if self.report.only and not self.report.only & ENGINE_CHECKS:
            await self.adapter_checks()
            return
        spec = {"engine_id": "gpu-check-peer", "device": dev,
                "layouts": [dataclasses.asdict(s) for s in peer_layouts(self.tput_bytes)]}  # fmt: skip
        self.proc = PeerProc(spec, self.args.time_limit)
        try:
            await self.proc.ready()
            async with TransferEngine(EngineConfig(engine_id="gpu-check-main", transfer_timeout_s=60.0)) as engine:
                self.engine = engine
                await self.report.run("handshake", self.handshake)
                if self.peer is not None:
                    await self.engine_checks()
        except Exception as exc:  # the peer did not start, or the engine did not: record it, go on
            traceback.print_exc()
            self.report.add(CheckResult("peer_and_engine", False, 0.0, {}, f"{type(exc).__name__}: {exc}"))
        finally:
            await self.proc.stop()
        await self.adapter_checks()

    async def adapter_checks(self) -> None:
        await self.report.run("adapter_receive_vram_tp1_to_tp2_ratio2", self.adapter_receive)
        await self.report.run("adapter_connector_worker_vram", functools.partial(self.connector_worker, "cuda"))
        await self.report.run("adapter_host_staging_connector_worker", functools.partial(self.connector_worker, "cpu"))
        await self.report.run("adapter_host_staging_kernel_pages2",
                              functools.partial(self.connector_worker, "cpu", pages=2))  # fmt: skip

    async def engine_checks(self) -> None:
        await self.report.run("vram_read_blocks", self.read_blocks)
        await self.report.run("vram_write_blocks", self.write_blocks)
        await self.report.run("vram_read_tp_head_slice", self.read_head_slice)
        await self.report.run("vram_write_tp_head_slice", self.write_head_slice)
        await self.report.run("vram_read_block_ratio_split2", self.read_split)
        await self.report.run("read_remote_vram_into_dram", self.read_vram_into_dram)
        await self.report.run("write_dram_into_remote_vram", self.write_dram_into_vram)
        await self.report.run("read_remote_dram_into_vram", self.read_dram_into_vram)
        await self.report.run("write_vram_into_remote_dram", self.write_vram_into_dram)
        await self.report.run("cancel_mid_transfer_memory_quiet", self.cancel_quiet)
        await self.report.run("deadline_mid_transfer_memory_quiet", self.deadline_quiet)
        await self.report.run("throughput_vs_raw_nixl", self.throughput)
        await self.report.run("model_steps_beside_reads", self.model_steps)

    async def handshake(self) -> dict[str, Any]:
        assert self.proc is not None
        for spec in (fa("kv", "vram", None), fa("src", "vram", 21), fa("kv_half", "vram", None, heads=HEADS // 2),
                     fa("half_src", "vram", 22, heads=HEADS // 2), fa("host", "dram", None),
                     fa("host_src", "dram", 23),
                     LayoutSpec("kv_bs2", "vram", None, BLOCKS // 2, block_len=2 * HEADS * PEER_BS * ROW,
                                regions=LAYERS)):  # fmt: skip
            self.local(spec)
        for b in TPUT_BLOCK_LENS:
            self.local(LayoutSpec(f"tput_{b >> 10}k", "vram", None, self.tput_bytes // b, block_len=b))
        started = time.perf_counter()
        self.peer = await self.engine.connect(*self.proc.address, expected_engine_id="gpu-check-peer")
        took = time.perf_counter() - started
        kinds = {name: f"{lay.mem_type}:{lay.device_id}" for name, lay in self.peer.layouts.items()}
        want_vram = "VRAM" if self.device.type == "cuda" else "DRAM"
        ours = {name: str(self.engine.layout(name).mem_type) for name in self.mem}
        ok = kinds["kv"].startswith(want_vram) and kinds["dram"].startswith("DRAM") and ours["kv"] == want_vram
        return {"ok": ok, "seconds_handshake": took, "peer_layouts": kinds, "our_layouts": ours}

    async def read_blocks(self) -> dict[str, Any]:
        assert self.proc is not None
        dst = self.mem["kv"]
        dst.fill(None, self.device)
        local, remote = self.ids(24), self.ids(24)
        result = await self.engine.read(self.peer, local, remote, local="kv", remote="kv", notify=b"gpu:read-blocks")
        outcome = verify(dst, [self.whole(11, self.peer_spec("kv"), dst.spec, local, remote)], self.device)
        note = await self.proc.request("wait_notifications", message="gpu:read-blocks", count=1, wait_s=10)
        return {**outcome, "nbytes": result.nbytes, "notified": note["senders"] == ["gpu-check-main"]}

    async def write_blocks(self) -> dict[str, Any]:
        assert self.proc is not None
        await self.proc.request("zero", layout="kv_w")
        local, remote = self.ids(24), self.ids(24)
        msg = "gpu:write-blocks"
        result = await self.engine.write(self.peer, local, remote, local="src", remote="kv_w", notify=msg.encode())
        copy = self.whole(21, self.mem["src"].spec, self.peer_spec("kv_w"), remote, local)
        outcome = await self.proc.request("wait_then_verify", layout="kv_w", message=msg, wait_s=10,
                                          copies=[dataclasses.asdict(copy)])  # fmt: skip
        return {**outcome, "nbytes": result.nbytes, "note": "verified on the peer right after the notification"}

    async def read_head_slice(self) -> dict[str, Any]:
        """A reader with twice the TP ranks: each rank's half of the heads of remote blocks."""
        from nixl_async import ViewSpec

        dst = self.mem["kv_half"]
        dst.fill(None, self.device)
        half = dst.spec.block_bytes
        src = self.peer_spec("kv")
        picks = self.ids(32)
        copies = []
        for rank in (0, 1):  # the two ranks' halves, into disjoint local blocks
            local, remote = picks[rank * 16 : rank * 16 + 16], self.ids(16)
            window = ViewSpec(layout="kv", chunk_offset=rank * half, chunk_len=half)
            await self.engine.read(self.peer, local, remote, local="kv_half", remote=window)
            copies.append(BlockCopy(11, src.region_len, src.block_bytes, remote, half, local, src_off=rank * half,
                                    length=half))  # fmt: skip
        return verify(dst, copies, self.device)

    async def write_head_slice(self) -> dict[str, Any]:
        """A writer with half the heads fills the second half-window of remote blocks."""
        from nixl_async import ViewSpec

        assert self.proc is not None
        await self.proc.request("zero", layout="kv_w")
        src = self.mem["half_src"].spec
        half = src.block_bytes
        local, remote = self.ids(16), self.ids(16)
        window = ViewSpec(layout="kv_w", chunk_offset=half, chunk_len=half)
        msg = "gpu:write-half"
        await self.engine.write(self.peer, local, remote, local="half_src", remote=window, notify=msg.encode())
        copy = BlockCopy(22, src.region_len, half, local, 2 * half, remote, dst_off=half, length=half)
        return dict(await self.proc.request("wait_then_verify", layout="kv_w", message=msg, wait_s=10,
                                            copies=[dataclasses.asdict(copy)]))  # fmt: skip

    async def read_split(self) -> dict[str, Any]:
        """Block-size ratio 2: each local block takes two remote blocks (local view split in 2 pieces)."""
        from nixl_async import ViewSpec

        dst = self.mem["kv_bs2"]
        dst.fill(None, self.device)
        src = self.peer_spec("kv")
        local, remote = self.ids(8, BLOCKS // 2), self.ids(16)
        await self.engine.read(self.peer, local, remote, local=ViewSpec(layout="kv_bs2", split=2), remote="kv")
        bl = src.block_bytes
        copies = [BlockCopy(11, src.region_len, bl, remote[k::2], 2 * bl, local, dst_off=k * bl) for k in (0, 1)]
        return verify(dst, copies, self.device)

    async def read_vram_into_dram(self) -> dict[str, Any]:
        dst = self.mem["host"]
        dst.fill(None, self.device)
        local, remote = self.ids(24), self.ids(24)
        await self.engine.read(self.peer, local, remote, local="host", remote="kv")
        return verify(dst, [self.whole(11, self.peer_spec("kv"), dst.spec, local, remote)], self.device)

    async def write_dram_into_vram(self) -> dict[str, Any]:
        assert self.proc is not None
        await self.proc.request("zero", layout="kv_w")
        local, remote = self.ids(24), self.ids(24)
        await self.engine.write(self.peer, local, remote, local="host_src", remote="kv_w")
        return await self.peer_verify("kv_w", [self.whole(23, self.mem["host_src"].spec, self.peer_spec("kv_w"),
                                                          remote, local)])  # fmt: skip

    async def read_dram_into_vram(self) -> dict[str, Any]:
        dst = self.mem["kv"]
        dst.fill(None, self.device)
        local, remote = self.ids(24), self.ids(24)
        await self.engine.read(self.peer, local, remote, local="kv", remote="dram")
        return verify(dst, [self.whole(12, self.peer_spec("dram"), dst.spec, local, remote)], self.device)

    async def write_vram_into_dram(self) -> dict[str, Any]:
        assert self.proc is not None
        await self.proc.request("zero", layout="dram_w")
        local, remote = self.ids(24), self.ids(24)
        await self.engine.write(self.peer, local, remote, local="src", remote="dram_w")
        return await self.peer_verify("dram_w", [self.whole(21, self.mem["src"].spec, self.peer_spec("dram_w"),
                                                            remote, local)])  # fmt: skip

    # cancellation and deadline -----------------------------------------------------------------
    async def _stopped_mid_transfer(self, how: str) -> dict[str, Any]:
        """A read stopped with slices in flight, by an engine of its own whose slices are at most
        `QUIET_POST_BYTES`: a cuda_ipc post copies its whole slice, so with the default cap one
        post could copy the whole read (at `--quick`'s 256 MiB) and nothing would be left to stop."""
        from nixl_async import EngineConfig, TransferEngine, TransferError

        assert self.proc is not None
        name = f"tput_{TPUT_BLOCK_LENS[-1] >> 10}k"
        src = self.peer_spec(name)
        dst = Memory(self.mem[name].spec, self.device)  # (zeros)
        n = src.num_blocks
        order = [int(b) for b in self.rng.permutation(n)]
        config = EngineConfig(engine_id=f"gpu-check-{how}", transfer_timeout_s=60.0, max_post_bytes=QUIET_POST_BYTES)
        async with TransferEngine(config) as engine:
            engine.register(name, dst.regions, block_len=dst.spec.block_bytes)
            peer = await engine.connect(*self.proc.address)
            await engine.read(peer, [0], [0], local=name, remote=name)  # wire-up
            dst.fill(None, self.device)
            # A deadline after the first slice is posted (nothing is posted past a deadline): slices
            # copy for up to 2 ms, so 1 ms ends the read between them, with data in flight.
            timeout = 1e-3 if how == "deadline" else None
            transfer = await engine.start_read(peer, list(range(n)), order, local=name, remote=name,
                                               timeout=timeout)  # fmt: skip
            if how == "cancel":  # let a few slices go out first, so the cancel meets data in flight
                for _ in range(10_000):
                    if transfer.done() or getattr(transfer, "slices_done", 0) >= 2:
                        break
                    await asyncio.sleep(0)
                transfer.cancel("gpu check: cancel mid-transfer")
            error: str | None = None
            try:
                await transfer
            except TransferError as exc:
                error = type(exc).__name__
            settled = await engine.settle([transfer], timeout=10.0)
            live = engine.live_handles().get("xfers", 0)
            synchronize(self.device)
            snap = [r.clone() for r in dst.regions]
            await asyncio.sleep(0.5)
            synchronize(self.device)
            quiet = all(torch.equal(a, b) for a, b in zip(dst.regions, snap, strict=True))
            # How much had landed (informational): blocks equal to their source, blocks still zero.
            whole = self.whole(src.seed or 0, src, dst.spec, list(range(n)), order)
            want = expected_regions(1, src.region_len, [whole], self.device)[0].view(n, -1)
            got = as_bytes(dst.regions[0]).view(n, -1)
            landed = int((got == want).all(dim=1).sum())
            untouched = int((got == 0).all(dim=1).sum())
            # The engine must still work: the same read again, verified in full.
            await engine.read(peer, list(range(n)), order, local=name, remote=name)
            after = verify(dst, [whole], self.device)
        expected_error = {"cancel": "TransferCancelled", "deadline": "TransferTimeout"}[how]
        ok = error == expected_error and settled and live == 0 and quiet and after["ok"]
        return {"ok": ok, "error": error, "expected": expected_error, "settled": settled, "live_xfers": live,
                "memory_quiet_after": quiet, "blocks_landed": landed, "blocks_untouched": untouched,
                "blocks_torn": n - landed - untouched, "read_after_ok": after["ok"]}  # fmt: skip

    async def cancel_quiet(self) -> dict[str, Any]:
        return await self._stopped_mid_transfer("cancel")

    async def deadline_quiet(self) -> dict[str, Any]:
        return await self._stopped_mid_transfer("deadline")

    # throughput --------------------------------------------------------------------------------
    async def throughput(self) -> dict[str, Any]:
        from nixl_async.config import SendBufferLimits

        from .common import busy_python_thread, raw_ucx_params

        assert self.proc is not None
        repeats = 3 if self.args.quick else 5
        rows: list[dict[str, Any]] = []
        ok = True
        ceiling = self._copy_ceiling(self.tput_bytes)
        engine_ucx = self.engine.config.backend_settings("UCX", os.environ, SendBufferLimits.of_host())
        for block_len in TPUT_BLOCK_LENS:
            name = f"tput_{block_len >> 10}k"
            dst, src = self.mem[name], self.peer_spec(name)
            n = src.num_blocks
            order = [int(b) for b in self.rng.permutation(n)]
            ids = list(range(n))
            copy = self.whole(src.seed or 0, src, dst.spec, ids, order)
            await self.engine.read(self.peer, [0], [0], local=name, remote=name)  # warm up the descriptor lists
            engine_gbps, engine_cpu, engine_slices = await self._engine_reads(name, ids, order, repeats)
            engine_check = verify(dst, [copy], self.device)
            # Beside a Python thread that holds the GIL whenever it can (a model thread, worst case):
            # a post copies with the GIL released, and each one waits to get it back.
            with busy_python_thread():
                beside_busy, _, _ = await self._engine_reads(name, ids, order, repeats)
            busy_check = verify(dst, [copy], self.device)
            old_cap = await self._old_cap_reads(name, ids, order, repeats, copy)
            # Raw NIXL loops over the same descriptors: with the engine's UCX settings (the same
            # transport: what the engine's own work costs) and with UCX's defaults (what a plain
            # NIXL agent, vLLM's NixlConnector among them, gets on this machine), but for the TCP
            # segment size, which the peer requires of its readers.
            raw_same = await self._raw_read(name, block_len, order, copy, engine_ucx)
            raw_default = await self._raw_read(name, block_len, order, copy, raw_ucx_params())
            # The busy goal's baseline (#13): the same raw loop checking every 1 ms instead of spinning.
            raw_paced = await self._raw_read(name, block_len, order, copy, engine_ucx, check_every_s=0.001)
            with busy_python_thread():
                raw_beside_busy = await self._raw_read(name, block_len, order, copy, engine_ucx)
            checked = [engine_check, busy_check, old_cap, raw_same, raw_default, raw_paced, raw_beside_busy]
            ok = ok and all(c["ok"] for c in checked)
            rows.append({
                "block": f"{block_len >> 10} KiB", "blocks": n, "MiB": self.tput_bytes >> 20,
                "engine GB/s": engine_gbps, "raw NIXL GB/s": raw_same["gbps"],
                "engine/raw": engine_gbps / raw_same["gbps"], "raw, UCX defaults GB/s": raw_default["gbps"],
                "engine CPU %": engine_cpu, "raw CPU %": raw_same["cpu"],
                "raw 1 ms GB/s": raw_paced["gbps"], "raw 1 ms CPU %": raw_paced["cpu"],
                "engine CPU ms/GB": engine_cpu * 10 / engine_gbps,
                "raw 1 ms CPU ms/GB": raw_paced["cpu"] * 10 / raw_paced["gbps"],
                "engine, Python thread busy GB/s": beside_busy, "raw, Python thread busy GB/s": raw_beside_busy["gbps"],
                "engine, slices per read": engine_slices,
                "engine, max_post_bytes 64 MiB GB/s": old_cap["gbps"],
                "same, Python thread busy GB/s": old_cap["busy_gbps"],
                "max_post_bytes 64 MiB, slices per read": old_cap["slices"],
                "copy ceiling GB/s": ceiling,
                "bytes ok": all(c["ok"] for c in checked),
            })  # fmt: skip
        notes = [
            f"READ of {self.tput_bytes >> 20} MiB in random block order, median of {repeats} runs",
            "engine: `await engine.read(...)` with the default EngineConfig (slicing, 2 slices in flight)",
            "raw NIXL: one prepped transfer for the whole region, progress thread off, spinning until DONE; "
            "with the engine's UCX settings (engine/raw compares these), and with UCX's defaults",
            "raw 1 ms: the raw loop with the engine's settings, sleeping 1 ms between state checks "
            "(the busy goal's baseline: CPU per GB moved)",
            "Python thread busy: the same reads while another thread of this process runs pure Python "
            "(holding the GIL but for the interpreter's switches), as a model thread might",
            "max_post_bytes 64 MiB: an engine of its own with slices capped as they were until 2026-11-27 "
            "(half a millisecond of a GPU copy; the default is now 1 GiB, so post_target_s bounds them)",
            "CPU %: this process's CPU time over the transfer's wall time (100 % = one core)",
            "copy ceiling: torch copy_ of the same bytes on the same device (bytes moved per second)",
        ]
        return {"ok": ok, "rows": rows, "notes": notes}

    async def _engine_reads(self, name: str, ids: list[int], order: list[int], repeats: int, *,
                            engine: Any = None, peer: Any = None, memory: Memory | None = None
                            ) -> tuple[float, float, float]:  # fmt: skip
        """`repeats` READs of the whole layout by the main engine (or `engine` from `peer` into `memory`):
        median GB/s, this process's CPU % while they ran, and slices per read."""
        engine, peer, memory = engine or self.engine, peer or self.peer, memory or self.mem[name]
        rates, cpu, slices = [], [], []
        for _ in range(repeats):
            memory.fill(None, self.device)
            cpu0, t0 = time.process_time(), time.perf_counter()
            result = await engine.read(peer, ids, order, local=name, remote=name)
            dt = time.perf_counter() - t0
            rates.append(self.tput_bytes / dt / 1e9)
            cpu.append((time.process_time() - cpu0) / dt * 100)
            slices.append(result.slices)
        return float(np.median(rates)), float(np.median(cpu)), float(np.median(slices))

    async def _old_cap_reads(self, name: str, ids: list[int], order: list[int], repeats: int,
                             copy: BlockCopy) -> dict[str, Any]:  # fmt: skip
        """The same READs by an engine with slices capped at 64 MiB, alone and beside a busy Python thread.

        The cap until 2026-11-27: a GPU copies 64 MiB in half a millisecond, so each read was many
        posts and every post paid the engine's own work and, beside a busy thread, a GIL wait.
        """
        from nixl_async import EngineConfig, TransferEngine

        from .common import busy_python_thread

        assert self.proc is not None
        memory = Memory(self.mem[name].spec, self.device)
        config = EngineConfig(engine_id=f"gpu-check-old-cap-{name}", transfer_timeout_s=60.0,
                              max_post_bytes=OLD_POST_BYTES)  # fmt: skip
        async with TransferEngine(config) as engine:
            engine.register(name, memory.regions, block_len=memory.spec.block_bytes)
            peer = await engine.connect(*self.proc.address)
            await engine.read(peer, [0], [0], local=name, remote=name)
            gbps, _, slices = await self._engine_reads(name, ids, order, repeats, engine=engine, peer=peer,
                                                       memory=memory)  # fmt: skip
            with busy_python_thread():
                busy_gbps, _, _ = await self._engine_reads(name, ids, order, repeats, engine=engine, peer=peer,
                                                        memory=memory)  # fmt: skip
            check = verify(memory, [copy], self.device)
        return {"ok": check["ok"], "gbps": gbps, "busy_gbps": busy_gbps, "slices": slices}

    async def _raw_read(self, name: str, block_len: int, order: list[int], copy: BlockCopy,
                        ucx_params: dict[str, str], check_every_s: float = 0.0) -> dict[str, Any]:  # fmt: skip
        """READ `name`'s blocks in `order` with a raw NIXL agent of its own (UCX `ucx_params`), checked.

        Its state is checked without pause, or every `check_every_s` (a blocking sleep: nothing
        else runs in this process meanwhile).
        """
        from nixl_async._agent import OwnedAgent
        from nixl_async.layout import pair_descriptor_ids

        from .common import fetch_reply

        assert self.proc is not None
        reply = fetch_reply(*self.proc.address)
        remote_layout = {lay.name: lay for lay in reply.layouts}[name]
        repeats = 3 if self.args.quick else 5
        n = len(order)
        dst = self.mem[name]
        raw_buf = Memory(dataclasses.replace(dst.spec, name="raw"), self.device)
        raw_layout = raw_buf.flat_layout(n)
        self._raw_agents += 1
        agent = OwnedAgent(f"gpu-check-raw-{self._raw_agents}", ("UCX",), {"UCX": ucx_params})
        memory = agent.register(raw_layout.region_descriptors(), raw_layout.mem_type)
        remote_name = agent.add_remote(reply.agent_metadata)
        local_dl = agent.prep_view("", raw_layout.view())
        remote_dl = agent.prep_view(remote_name, remote_layout.view())
        lidx, ridx = pair_descriptor_ids(raw_layout.view(), np.arange(n), remote_layout.view(), np.asarray(order))
        rates, cpu = [], []
        try:
            for i in range(repeats + 1):
                cpu0, t0 = time.process_time(), time.perf_counter()
                handle = agent.make_xfer("READ", local_dl, lidx, remote_dl, ridx)
                state = agent.post(handle)
                while state == "PROC":
                    if check_every_s:
                        time.sleep(check_every_s)
                    state = agent.state(handle)
                dt = time.perf_counter() - t0
                agent.release_xfer(handle)
                if state != "DONE":
                    raise RuntimeError(f"raw NIXL READ ended in state {state}")
                if i:  # the first one warms up
                    rates.append(self.tput_bytes / dt / 1e9)
                    cpu.append((time.process_time() - cpu0) / dt * 100)
            check = verify(raw_buf, [copy], self.device)
        finally:
            agent.release_dlist(local_dl)
            agent.release_dlist(remote_dl)
            agent.remove_remote(remote_name)
            agent.deregister(memory)
            del raw_buf
        return {"ok": check["ok"], "gbps": float(np.median(rates)), "cpu": float(np.median(cpu))}

    async def model_steps(self) -> dict[str, Any]:
        """A model thread's step times beside 256 MiB READs (1 MiB blocks) posted by the engine's loop,
        from the model thread itself as vLLM's connector posts them, or by another process; eager and
        graph-replayed steps (`gpu_model_step`)."""
        from nixl_async.config import SendBufferLimits

        from .common import RawReader
        from .gpu_model_step import ReaderProcess, StepLoad, step_times_beside_reads

        assert self.proc is not None
        block_len = TPUT_BLOCK_LENS[-1]
        name = f"tput_{block_len >> 10}k"
        src = self.peer_spec(name)
        n = min(MODEL_STEP_READ_BYTES, self.tput_bytes) // block_len
        order = [int(b) for b in self.rng.permutation(src.num_blocks)[:n]]
        ids = list(range(n))
        self.mem[name].fill(None, self.device)  # blocks past n must stay zero for the check

        async def engine_read() -> int:
            await self.engine.read(self.peer, ids, order, local=name, remote=name)
            return n * block_len

        raw_buf = Memory(dataclasses.replace(self.mem[name].spec, name="raw", num_blocks=n), self.device)
        layout = raw_buf.flat_layout()
        engine_ucx = self.engine.config.backend_settings("UCX", os.environ, SendBufferLimits.of_host())
        address, lidx, ridx = self.proc.address, np.arange(n), np.asarray(order)

        def open_reader() -> tuple[Any, Any, Any, Any]:  # in the model thread
            raw = RawReader("gpu-check-model-pattern", layout, address, progress_thread=False, ucx_params=engine_ucx,
                            remote_layout=name)  # fmt: skip
            return (lambda: raw.post(lidx, ridx)), raw.state, raw.release, raw.close

        pattern = StepLoad(open_reader, n * block_len)
        other = ReaderProcess({
            "name": "gpu-check-other-process", "device": str(self.device), "blocks": n, "block_len": block_len,
            "address": list(address), "ucx": engine_ucx, "remote_layout": name, "order": order,
            "src_seed": src.seed or 0, "src_region_len": src.region_len, "src_block_len": src.block_bytes,
        })  # fmt: skip
        try:
            runs = await step_times_beside_reads(self.device, engine_read, pattern, other)
        finally:
            other.close()
        copy = BlockCopy(src.seed or 0, src.region_len, src.block_bytes, order, block_len, ids)
        checks = [verify(self.mem[name], [copy], self.device), verify(raw_buf, [copy], self.device)]
        medians = {setup: {k: float(np.median([r[k] for r in rounds])) for k in rounds[0]}
                   for setup, rounds in runs.items()}  # fmt: skip
        rows: list[dict[str, Any]] = []
        for setup, figures in medians.items():
            alone = medians["graph_alone" if setup.startswith("graph_") else "alone"]
            mean, rate = figures["step_ms_mean"], figures["GB/s"]
            # the share of the model's time lost (its steps' mean: slow steps count), per GB/s read
            lost = (mean - alone["step_ms_mean"]) / mean * 1e3 / rate if rate else 0.0
            rows.append({"set-up": setup, **figures, "p50 over alone": figures["step_ms_p50"] / alone["step_ms_p50"],
                         "model ms lost per GB": lost, "rounds": len(runs[setup])})  # fmt: skip
        notes = [
            f"a thread steps a stand-in decode step (300 small kernel launches, one bf16 matmul, a synchronize) "
            f"for 1 s per set-up and round, alternating; READs of {n * block_len >> 20} MiB back to back",
            "engine: `await engine.read` on this process's loop; vllm_pattern: a model of vLLM's connector, "
            "the stepping thread posts a READ when none is in flight and checks its state once per step "
            "(NIXL's public API, the engine's UCX settings); other_process: a raw NIXL loop reading back to back "
            "in another process on the same device (its own GIL and CUDA context); gil_handoffs: a thread of this "
            "process that only gives the GIL up and takes it back (a 0.2 ms sleep in a loop), no READs",
            "graph_*: the same with the step captured once as a CUDA graph and replayed (vLLM's default for "
            "decode); their 'over alone' is over graph_alone",
            "figures: medians over rounds of each round's step-time p50 / p99 / mean and GB/s read; model ms lost "
            "per GB: (mean step - alone's) / mean step x 1000 / GB/s",
        ]
        ok = all(c["ok"] for c in checks) and not pattern.failed and bool(other.verified)
        return {"ok": ok, "rows": rows, "notes": notes, "failed_states": pattern.failed,
                "other_process_verified": other.verified, "other_process_error": other.error}  # fmt: skip

    def _copy_ceiling(self, nbytes: int) -> float:
        """Bytes per second of a plain torch copy on the device (what one copy engine pass can do)."""
        a = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        b = torch.empty_like(a)
        b.copy_(a)
        synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(5):
            b.copy_(a)
        synchronize(self.device)
        return 5 * nbytes / (time.perf_counter() - t0) / 1e9

    # the adapter -------------------------------------------------------------------------------
    async def adapter_receive(self) -> dict[str, Any]:
        """`worker.receive` on two reader ranks (TP 2, blocks twice as large) from a TP 1 producer, all VRAM."""
        from nixl_async import EngineConfig, TransferEngine
        from nixl_async_vllm.block_pairs import GroupBlocks
        from nixl_async_vllm.kv_layout import describe_cache
        from nixl_async_vllm.settings import rank_engine_id
        from nixl_async_vllm.tp_mapping import expected_consumers
        from nixl_async_vllm.worker import KVGeometry, RecvJob, receive

        prod = producer_layouts()[0]
        spec = {"engine_id": rank_engine_id("prefill", 0), "device": str(self.device),
                "layouts": [dataclasses.asdict(prod)], "extra": {"block_size": PEER_BS}}  # fmt: skip
        proc = PeerProc(spec, self.args.time_limit)
        remote_blocks = self.ids(8)
        local_blocks = self.ids(4, BLOCKS // 2)
        dec = fa("kv", "vram", None, heads=HEADS // 2, block_size=DECODE_BS, num_blocks=BLOCKS // 2)
        try:
            host, port = await proc.ready()

            async def rank(r: int) -> tuple[Memory, int]:
                mem = Memory(dec, self.device)
                regions = mem.regions  # the geometry as the worker derives it from vLLM's view
                cache = describe_cache("FLASH_ATTN", "LBHNC", tuple(regions[0].shape), tuple(regions[0].stride()),
                                       ELT, num_kv_heads=dec.heads, mla=False)  # fmt: skip
                block_len = cache.block_len
                geometry = KVGeometry(tp_size=2, tp_rank=r, block_size=DECODE_BS, part_len=block_len,
                                      run_len=cache.run_len, mla=False, kv_heads=HEADS,
                                      head_window=cache.head_window)  # fmt: skip
                job = RecvJob(request_id="req-d", remote_request_id="req-p", remote_engine_id="prefill", host=host,
                              port=port, remote_tp=1, expires_at=time.time() + 60,
                              groups=(GroupBlocks("full", local_blocks, remote_blocks, None),))  # fmt: skip
                async with TransferEngine(EngineConfig(engine_id=f"decode/tp{r}", transfer_timeout_s=60.0)) as eng:
                    eng.register("kv", regions, block_len=block_len)
                    results = await receive(eng, geometry, job)
                synchronize(self.device)
                return mem, len(results)

            outcomes = await asyncio.gather(rank(0), rank(1))
            readers = expected_consumers(remote_tp=1, local_tp=2)
            note = await proc.request("wait_notifications", message=f"req-p:{readers}", count=readers, wait_s=10)
        finally:
            await proc.stop()
        checks = []
        for r, (mem, _) in enumerate(outcomes):
            exp = expected_fa_read(prod, prod.seed or 0, dec, rank=r, remote_blocks=remote_blocks,
                                   local_blocks=local_blocks, device=self.device)  # fmt: skip
            checks.append(compare(mem.regions, exp, self.device))
        notified = sorted(note["senders"]) == ["decode/tp0", "decode/tp1"]
        ok = all(c["ok"] for c in checks) and notified
        return {
            "ok": ok,
            "transfers": [n for _, n in outcomes],
            "notified": notified,
            "bad_bytes": [c["bad_bytes"] for c in checks],
            "first_bad": [c["first_bad"] for c in checks],
        }

    async def connector_worker(self, buffer_device: str, pages: int = 1) -> dict[str, Any]:
        # vLLM's worker thread stands apart from any loop: so does this one
        return await asyncio.to_thread(connector_worker_check, self.device, self.rng, buffer_device, pages)


# -- host staging through ConnectorWorker ----------------------------------------------------------
class _VllmStandIns:
    """What `ConnectorWorker` imports from vLLM, replaced so it runs without vLLM (the device has none).

    TP rank, side-channel port, compatibility hash, stats, the KV cache spec classes and the
    attention backend (FlashAttention, the CUDA default, with vLLM 0.32's LBHNC layout).
    """

    def __init__(self) -> None:
        self.rank = 0
        self.port = 0
        self.saved: dict[str, types.ModuleType] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[_VllmStandIns]:
        stand_ins = self

        class Envs(types.ModuleType):
            VLLM_NIXL_SIDE_CHANNEL_HOST = "127.0.0.1"

            @property
            def VLLM_NIXL_SIDE_CHANNEL_PORT(self) -> int:  # vLLM's name
                return stand_ins.port

        class Stats:
            def __init__(self) -> None:
                self.data: collections.defaultdict[str, list[float]] = collections.defaultdict(list)

            def is_empty(self) -> bool:
                return not any(self.data.values())

            def clone_and_reset(self) -> Stats:
                clone = Stats()
                clone.data, self.data = self.data, collections.defaultdict(list)
                return clone

        def module(name: str, **attrs: Any) -> types.ModuleType:
            mod = types.ModuleType(name)
            mod.__dict__.update(attrs)
            mod.__path__ = []  # a package, so submodules resolve
            return mod

        class FlashAttentionBackend:
            @staticmethod
            def get_name() -> str:
                return "FLASH_ATTN"

        names = ["vllm", "vllm.distributed", "vllm.distributed.parallel_state", "vllm.distributed.kv_transfer",
                 "vllm.distributed.kv_transfer.kv_connector", "vllm.distributed.kv_transfer.kv_connector.utils",
                 "vllm.distributed.kv_transfer.kv_connector.v1",
                 "vllm.distributed.kv_transfer.kv_connector.v1.nixl",
                 "vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata",
                 "vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils",
                 "vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats", "vllm.v1",
                 "vllm.v1.kv_cache_interface"]  # fmt: skip
        mods = {name: module(name) for name in names}
        specs = mods["vllm.v1.kv_cache_interface"]
        for spec in ("FullAttentionSpec", "MambaSpec", "MLAAttentionSpec", "SlidingWindowSpec"):
            setattr(specs, spec, type(spec, (), {}))
        mods["vllm.distributed.kv_transfer.kv_connector.utils"].get_current_attn_backends = (  # type: ignore[attr-defined]
            lambda vllm_config, layer_names=None: [FlashAttentionBackend]
        )
        mods["vllm.envs"] = Envs("vllm.envs")
        mods["vllm"].envs = mods["vllm.envs"]  # type: ignore[attr-defined]
        mods["vllm.distributed.parallel_state"].get_tensor_model_parallel_rank = lambda: stand_ins.rank  # type: ignore[attr-defined]
        mods["vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata"].compute_nixl_compatibility_hash = (  # type: ignore[attr-defined]
            lambda *args, **kwargs: "gpu-check"
        )
        mods["vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats"].NixlKVConnectorStats = Stats  # type: ignore[attr-defined]
        # vLLM suffixes request ids with "-" and 8 hex digits; its helper strips that suffix.
        mods["vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils"].get_base_request_id = (  # type: ignore[attr-defined]
            lambda request_id: re.sub(r"-[0-9a-fA-F]{8}$", "", request_id)
        )
        self.saved = {name: sys.modules[name] for name in mods if name in sys.modules}
        sys.modules.update(mods)
        try:
            yield self
        finally:
            for name in mods:
                sys.modules.pop(name, None)
            sys.modules.update(self.saved)


def _vllm_config(tp: int, block_size: int, buffer_device: str) -> Any:
    ns = types.SimpleNamespace
    return ns(
        parallel_config=ns(tensor_parallel_size=tp, decode_context_parallel_size=1, data_parallel_index=0),
        kv_transfer_config=ns(kv_connector_extra_config={"kv_lease_duration": 30}, kv_buffer_device=buffer_device),
        model_config=ns(
            use_mla=False,
            dtype=torch.bfloat16,
            get_total_num_kv_heads=lambda: HEADS,
            get_num_kv_heads=lambda parallel: HEADS // parallel.tensor_parallel_size,
        ),
        cache_config=ns(
            block_size=block_size, cache_dtype="auto", get_resolved_kv_cache_layout=lambda: ns(name="LBHNC")
        ),
    )


def _kv_cache_config(num_blocks: int, block_size: int) -> Any:
    """One full-attention KV cache group holding every layer, as vLLM builds it for a plain model."""
    from vllm.v1 import kv_cache_interface  # the stand-in's spec classes take no arguments

    ns = types.SimpleNamespace
    spec = kv_cache_interface.FullAttentionSpec.__new__(kv_cache_interface.FullAttentionSpec)
    object.__setattr__(spec, "block_size", block_size)  # (tokens per block: the worker reads the groups)
    group = ns(kv_cache_spec=spec, layer_names=[f"layer{i}" for i in range(LAYERS)])
    return ns(num_blocks=num_blocks, transfer_groups=[group], transfer_group_ids=[0])


def copy_blocks(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], src_ids: Sequence[int],
                dst_ids: Sequence[int], direction: str) -> None:  # fmt: skip
    """vLLM 0.32's host-buffer copy op (`copy_kv_blocks` over the CUDA platform's block copies): blocks on dim 0."""
    for name, s in src.items():
        d = dst[name]
        si = torch.as_tensor(list(src_ids), device=s.device)
        di = torch.as_tensor(list(dst_ids), device=d.device)
        d[di] = s[si].to(d.device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def connector_worker_check(
    device: torch.device, rng: np.random.Generator, buffer_device: str, pages: int = 1, timeout: float = 60.0
) -> dict[str, Any]:
    """Producer TP 1 and reader TP 2 `ConnectorWorker`s with CUDA caches, ``kv_buffer_device`` as given.

    ``cuda``: the caches are registered as VRAM by each worker's engine thread (a thread vLLM's
    CUDA context was never made current in) and read directly. ``cpu`` (host staging): the
    producer's computed blocks go device -> host (`wait_for_save`), the readers read the host
    copies over NIXL and copy them host -> device when `get_transfer_results` reports the
    request. Either way the readers' CUDA caches are checked against the head/token oracle. On a
    CPU run the caches are host memory and no staging happens (the plumbing is still exercised).
    ``pages``: the attention kernel's block is that many times smaller than the scheduler's, so
    vLLM's views have ``pages`` rows per logical block (staging must copy every page of a block).
    """
    from nixl_async.testing import free_port_base
    from nixl_async_vllm.worker import ConnectorWorker

    ns = types.SimpleNamespace
    staging = device.type == "cuda" and buffer_device == "cpu"
    if device.type == "cpu":  # (the dry run's caches: vLLM's default there, as the worker takes no other)
        buffer_device = "cpu"
    prod = fa("kv", "vram", 31, pages=pages)
    dec = fa("kv", "vram", None, heads=HEADS // 2, block_size=DECODE_BS, num_blocks=BLOCKS // 2, pages=pages)
    remote_blocks = [int(b) for b in rng.choice(BLOCKS, 8, replace=False)]
    local_blocks = [int(b) for b in rng.choice(BLOCKS // 2, 4, replace=False)]
    workers: list[Any] = []
    stand_ins = _VllmStandIns()
    with stand_ins.installed():
        try:
            stand_ins.port, stand_ins.rank = free_port_base(2), 0
            prefill_port = stand_ins.port
            producer = ConnectorWorker(
                _vllm_config(1, PEER_BS, buffer_device), "prefill", _kv_cache_config(BLOCKS, PEER_BS)
            )
            workers.append(producer)
            pmem = Memory(prod, device)
            pmem.fill(prod.seed, device)  # "the forward pass computed these blocks"
            producer.register_kv_caches({f"layer{i}": c for i, c in enumerate(pmem.caches)})
            producer.set_host_xfer_buffer_ops(copy_blocks)
            staged = bool(producer._host_caches)
            producer.wait_for_save(ns(reqs_to_save={"req-p": ns(local_block_ids=[remote_blocks])}))
            clock = time.perf_counter()
            producer.start_load_kv(ns(reqs_to_send={"req-p": clock + 30}, scheduler_clock=clock,
                                      reqs_in_batch=set(), reqs_not_processed=set(), reqs_to_recv={}))  # fmt: skip
            stand_ins.port = free_port_base(3)
            readers: list[tuple[Any, Memory]] = []
            for rank in (0, 1):
                stand_ins.rank = rank
                worker = ConnectorWorker(
                    _vllm_config(2, DECODE_BS, buffer_device), "decode", _kv_cache_config(BLOCKS // 2, DECODE_BS)
                )
                workers.append(worker)
                mem = Memory(dec, device)
                worker.register_kv_caches({f"layer{i}": c for i, c in enumerate(mem.caches)})
                worker.set_host_xfer_buffer_ops(copy_blocks)
                readers.append((worker, mem))
            # vLLM 0.32's RemoteMeta: the prompt's length comes with the producer's block ids
            remote = ns(request_id="req-p", engine_id="prefill", host="127.0.0.1", port=prefill_port,
                        block_ids=[remote_blocks], blocks_expiry_time=time.time() + 30,
                        num_tokens=len(remote_blocks) * PEER_BS)  # fmt: skip
            request = ns(remote=remote, local_block_ids=[local_blocks], tp_size=1, local_num_computed_blocks=None,
                         awaiting_kvs=True)  # fmt: skip
            for worker, _ in readers:
                clock = time.perf_counter()
                worker.start_load_kv(ns(reqs_to_send={}, scheduler_clock=clock, reqs_in_batch=set(),
                                        reqs_not_processed=set(), reqs_to_recv={"req-d": request}))  # fmt: skip
            received: dict[int, str] = {}
            sent = False
            deadline = time.monotonic() + timeout
            while (len(received) < 2 or not sent) and time.monotonic() < deadline:
                for rank, (worker, _) in enumerate(readers):
                    _, recving, failed = worker.get_transfer_results()
                    if "req-d" in recving:
                        received[rank] = "failed" if "req-d" in failed else "ok"
                finished_sending, _, _ = producer.get_transfer_results()
                sent = sent or "req-p" in finished_sending
                time.sleep(0.005)
            checks = []
            for rank, (_, mem) in enumerate(readers):
                exp = expected_fa_read(prod, prod.seed or 0, dec, rank=rank, remote_blocks=remote_blocks,
                                       local_blocks=local_blocks, device=device)  # fmt: skip
                checks.append(compare(mem.regions, exp, device))
        finally:
            for worker in workers:
                with contextlib.suppress(Exception):
                    worker.shutdown()
    ok = all(c["ok"] for c in checks) and received == {0: "ok", 1: "ok"} and sent and staged == staging
    return {"ok": ok, "host_staging": staged, "received": received, "producer_freed": sent,
            "bad_bytes": [c["bad_bytes"] for c in checks], "first_bad": [c["first_bad"] for c in checks]}  # fmt: skip


# -- entry points ----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m nixl_async_benchmarks.gpu_check",
        description="nixl_async on a GPU: VRAM and host-staging paths, every byte checked (docs/gpu.md).",
    )
    parser.add_argument("--out", type=Path, default=Path("out"), help="where gpu-check.json and .md go")
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="check imports, pattern and oracles, write the summary, stop before the GPU checks",
    )
    parser.add_argument("--device", default="cuda:0",
                        help="cuda:N (default cuda:0); 'cpu' runs every check with host memory, to develop this "
                             "script without a GPU")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="fewer throughput repeats, 256 MiB unless --tput-mib")
    parser.add_argument("--tput-mib", type=int, default=None, help="bytes per throughput READ, in MiB (1024)")
    parser.add_argument("--time-limit", type=float, default=480.0,
                        help="dump tracebacks and exit after this many seconds")  # fmt: skip
    parser.add_argument("--only", default="", help="comma-separated check names: run just these")
    parser.add_argument("--role", choices=("main", "peer"), default="main", help=argparse.SUPPRESS)
    parser.add_argument("--peer-spec", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tput_mib is None:
        args.tput_mib = 256 if args.quick else 1024
    if args.tput_mib <= 0 or (args.tput_mib << 20) % TPUT_BLOCK_LENS[-1]:
        parser.error("--tput-mib must be a positive number of MiB")
    if args.role == "peer" and not args.peer_spec:
        parser.error("--role peer needs --peer-spec")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    faulthandler.dump_traceback_later(args.time_limit, exit=True)
    if args.role == "peer":
        asyncio.run(_peer_main(json.loads(args.peer_spec)))
        return 0
    device = torch.device(args.device)
    cuda = torch.cuda.is_available()
    gpu_run = not args.cpu_dry_run and (device.type == "cpu" or cuda)
    if device.type == "cuda" and cuda:
        torch.cuda.set_device(device)
        torch.cuda.init()  # before NIXL: UCX's CUDA transports need the runtime loaded
    compute = device if gpu_run else torch.device("cpu")
    imports = check_imports()
    mode = "dry run" if not gpu_run else ("GPU" if device.type == "cuda" else "CPU stand-in (no VRAM)")
    meta = {
        "started_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "mode": mode,
        "command": os.environ.get("GPU_CHECK_INVOKED_AS")  # set by scripts/gpu-check.sh
        or " ".join(["python -m nixl_async_benchmarks.gpu_check", *(argv or sys.argv[1:])]),
        "versions": imports["versions"],
        **environment(compute),
    }
    only = frozenset(name.strip() for name in args.only.split(",") if name.strip())
    report = Report(args.out, meta, only)
    report.add(CheckResult("imports", imports["ok"], 0.0, imports))
    started = time.perf_counter()
    try:
        tested = self_test(compute)
        result = CheckResult("pattern_and_oracles", tested["ok"], time.perf_counter() - started, tested)
    except Exception as exc:
        traceback.print_exc()
        result = CheckResult("pattern_and_oracles", False, time.perf_counter() - started, {},
                             f"{type(exc).__name__}: {exc}")  # fmt: skip
    report.add(result)
    if not gpu_run:
        message = DRY_RUN if args.cpu_dry_run and cuda else CUDA_MISSING
        print(message, flush=True)
        print(f"summary: {args.out / 'gpu-check.md'}", flush=True)
        if not report.ok:
            return 1
        return 0 if args.cpu_dry_run else 2
    if not report.ok:
        print("imports or self-tests failed: not running the transfer checks", flush=True)
        return 1
    asyncio.run(Checks(args, device, report).run())
    print(report.markdown(), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
