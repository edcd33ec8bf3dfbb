"""`nixl-async bench`: run scenarios, print tables, append JSON, draw charts, judge the goals."""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

from . import goals
from .common import Result, format_figure

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
    "beside_python": ("beside_python", True),
    "small_reads": ("small_reads", True),
    "block_order": ("block_order", True),
    "discovery": ("discovery", False),  # 16 peers through etcd vs the side channel (needs an etcd binary)
    "vllm": ("vllm", False),  # real vLLM servers: minutes; run it by name
    "vllm_hybrid": ("vllm_hybrid", False),  # the same on hybrid models
    "vllm_hosts": ("vllm_hosts", False),  # P and D on two hosts (network namespaces, root): minutes
    "vllm_push": ("vllm_push", False),  # push, progressive push and pull on the larger model: minutes
    "vllm_handoff": ("vllm_handoff", False),  # prefill done -> decode's first token, per mode (root): minutes
}


def print_table(result: Result) -> None:
    cells = [result.columns] + [[format_figure(v) for v in row] for row in result.rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(result.columns))]
    print(f"\n== {result.scenario} ==")
    for i, row in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))
    for key, value in result.ratios.items():
        print(f"  {key}: {format_figure(value)}")
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


def plot_goals(rows: list[goals.Row], directory: Path) -> None:
    """Every figure with a goal as figure ÷ bound, turned so that a bar left of 1 is a goal met."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if not math.isnan(r.normalized)]
    if not shown:
        return
    low, high = 0.05, 20.0  # bars are clipped to this range; each is labelled with its figure
    fig, ax = plt.subplots(figsize=(11, 0.22 * len(shown) + 1.2))
    ys = list(range(len(shown)))
    colours = ["tab:green" if r.met == "yes" else "tab:red" for r in shown]
    widths = [min(max(r.normalized, low), high) for r in shown]
    ax.barh(ys, widths, color=colours)
    for y, width, row in zip(ys, widths, shown, strict=True):
        ax.text(width * 1.05, y, f"{row.value:.3g}", va="center", fontsize=6)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlim(low / 1.5, high * 3)
    names = [f"{r.scenario}: {r.key.removesuffix('_lower_is_better').removesuffix('_higher_is_better')}" for r in shown]
    ax.set_yticks(list(ys), names, fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("figure ÷ goal (≥ goals inverted): left of 1 = met")
    fig.tight_layout()
    directory.mkdir(parents=True, exist_ok=True)
    fig.savefig(directory / "goals.png", dpi=110)
    plt.close(fig)


def _unplottable(directory: Path) -> str | None:
    """Why charts cannot be written to `directory` (None: they can); it is made if missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "charts need matplotlib (pip install matplotlib, or the [test] extra)"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make that folder ({exc.strerror})"
    if not os.access(directory, os.W_OK):
        return "cannot write there"
    return None


def main(args: argparse.Namespace) -> int:
    if args.list:
        if args.scenarios or args.all or args.judge or args.json or args.plots or args.quick:
            print("--list lists every scenario: give it nothing else", file=sys.stderr)
            return 2
        for name, (_, quick) in SCENARIOS.items():
            print(f"{name}{'' if quick else '  (not in the default set)'}")
        return 0
    if args.judge:  # an earlier run's JSON: its goals table (and chart) again, nothing measured
        if args.scenarios or args.all or args.json or args.quick:
            print("--judge measures nothing: name no scenario, --all, --quick or --json with it", file=sys.stderr)
            return 2
        if args.plots and (why := _unplottable(Path(args.plots))):
            print(f"--plots {args.plots}: {why}", file=sys.stderr)
            return 2
        try:
            rows = goals.judge(goals.load(args.judge))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # (not a file of `--json` lines)
            print(f"--judge {args.judge}: cannot read a run's JSON lines from it ({exc!r})", file=sys.stderr)
            return 2
        print(f"== goals ({goals.tally(rows)}) ==\n{goals.markdown(rows)}")
        if args.plots:
            plot_goals(rows, Path(args.plots))
        return 0
    if args.all and args.scenarios:
        print("--all runs every scenario: name none with it", file=sys.stderr)
        return 2
    names = list(SCENARIOS) if args.all else args.scenarios or [n for n, (_, q) in SCENARIOS.items() if q]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"unknown scenario(s): {', '.join(unknown)}; try --list", file=sys.stderr)
        return 2
    if args.plots and (why := _unplottable(Path(args.plots))):  # (charts come after minutes of work: refused now)
        print(f"--plots {args.plots}: {why}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    run = f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}/{os.getpid()}"  # names this run's `--json` records (`goals.load`
    # keeps the last run; two runs in one second differ by their process)
    results: list[Result] = []
    failed: list[str] = []
    for name in names:
        try:
            module = importlib.import_module(f"{__package__}.{SCENARIOS[name][0]}")
            result: Result = module.run(quick=args.quick)
        except (Exception, SystemExit) as exc:  # one scenario failing (or refusing: no vLLM, not root) loses no
            traceback.print_exc()  # other's figures
            failed.append(name)
            result = Result(name, ["failed"], [], notes=[f"failed: {exc!r}"])
        print_table(result)
        results.append(result)
        if args.json:
            with open(args.json, "a") as f:
                record = {"run": run, "scenario": name, "metrics": result.metrics, "ratios": result.ratios}
                f.write(json.dumps(record) + "\n")
        if args.plots:
            try:
                plot(result, Path(args.plots))
            except Exception as exc:  # a chart that fails loses neither the figures nor the next scenarios
                print(f"chart of {name} failed: {exc!r}", file=sys.stderr)
    rows = goals.judge(results)
    print(f"\n== goals ({goals.tally(rows)}) ==\n{goals.markdown(rows)}")
    if args.plots:
        try:
            plot_goals(rows, Path(args.plots))
        except Exception as exc:
            print(f"chart of the goals failed: {exc!r}", file=sys.stderr)
    print(f"\n{len(names)} scenario(s) in {time.perf_counter() - started:.0f} s")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
