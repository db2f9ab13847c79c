"""`mvllm simulate --slo`: each policy's highest load at which a share of the requests meets an SLO, every
point simulated as `mvllm simulate` would the experiment at that load. The search, the files and the lines
printed are capacity.py's (shared with `mvllm bench --slo`, which measures each point instead)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mvllm.bench import workload as wl
from mvllm.bench.experiment import Experiment
from mvllm.bench.metrics import meets as meets_slo
from mvllm.capacity import Goal, Measure, load_of, parse_goal, search_policies
from mvllm.capacity import run_capacity as answer


def simulated(profile: dict, slo: dict) -> Measure:
    """A point measured by the simulator: the share of its requests that completed within the SLO."""
    from mvllm.simulate.sim import run_one

    def measure(policy: str, x: float, point: Experiment) -> dict:
        point = replace(point, goodput=dict(slo))  # the searched SLO: the one an SLO-aware policy routes by
        records: list = []
        summary = run_one(point, policy, profile, wl.vocab_of(point.model, point.workload), keep=records)
        good = sum(r.ok and meets_slo(slo, r) for r in records)
        return {"share": good / max(len(records), 1),
                "goodput": good / summary["duration"] if summary["duration"] else None,
                "p99_ttft_ms": summary.get("p99_ttft_ms"), "p99_tpot_ms": summary.get("p99_tpot_ms"),
                "backend_requests": summary["backend_requests"]}

    return measure


def capacity(exp: Experiment, profile: dict, policies: list[str], slo: dict, share: float = 0.99,
             bounds: tuple[float, float] | None = None, tolerance: float = 0.05, say=None,
             done: list | None = None) -> list[dict]:
    """Per policy: {"policy", "capacity" (load, None if it misses even at the low bound), "unit", "points"}.
    `bounds` default to a quarter of the experiment's load and the load itself. `done` receives each policy's
    result as it starts; `say(line)` hears each point."""
    unit = load_of(exp).unit

    def point(policy: str, row: dict) -> None:
        if say is not None:
            say(f"{policy} at {row['load']:.4g} {unit}: {100 * row['share']:.1f}% meet the SLO")

    return search_policies(exp, policies, simulated(profile, slo), Goal(slo, share, bounds, tolerance), point, done)


def run_capacity(exp: Experiment, profile: dict, policies: list[str], folder: Path, slo_text: str, share: float,
                 loads: str | None, tolerance: float, console) -> None:
    """The CLI's --slo: capacity.json and capacity.png in `folder`, a line per policy."""
    goal = parse_goal(slo_text, share, loads, tolerance)
    answer(exp, policies, folder, goal, simulated(profile, goal.slo), console, "simulated")
