"""`mvllm simulate --grid`: where the CPU pays. The experiment is simulated over a grid of the CPU's speed
relative to the profile's, and of load (the interval between arrivals), for gpu-only, mixed, eta, makespan and every
static split:K. Each cell gives the change of batch completion, p95 TTFT and p95 E2E against gpu-only.
Writes grid.json and grid.png (batch completion and p95 TTFT).

A CPU "k times as fast" has every decode step time divided by k and its prefill rate multiplied by k. The
reference's M2 sits at k = (its CPU/GPU decode-rate ratio) / (the profile's), marked on the chart.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from mvllm.bench.experiment import Experiment
from mvllm.simulate.sim import simulate

SPEEDS = (0.5, 1.0, 2.0, 4.0, 8.0)
INTERVALS = (0.2, 0.1, 0.05, 0.025)
SPLITS = range(1, 13)
M2_RATIO = 45 / 293  # the reference experiment's published M2 rates: CPU / GPU decode tok/s
POLICIES = ("mixed", "eta", "makespan")
GAIN = 0.005  # a split must beat gpu-only's batch completion by this much to count as the best one


def faster_cpu(profile: dict, k: float, name: str = "cpu") -> dict:
    out = copy.deepcopy(profile)
    b = out["backends"][name]
    for key in ("prefill_rate", "decode_rate", "warm_prefill_rate"):
        if b.get(key):
            b[key] *= k
    for d in b.get("decode", []) + b.get("contexts", []):
        d["step_ms"] /= k
        d["tok_s"] *= k
    for p in b.get("prefill", []):
        p["ms"] /= k
        p["tok_s"] *= k
    return out


def m2_speed(profile: dict) -> float:
    b = profile["backends"]
    return M2_RATIO / (b["cpu"]["decode_rate"] / b["gpu"]["decode_rate"])


def cell(exp: Experiment, profile: dict) -> dict:
    rows = {r["policy"]: r for r in simulate(exp, profile, ["gpu-only", *POLICIES,
                                                            *(f"split:{k}" for k in SPLITS)], None)}
    base = rows["gpu-only"]

    def change(r: dict) -> dict:
        return {"makespan": r["makespan"] / base["makespan"] - 1,
                "p95_ttft": r["p95_ttft_ms"] / base["p95_ttft_ms"] - 1 if base["p95_ttft_ms"] else 0.0,
                "p95_e2el": r["p95_e2el_ms"] / base["p95_e2el_ms"] - 1,
                "cpu_requests": r["backend_requests"].get("cpu", 0)}

    best = min((r for p, r in rows.items() if p.startswith("split:")), key=lambda r: r["makespan"])
    best = best if best["makespan"] < base["makespan"] * (1 - GAIN) else base  # else K = 0: gpu-only
    return {"gpu_only_makespan": base["makespan"], "gpu_only_p95_ttft_ms": base["p95_ttft_ms"],
            **{p: change(rows[p]) for p in POLICIES},
            "best_split": dict(change(best), k=best["backend_requests"].get("cpu", 0))}


def grid(exp: Experiment, profile: dict, out: Path) -> Path:
    cells = []
    for interval in INTERVALS:
        for k in SPEEDS:
            point = copy.deepcopy(exp)
            point.sweep, point.workload.arrival, point.workload.interval = None, "fixed", interval
            cells.append({"cpu_speed": k, "interval": interval, **cell(point, faster_cpu(profile, k))})
    data = {"experiment": exp.name, "speeds": SPEEDS, "intervals": INTERVALS, "m2_speed": m2_speed(profile),
            "cells": cells}
    out.mkdir(parents=True, exist_ok=True)
    (out / "grid.json").write_text(json.dumps(data, indent=2) + "\n")
    draw(data, out / "grid.png")
    return out / "grid.json"


def draw(data: dict, path: Path) -> None:
    from mvllm.report.style import figure, save

    speeds, intervals = data["speeds"], data["intervals"]
    fig, axes = figure(2, 4, width=20, height=9)
    for col, policy in enumerate((*POLICIES, "best_split")):
        for row, metric in enumerate(("makespan", "p95_ttft")):
            ax = axes[row][col]
            grid = [[100 * next(c for c in data["cells"] if c["cpu_speed"] == k and c["interval"] == i)[policy][metric]
                     for k in speeds] for i in intervals]
            image = ax.imshow(grid, cmap="RdBu_r", vmin=-50, vmax=50, aspect="auto", origin="lower")
            for y, line in enumerate(grid):
                for x, v in enumerate(line):
                    ax.text(x, y, f"{v:+.0f}%", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(speeds)), [f"{k:g}x" for k in speeds])
            ax.set_yticks(range(len(intervals)), [f"{1 / i:g}" for i in intervals])
            ax.set_xlabel("CPU speed, relative to the profile's")
            ax.set_ylabel("arrivals per second")
            name = "best static split" if policy == "best_split" else policy
            ax.set_title(f"{name} · {'batch completion' if metric == 'makespan' else 'p95 TTFT'}")
            m2 = data["m2_speed"]
            ax.axvline(_position(m2, speeds), color="k", ls="--", lw=1)
            ax.text(_position(m2, speeds), -0.45, " M2", fontsize=8, va="bottom")
            if 0.05 in intervals:
                ax.plot(_position(1.0, speeds), intervals.index(0.05) + 0.32, "k*", ms=9)
    fig.subplots_adjust(hspace=0.35, wspace=0.3)
    fig.colorbar(image, ax=axes, shrink=0.6, label="change against gpu-only (%; blue is better)")
    fig.suptitle(f"Where the CPU pays: {data['experiment']} simulated from its profile "
                 "(★ the experiment as profiled; dashed: the reference M2's CPU/GPU ratio)")
    save(fig, path)


def _position(k: float, speeds) -> float:
    """k on the speed axis (log-spaced ticks at 0, 1, ...)."""
    import math

    lo = math.log2(speeds[0])
    return (math.log2(k) - lo) / (math.log2(speeds[1]) - lo)
