"""The simulator held to the committed H200 runs, and the serving overheads it needs.

`serving(folder)` measures, from one experiment's committed runs, what a profile does not see: per backend,
the time a request spends outside the backend (HTTP, routing, pipes; `request_ms`) and the host time each
step gains while serving (`step_ms`). Both are the median gap between the measured requests and the same
requests simulated without them: TPOT for `step_ms`, then TTFT of requests that found the backend with a free
slot for `request_ms`. It reads the gpu-only runs after the first (the first run of a fresh server pays
its warm-up) and the eta runs (all on the gpu) for the gpu, and the split:K runs for the cpu. `prove(names, serving)` simulates every experiment from
its own profile with those overheads (a profile made with `--serving` keeps its own) and lines each cell up
with the measured mean. The runs of results/compiled-gpu/ (the compiled GPU path) were profiled with `--serving`
in their own session, so they are predicted from that profile alone.
"""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

from mvllm.bench import workload as wl
from mvllm.bench.experiment import load
from mvllm.bench.results import find_file, read_aggregate, request_rows
from mvllm.simulate.sim import DRIFT, measured, run_one, scaled_steps, simulate

EXPERIMENTS = ("paper-8", "paper-48", "gpu-serial", "sweep-concurrency", "sweep-hit-rate", "sweep-rate")
COMPILED = tuple(f"compiled-gpu/{n}" for n in ("paper-8", "paper-48", "gpu-serial", "sweep-hit-rate", "sweep-rate"))
CALIBRATION = "paper-48"


def with_serving(profile: dict, serving: dict | None) -> dict:
    """The profile with a `serving` block on each backend it names (one already there is kept)."""
    out = copy.deepcopy(profile)
    for name, block in (serving or {}).get("backends", {}).items():
        if name in out["backends"]:
            out["backends"][name].setdefault("serving", {k: block[k] for k in ("request_ms", "step_ms")})
    return out


def _runs(folder: Path, policy: str) -> list[list[dict]]:
    label = policy.replace(":", "-")
    return [request_rows(d) for d in sorted(folder.glob(f"{label}-run*")) if find_file(d, "requests.csv")]


def serving(root: Path, name: str = CALIBRATION) -> dict:
    exp = load(root / "experiments" / f"{name}.toml")
    profile = json.loads((root / "results" / name / "profile.json").read_text())
    vocab = wl.vocab_of(exp.model, exp.workload)
    folder = root / "results" / name
    gaps: dict[str, dict[str, list[float]]] = {b: {"tpot": [], "ttft": []} for b in ("gpu", "cpu")}
    sources = {"gpu": ["gpu-only", "eta"], "cpu": [p for p in exp.policies if p.startswith("split:")]}
    for backend, policies in sources.items():
        for policy in policies:
            sim: list = []
            run_one(exp, policy, profile, vocab, sim)
            by_id = {r.id: r for r in sim}
            runs = _runs(folder, policy)[1 if policy == "gpu-only" else 0:]
            for rows in runs:
                for row in rows:
                    r = by_id[int(row["id"])]
                    if row["backend"] != backend or r.backend != backend or row["error"]:
                        continue
                    gaps[backend]["tpot"].append(float(row["tpot_ms"]) - 1000 * r.tpot)
                    busy = sum(1 for o in sim if o.backend == backend and o.arrival < r.arrival < o.finish)
                    if busy < exp.max_active and int(row["id"]) > 0:  # a free slot, and not the run's first request
                        gaps[backend]["ttft"].append(float(row["ttft_ms"]) - 1000 * r.ttft)
    out = {}
    for backend, g in gaps.items():
        step = statistics.median(g["tpot"])
        out[backend] = {"step_ms": step, "request_ms": statistics.median(g["ttft"]) - step,
                        "from_requests": {"tpot": len(g["tpot"]), "ttft": len(g["ttft"])}}
    return {"experiment": name, "rule": __doc__.split("\n\n")[1].replace("\n", " "), "backends": out}


