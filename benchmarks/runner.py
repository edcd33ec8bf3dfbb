"""`nixl-async bench`: run scenarios, print tables, append JSON, draw charts."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from pathlib import Path

from .common import Result

# name -> (module, part of --quick by default)
SCENARIOS: dict[str, tuple[str, bool]] = {
    "throughput": ("throughput", True),
    "throughput_tcp": ("throughput_tcp", True),
    "latency": ("latency", True),
    "stall": ("stall", True),
    "handshake": ("handshake", True),
    "descriptors": ("descriptors", True),
    "inflight": ("inflight", True),
    "busy": ("busy", True),
    "discovery": ("discovery", False),  # 16 peers through etcd vs the side channel (needs an etcd binary)
    "vllm": ("vllm", False),  # real vLLM servers: minutes; run it by name
    "vllm_hybrid": ("vllm_hybrid", False),  # the same on hybrid models
    "vllm_hosts": ("vllm_hosts", False),  # P and D on two hosts (network namespaces, root): minutes
    "vllm_push": ("vllm_push", False),  # push, progressive push and pull on the larger model: minutes
    "vllm_handoff": ("vllm_handoff", False),  # prefill done -> decode's first token, per mode (root): minutes
}


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def print_table(result: Result) -> None:
    cells = [result.columns] + [[_fmt(v) for v in row] for row in result.rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(result.columns))]
    print(f"\n== {result.scenario} ==")
    for i, row in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))
    for key, value in result.ratios.items():
        print(f"  {key}: {_fmt(value)}")
    for note in result.notes:
        print(f"  note: {note}")


def plot(result: Result, directory: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numeric = [
        i for i, _ in enumerate(result.columns[1:], 1) if all(isinstance(r[i], int | float) for r in result.rows)
    ]
    if not numeric:
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [str(r[0]) for r in result.rows]
    width = 0.8 / len(numeric)
    for k, i in enumerate(numeric):
        ax.bar([x + k * width for x in range(len(labels))], [r[i] for r in result.rows], width, label=result.columns[i])
    ax.set_xticks([x + width * (len(numeric) - 1) / 2 for x in range(len(labels))], labels, rotation=20, ha="right")
    ax.set_title(result.scenario)
    ax.legend(fontsize="small")
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    fig.savefig(directory / f"{result.scenario}.png", dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    if args.list:
        for name, (_, quick) in SCENARIOS.items():
            print(f"{name}{'' if quick else '  (not in the default set)'}")
        return 0
    names = args.scenarios or [n for n, (_, q) in SCENARIOS.items() if q]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s): {', '.join(unknown)}; try --list", file=sys.stderr)
        return 2
    started = time.perf_counter()
    for name in names:
        module = importlib.import_module(f"{__package__}.{SCENARIOS[name][0]}")
        result: Result = module.run(quick=args.quick)
        print_table(result)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"scenario": name, "metrics": result.metrics, "ratios": result.ratios}) + "\n")
        if args.plots:
            plot(result, Path(args.plots))
    print(f"\n{len(names)} scenario(s) in {time.perf_counter() - started:.0f} s")
    return 0
