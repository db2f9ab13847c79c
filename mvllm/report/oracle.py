"""The oracle among static splits: of the split:K policies run (the first K requests to the cpu
backend, the rest to gpu), the K with the lowest mean batch completion time, and how much of its gain
over gpu-only each adaptive router (mixed, eta, ...) captures without knowing K in advance."""

from __future__ import annotations

import statistics

from mvllm.bench.results import BASELINE
from mvllm.report.load import Results, Run
from mvllm.routing.policies import split_k


def adaptive(policy: str) -> bool:
    """A policy that decides per request: not a static split, not a single backend (gpu-only, cpu-only)."""
    return split_k(policy) is None and not policy.endswith("-only")


def _stats(runs: list[Run]) -> dict:
    runs = sorted(runs, key=lambda r: r.summary.get("run") or 0)
    xs = [r.summary["makespan"] for r in runs]
    return {"n": len(xs), "mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "makespans": xs, "cpu_requests": [r.summary.get("backend_requests", {}).get("cpu", 0) for r in runs]}


def _gain(base: float | None, mean: float) -> float | None:
    return None if not base else (base - mean) / base


def oracle(res: Results) -> list[dict]:
    """One entry per sweep value that has at least two split:K policies with runs. Gains are fractions of
    the baseline's mean (gpu-only, or split:0 where no gpu-only ran). The oracle's gain is 0 when the best
    split is K = 0 (that is gpu-only) or no split beats the baseline; the fraction is then None."""
    out = []
    for v in res.values:
        ks = sorted((k, p) for p in res.policies if (k := split_k(p)) is not None and res.select(p, v))
        if len(ks) < 2:
            continue
        if ks[0][0] != 0 and res.select(BASELINE, v):  # K = 0 is gpu-only: every split is measured against it
            ks.insert(0, (0, BASELINE))
        splits = [{"k": k, "policy": p, **_stats(res.select(p, v))} for k, p in ks]
        base_name = BASELINE if res.select(BASELINE, v) else ("split:0" if ks[0][0] == 0 else None)
        base = _stats(res.select(base_name, v))["mean"] if base_name else None
        for s in splits:
            s["change_vs_baseline"] = None if not base else s["mean"] / base - 1
        best = min(splits, key=lambda s: s["mean"])
        gain = _gain(base, best["mean"])
        if gain is not None and (best["k"] == 0 or gain <= 0):
            gain = 0.0
        pols = []
        for p in res.policies:
            if adaptive(p) and res.select(p, v):
                st = _stats(res.select(p, v))
                g = _gain(base, st["mean"])
                pols.append({"policy": p, **st, "gain": g,
                             "fraction_of_oracle_gain": g / gain if g is not None and gain else None})
        out.append({"value": v, "baseline": base_name, "baseline_mean": base, "splits": splits,
                    "oracle_k": best["k"], "oracle_mean": best["mean"], "oracle_gain": gain, "adaptive": pols})
    return out