def ran(root: Path, name: str):
    """The experiment as bench ran it: the copy in its results folder (the file in experiments/ may have moved
    on since), or experiments/<name>.toml for results without one."""
    copy_ = root / "results" / name / "experiment.toml"
    return load(copy_ if copy_.is_file() else root / "experiments" / f"{name.split('/')[-1]}.toml")


def prove(root: Path, serving_block: dict | None, names=EXPERIMENTS + COMPILED) -> dict:
    experiments = {}
    for name in names:
        exp = ran(root, name)
        profile = with_serving(json.loads((root / "results" / name / "profile.json").read_text()), serving_block)
        real = measured(root / "results" / name)
        placed = {(a["policy"], a["value"]): a.get("backend_requests") for a in read_aggregate(root / "results" / name)}
        cells = []
        for r in simulate(exp, profile, exp.policies, None, spread=DRIFT):
            m = real.get((r["policy"], r["value"]))
            if not m:
                continue
            lo, hi = r["band"]["p95_ttft_ms"]
            cells.append({"policy": r["policy"], "value": r["value"], "makespan": r["makespan"],
                          "band": r["band"], "p95_ttft_in_band": lo <= m["p95_ttft_ms"]["mean"] <= hi,
                          "measured_makespan": m["makespan"]["mean"], "measured_makespan_std": m["makespan"]["std"],
                          "p95_ttft_ms": r["p95_ttft_ms"], "measured_p95_ttft_ms": m["p95_ttft_ms"]["mean"],
                          "p95_e2el_ms": r["p95_e2el_ms"], "measured_p95_e2el_ms": m["p95_e2el_ms"]["mean"],
                          "backend_requests": r["backend_requests"],
                          "measured_backend_requests": placed.get((r["policy"], r["value"]))})
        experiments[name] = {"cells": cells, **errors(cells)}
    every = [c for e in experiments.values() for c in e["cells"]]
    return {"experiments": experiments, "all": errors(every)}


def errors(cells: list[dict]) -> dict:
    mk = [c["makespan"] / c["measured_makespan"] - 1 for c in cells]
    ttft = [c["p95_ttft_ms"] / c["measured_p95_ttft_ms"] - 1 for c in cells]
    out = {"cells_n": len(cells), "median_makespan_error": statistics.median(mk),
           "worst_makespan_error": max(mk, key=abs), "median_p95_ttft_error": statistics.median(ttft)}
    if all("p95_ttft_in_band" in c for c in cells):
        out["p95_ttft_in_band"] = sum(c["p95_ttft_in_band"] for c in cells)
    return out


def served_admissions_ms(rows: list[dict], backend: str = "gpu") -> list[float]:
    """Measured durations of the steps that admitted a prompt beside running requests, from the client's token
    stamps: one backend's tokens cluster into steps (one token per running request, within 0.8 ms), and a step
    holding some request's first token admitted it."""
    stamps = []
    for r in rows:
        if r["backend"] != backend or r["error"]:
            continue
        t = float(r["first_token"])
        stamps.append((t, r["id"], True))
        for gap in r["itl_ms"].split():
            t += float(gap) / 1000
            stamps.append((t, r["id"], False))
    stamps.sort()
    steps: list[dict] = []
    for t, rid, first in stamps:
        if steps and t - steps[-1]["t"] < 0.0008 and rid not in steps[-1]["ids"]:
            steps[-1]["ids"].add(rid)
            steps[-1]["admits"] |= first
        else:
            steps.append({"t": t, "ids": {rid}, "admits": first})
    return [1000 * (b["t"] - a["t"]) for a, b in zip(steps, steps[1:]) if b["admits"] and len(b["ids"]) >= 2]


