"""The project's speed goals, and a verdict on one `nixl-async bench` run against them (pure logic).

Each goal names the scenario it belongs to, the ratio or metric it bounds (a `fnmatch` pattern where one
goal covers several sizes), the bound and where it was set. `judge` turns a run's results into one row
per figure: every ratio of the run, plus the metrics a goal bounds. A goal of a scenario that ran but
did not produce its figure (a `--quick` variant that skips it, a failed measurement) is reported as not
measured, never as met; so is a figure from a run smaller than its goal asks (`Goal.needs`: the issue's
runs and requests per point for real vLLM), shown with its value. A headline key the issue named, a
copy of another figure of its scenario, is shown and judged but counted once. The runner prints the rows
as one Markdown table, the README's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

from .common import Result, format_figure


@dataclass(frozen=True)
class Goal:
    scenario: str
    pattern: str  # a key of the scenario's ratios or metrics; fnmatch syntax
    bound: float
    at_most: bool  # True: the figure must be <= bound; False: >= bound
    source: str  # the issue that set it
    needs: tuple[tuple[str, float], ...] = ()  # (metric, least value) the run must have had to be judged

    @property
    def text(self) -> str:
        needs = "".join(f", {metric} ≥ {least:g}" for metric, least in self.needs)
        return f"{'≤' if self.at_most else '≥'} {self.bound:g} ({self.source}{needs})"


_VLLM_RUNS = (("runs_per_setup", 3), ("requests_per_point", 100))
_HOSTS_RUNS = (("runs_per_setup", 4), ("requests_per_point", 100))
_PUSH_RUNS = (("runs_per_setup", 2), ("requests_per_point", 3))  # the full run's, across two hosts

GOALS: tuple[Goal, ...] = (
    Goal("throughput", "engine_over_raw_throughput_*_higher_is_better", 0.95, False, "#4, #13"),
    Goal("throughput_tcp", "engine_over_raw_throughput_*_higher_is_better", 0.95, False, "#13"),
    Goal("latency", "engine_completion_p50_us", 100, True, "#2"),
    Goal("latency", "engine_completion_p99_us", 1000, True, "#2"),
    Goal("latency", "engine_idle_cpu_percent", 2, True, "#2"),
    Goal("stall", "engine_stall_ms", 5, True, "#2"),
    Goal("handshake", "engine_over_executor_time_lower_is_better", 0.1, True, "#4"),
    Goal("descriptors", "*_over_engine_*_time_higher_is_better", 20, False, "#4"),
    Goal("inflight", "engine*_overhead_us_per_completion", 10, True, "#4, #13"),
    # Per size, and the headline key (the largest size again).
    Goal("busy", "engine_over_raw_cpu_seconds_per_gb_*lower_is_better", 1.2, True, "#13"),
    Goal("busy", "completion_p50_us", 100, True, "#13"),
    # A decode server's small loads: the loop thread's CPU per read, as for large ones in `busy`.
    Goal("small_reads", "engine_over_raw_cpu_per_read_lower_is_better", 1.2, True, "#13"),
    # Every transport and concurrency measured (the headline keys repeat the TCP c=4 ones), judged only
    # from runs as large as the issue asks: 3 alternating runs per set-up, 100 requests per point.
    Goal("vllm", "tiny_*_adapter_over_stock_ttft_p50_c*_lower_is_better", 0.8, True, "#4, #13", _VLLM_RUNS),
    # ITL: decode steps taken while other requests' KV is pulled, as the issue asks (not every gap).
    Goal("vllm", "tiny_*_adapter_over_stock_itl_during_load_p50_c4_lower_is_better", 1.0, True, "#13", _VLLM_RUNS),
    Goal("vllm", "tiny_*_adapter_over_stock_req_per_s_c4_higher_is_better", 1.0, False, "#13", _VLLM_RUNS),
    # Two hosts: judged only from the full run's size (4 alternating runs per set-up, 100 requests per point);
    # `--quick`'s 2 runs of 32 sit inside the run-to-run spread.
    Goal("vllm_hosts", "adapter_over_stock_latency_p50_c1_lower_is_better", 1.0, True, "#13", _HOSTS_RUNS),
    Goal("vllm_hosts", "adapter_over_stock_req_per_s_c4_higher_is_better", 1.0, False, "#13", _HOSTS_RUNS),
    # Per link (loopback TCP; two hosts, not in --quick), and the headline key (two hosts again); judged only
    # from the full run's completed runs across two hosts (`--quick`: one loopback run of 2 prompts).
    Goal("vllm_push", "*progressive_over_pull_ttft_p50_lower_is_better", 0.8, True, "#16", _PUSH_RUNS),
)

# The headline keys that repeat another figure of their scenario (busy: the largest size; vllm_push:
# the two-host run): judged beside it, not counted a second time.
HEADLINES: frozenset[tuple[str, str]] = frozenset(
    {
        ("busy", "engine_over_raw_cpu_seconds_per_gb_lower_is_better"),
        ("vllm_push", "progressive_over_pull_ttft_p50_lower_is_better"),
    }
)

Met = Literal["yes", "no", "not measured", "—"]


@dataclass(frozen=True)
class Row:
    scenario: str
    key: str
    value: float  # nan when not measured
    goal: Goal | None
    met: Met
    headline: bool = False  # one of `HEADLINES`: a repeat, not counted by `tally`

    @property
    def normalized(self) -> float:
        """The figure over its bound, turned so that <= 1 means met (for the chart); nan without a goal.

        A figure at or below zero (an overhead over raw that came out negative) meets an upper
        bound by any margin (0) and misses a lower bound by any margin (inf).
        """
        if self.goal is None or math.isnan(self.value):
            return math.nan
        if self.value <= 0:
            return 0.0 if self.goal.at_most else math.inf
        return self.value / self.goal.bound if self.goal.at_most else self.goal.bound / self.value


def _verdict(goal: Goal, value: float, figures: dict[str, float]) -> Met:
    if math.isnan(value) or any(figures.get(metric, -math.inf) < least for metric, least in goal.needs):
        return "not measured"
    return "yes" if (value <= goal.bound if goal.at_most else value >= goal.bound) else "no"


def judge(results: list[Result], goals: tuple[Goal, ...] = GOALS) -> list[Row]:
    """Rows with a goal first (in the goals' order), then every other ratio of the run."""
    by_scenario = {r.scenario: r for r in results}
    with_goal: list[Row] = []
    seen: set[tuple[str, str]] = set()
    for goal in goals:
        result = by_scenario.get(goal.scenario)
        if result is None:
            continue  # the scenario was not run
        figures = {**result.metrics, **result.ratios}
        keys = [k for k in figures if fnmatchcase(k, goal.pattern)]  # in the scenario's order (by size)
        if not keys:
            with_goal.append(Row(goal.scenario, goal.pattern, math.nan, goal, "not measured"))
        for key in keys:
            if (goal.scenario, key) in seen:
                raise ValueError(f"{goal.scenario}: {key} matches two goals")
            seen.add((goal.scenario, key))
            value = float(figures[key])
            headline = (goal.scenario, key) in HEADLINES
            with_goal.append(Row(goal.scenario, key, value, goal, _verdict(goal, value, figures), headline))
    others = [
        Row(r.scenario, key, float(value), None, "—")
        for r in results
        for key, value in r.ratios.items()
        if (r.scenario, key) not in seen
    ]
    return with_goal + others


def markdown(rows: list[Row]) -> str:
    """One table: scenario, figure, value, goal, met."""
    lines = ["| scenario | figure | value | goal | met |", "|---|---|---|---|---|"]
    for row in rows:
        goal = row.goal.text if row.goal else "—"
        value = format_figure(row.value, missing="—")
        figure = f"`{row.key}` (headline, a repeat)" if row.headline else f"`{row.key}`"
        lines.append(f"| `{row.scenario}` | {figure} | {value} | {goal} | {row.met} |")
    return "\n".join(lines)


def load(path: str) -> list[Result]:
    """The results of the last run in the file `--json` appended them to (one object per line).

    `--json` appends, so a file may hold several runs: each record names its run (`run`, when it began),
    and only the last run's records are judged, never a mix of runs. Records that name none (written
    before runs were named) count as one run, and a scenario found twice in one run is refused.
    """
    runs: dict[str | None, list[Result]] = {}
    last: str | None = None
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                last = record.get("run")
                result = Result(record["scenario"], [], [], metrics=record["metrics"], ratios=record["ratios"])
                runs.setdefault(last, []).append(result)
    results = runs.get(last, [])
    scenarios = [r.scenario for r in results]
    if twice := sorted({s for s in scenarios if scenarios.count(s) > 1}):
        raise ValueError(f"{path}: scenario(s) {', '.join(twice)} found twice in one run; give one run's file")
    return results


def tally(rows: list[Row]) -> str:
    counted = [r for r in rows if r.goal is not None and not r.headline]
    met = sum(r.met == "yes" for r in counted)
    missing = sum(r.met == "not measured" for r in counted)
    return f"{met} of {len(counted)} figures with a goal met, {missing} not measured in this run"
