"""The default policy's goal (never worse than gpu-only) in the simulator (regenerate: .venv/bin/python
experiments/policy_safety.py; writes results/simulate/policy-safety.json).

paper-48's H200 profile with the serving overheads of serving.json, the CPU at 1x, 2x and 4x its profiled
speed, on bursts (48 requests, 20/s) and on sustained Poisson arrivals for 30 s at 8, 12, 16 and 20 req/s
(the GPU alone serves about 12.5/s): each policy's change of makespan, p95 TTFT and p95 E2E against gpu-only,
the median over 5 seeds and its spread (min, max) over seeds; for bursts also the best static split.
"misjudged": the same with the router deciding by that profile while the CPU runs 25% slower than it
believes (served CPU steps were up to 30% over the profiled ones in paper-48): the model's error.
"""

import copy
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mvllm.bench.experiment import load  # noqa: E402
from mvllm.simulate.grid import faster_cpu  # noqa: E402
from mvllm.simulate.proof import with_serving  # noqa: E402
from mvllm.simulate.sim import simulate  # noqa: E402

POLICIES = ["gpu-only", "mixed", "eta", "makespan"]
SPEEDS = (1.0, 2.0, 4.0)
RATES = (8.0, 12.0, 16.0, 20.0)
SEEDS = range(5)
METRICS = {"makespan": "makespan", "p95_ttft": "p95_ttft_ms", "p95_e2el": "p95_e2el_ms"}


def workloads(exp):
    burst = copy.deepcopy(exp)
    yield "burst 48 @ 20/s", [burst], True
    for rate in RATES:
        points = []
        for seed in SEEDS:
            p = copy.deepcopy(exp)
            w = p.workload
            w.arrival, w.rate, w.duration, w.seed, w.requests = "poisson", rate, 30.0, seed, None
            points.append(p)
        yield f"poisson {rate:g}/s", points, False


def main(policies=POLICIES, cpu_error: float = 1.0) -> dict:
    exp = load(ROOT / "experiments" / "paper-48.toml")
    exp.sweep = None
    serving = json.loads((ROOT / "results" / "simulate" / "serving.json").read_text())
    base = with_serving(json.loads((ROOT / "results" / "paper-48" / "profile.json").read_text()), serving)
    cells = []
    for speed in SPEEDS:
        believed = faster_cpu(base, speed)
        profile = faster_cpu(base, speed / cpu_error)
        for label, points, burst in workloads(exp):
            splits = [f"split:{k}" for k in range(1, 13)] if burst else []
            runs = [{r["policy"]: r for r in simulate(p, profile, [*policies, *splits], None, believed)} for p in points]
            cell = {"cpu_speed": speed, "workload": label}
            for policy in [*policies[1:], *(["best_split"] if burst else [])]:
                changes = {}
                for key, metric in METRICS.items():
                    per_seed = []
                    for rows in runs:
                        g = rows["gpu-only"][metric]
                        row = rows[policy] if policy != "best_split" else min(
                            (rows[s] for s in splits), key=lambda r: r["makespan"])
                        per_seed.append(row[metric] / g - 1)
                    changes[key] = {"median": statistics.median(per_seed), "min": min(per_seed),
                                    "max": max(per_seed)}
                if policy == "best_split":
                    best = min((runs[0][s] for s in splits), key=lambda r: r["makespan"])
                    changes["k"] = best["backend_requests"].get("cpu", 0)
                else:
                    changes["cpu_requests"] = statistics.median(r[policy]["backend_requests"].get("cpu", 0)
                                                                for r in runs)
                cell[policy] = changes
            cells.append(cell)
    return {"command": ".venv/bin/python experiments/policy_safety.py", "profile": "results/paper-48/profile.json",
            "serving": "results/simulate/serving.json", "cells": cells}


if __name__ == "__main__":
    data = main()
    data["misjudged"] = main(cpu_error=1.25)["cells"]
    (ROOT / "results" / "simulate" / "policy-safety.json").write_text(json.dumps(data, indent=2) + "\n")
    for c in data["cells"] + [dict(c, workload="MISJUDGED " + c["workload"]) for c in data["misjudged"]]:
        line = f"cpu {c['cpu_speed']:g}x {c['workload']:18}"
        for p in ("mixed", "eta", "makespan", "best_split"):
            if p in c:
                v = c[p]
                line += (f" | {p[:4]} mk {100 * v['makespan']['median']:+5.1f} tt {100 * v['p95_ttft']['median']:+6.1f}"
                         f" e2e {100 * v['p95_e2el']['median']:+5.1f} cpu {v.get('cpu_requests', v.get('k'))}")
        print(line)