def hit_rate_check(root: Path, serving_block: dict) -> dict:
    """sweep-hit-rate again, with the gpu's admission priced by the mixed steps its own gpu-only runs served
    (what `mvllm profile` now measures as `mixed`; the profile of these runs predates it): whether the
    admission cost is the cause of the misses. A check of the cause, not a prediction."""
    name = "sweep-hit-rate"
    exp = load(root / "experiments" / f"{name}.toml")
    profile = with_serving(json.loads((root / "results" / name / "profile.json").read_text()), serving_block)
    gpu = profile["backends"]["gpu"]
    lone = {p["kind"]: p for p in gpu["prefill"]}
    served = {}
    for suffix in (256, 516):
        rows = [r for d in sorted((root / "results" / name).glob(f"suffix_tokens={suffix}-gpu-only-run*"))
                for r in [request_rows(d)]]
        served[suffix] = statistics.median(x for run in rows for x in served_admissions_ms(run))
    top = max(d["batch"] for d in gpu["decode"] if d["batch"] <= exp.max_active)
    step = next(d["step_ms"] for d in gpu["decode"] if d["batch"] == top)
    first = next(d["step_ms"] for d in gpu["decode"] if d["batch"] == 1)
    gpu["mixed"] = [{"kind": "warm", "tokens": 20, "batch": top, "ms": step + lone["warm"]["ms"] - first},
                    {"kind": "half", "tokens": 256, "batch": top, "ms": served[256]},
                    {"kind": "cold", "tokens": 516, "batch": top, "ms": served[516]}]
    real = measured(root / "results" / name)
    cells = [{"policy": r["policy"], "value": r["value"], "makespan": r["makespan"],
              "measured_makespan": real[(r["policy"], r["value"])]["makespan"]["mean"],
              "p95_ttft_ms": r["p95_ttft_ms"], "measured_p95_ttft_ms": real[(r["policy"], r["value"])]["p95_ttft_ms"]["mean"],
              "backend_requests": r["backend_requests"]}
             for r in simulate(exp, profile, exp.policies, None)]
    return {"served_admission_ms": served, "mixed": gpu["mixed"], "cells": cells, **errors(cells)}


def drift_check(root: Path, name: str, serving_block: dict | None) -> dict:
    """Every measured run simulated again with each backend's decode steps scaled by that run's own served
    TPOT over the simulated one (the router still decides by the profile): whether the drift of the step time
    from run to run, which hosts show (served GPU TPOT 1.40-1.70 ms over paper-48's 30 runs of one session),
    is what the p95 TTFT misses come from. A check of the cause, not a prediction: it reads each run's TPOT."""
    exp = ran(root, name)
    profile = with_serving(json.loads((root / "results" / name / "profile.json").read_text()), serving_block)
    runs = []
    for value, point in exp.points():
        vocab = wl.vocab_of(point.model, point.workload)
        prefix = "" if value is None else f"{exp.sweep.knob.split('.')[-1]}={value}-"
        for policy in exp.policies:
            sim: list = []
            run_one(point, policy, profile, vocab, sim)
            for folder in sorted((root / "results" / name).glob(f"{prefix}{policy.replace(':', '-')}-run*")):
                rows = [r for r in request_rows(folder) if not r["error"]]
                ratios = {}
                for backend in {r["backend"] for r in rows}:
                    real = [float(r["tpot_ms"]) for r in rows if r["backend"] == backend and r["tpot_ms"]]
                    model = [1000 * r.tpot for r in sim if r.backend == backend and r.tpot]
                    if real and model:
                        ratios[backend] = statistics.median(real) / statistics.median(model)
                got = run_one(point, policy, scaled_steps(profile, ratios), vocab, believed=profile)
                summary = json.loads((folder / "summary.json").read_text())
                runs.append({"run": folder.name, "policy": policy, "value": value, "tpot_ratio": ratios,
                             "makespan": got["makespan"], "measured_makespan": summary["makespan"],
                             "p95_ttft_ms": got["p95_ttft_ms"], "measured_p95_ttft_ms": summary["p95_ttft_ms"]})
    mk = [r["makespan"] / r["measured_makespan"] - 1 for r in runs]
    ttft = [r["p95_ttft_ms"] / r["measured_p95_ttft_ms"] - 1 for r in runs]
    return {"runs": runs, "runs_n": len(runs), "median_makespan_error": statistics.median(mk),
            "median_p95_ttft_error": statistics.median(ttft), "worst_p95_ttft_error": max(ttft, key=abs)}
