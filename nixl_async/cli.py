"""The `nixl-async` command: `demo` (the main demo) and `bench` (the benchmark suite)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nixl-async", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="two processes on 127.0.0.1: read KV blocks through the engine, verified")
    demo.add_argument("--quick", action="store_true", help="a smaller cache (64 MiB instead of 512 MiB)")
    demo.add_argument("--json", metavar="PATH", help="also write the figures (and verified: true|false) as JSON")

    bench = sub.add_parser("bench", help="benchmark scenarios, side by side with the alternatives")
    bench.add_argument("scenarios", nargs="*", help="scenarios to run (default: all quick ones)")
    bench.add_argument("--quick", action="store_true", help="shorter runs")
    bench.add_argument("--json", metavar="PATH", help="append one JSON object per scenario to PATH")
    bench.add_argument("--plots", metavar="DIR", help="write PNG charts to DIR")
    bench.add_argument("--all", action="store_true", help="every scenario, those not in the default set too")
    bench.add_argument("--judge", metavar="PATH", help="print the goals table of an earlier run's --json file")
    bench.add_argument("--list", action="store_true", help="list the scenarios and exit")

    args = parser.parse_args(argv)
    measuring = args.command == "demo" or not (args.list or args.judge)  # (those write no --json: theirs to refuse)
    if measuring and args.json and not _writable(args.json):  # written after minutes of work: refused now
        parser.error(f"--json {args.json}: cannot write there (no such folder, or no permission)")
    if args.command == "demo":
        from ._demo import main as demo_main

        return demo_main(quick=args.quick, json_path=args.json)
    from nixl_async_benchmarks.runner import main as bench_main

    return bench_main(args)


def _writable(path: str) -> bool:
    """Whether a file can be written at `path` (its folder exists and takes it), leaving nothing behind."""
    target = Path(path)
    if target.is_dir():
        return False
    if target.exists():
        return os.access(target, os.W_OK)
    folder = target.parent
    return folder.is_dir() and os.access(folder, os.W_OK)


if __name__ == "__main__":
    sys.exit(main())
