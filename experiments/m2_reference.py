"""The reference experiment (shared/seed/BRIEF.md) predicted from its own published rates with `mvllm simulate`.

The brief gives one aggregate rate per backend: prefill 73 / 2,551 tok/s and decode 45 / 293 tok/s (CPU / GPU
on an Apple M2), at most 4 active. A decode rate measured with 4 running requests fixes the step time at batch
4: step(4) = 4 / rate (GPU 13.7 ms, CPU 88.9 ms). What a step costs at batch 1-3 is not given. On a
memory-bound decoder most of a step is reading the weights once, whatever the batch, so the step time grows
slowly with the batch:

    step(b) = step(4) * (f + (1 - f) * b / 4)

f is the share of a batch-4 step that does not depend on the batch. The range shown runs from f = 1 (every
batch costs the same: pure weight streaming) to f = 0.44 (a batch-1 step costs 0.58 of a batch-4 one). It
brackets what this project measured on the H200 machine, where a batch-1 step cost 0.79 of a batch-4 one on
the CPU (int8w) and 0.93 on the GPU. Run: `python experiments/m2_reference.py` (writes
results/simulate/m2-reference.json).

`--capacity` answers the reference's question in the unit hardware is bought in: with the reference's requests
(496 + 20 prompt tokens, 128 out) arriving as Poisson traffic, the highest rate at which 99% of them meet an
SLO, for gpu-only, mixed and eta (`mvllm simulate --slo`'s search), at each f, for two SLOs: one the M2's CPU
can meet while decoding (TPOT 100 ms against its 89 ms step at batch 4) and one it cannot (TPOT 50 ms).
Writes results/simulate/m2-capacity.json and, for f = 0.8, m2-capacity-<slo>.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mvllm.bench.experiment import load
from mvllm.simulate.reference import BRIEF, profile  # noqa: F401 (BRIEF: the rates this script reports)
from mvllm.simulate.sim import simulate

REFERENCE = {"paper-8": {"gpu-only": 11.47, "mixed": 10.35, "cpu_requests": "0, 1, 6"},
             "paper-48": {"gpu-only": 68.43, "mixed": 60.88, "cpu_requests": "6, 6, 6"}}
SHARES = (1.0, 0.9, 0.8, 0.6, 0.44)


SLOS = ("ttft:2000 tpot:100", "ttft:2000 tpot:50")
CAPACITY_POLICIES = ["gpu-only", "mixed", "eta"]


def capacity_main() -> int:
    from mvllm.bench.experiment import apply
    from mvllm.capacity import draw
    from mvllm.simulate.capacity import capacity
    from mvllm.slo import parse_slo

    exp = load(Path(__file__).resolve().parent / "paper-48.toml")
    exp.backends = "gpu=mps,cpu=cpu"
    exp = apply(apply(apply(exp, "workload.arrival", "poisson"), "workload.rate", 8.0), "workload.requests", 400)
    out = {"command": "python experiments/m2_reference.py --capacity", "share": 0.99, "tolerance": 0.02,
           "workload": "paper-48's requests (496 cached + 20 tokens, 128 out), 400 of them, Poisson arrivals",
           "rows": []}
    print("| f | SLO | gpu-only req/s | mixed | eta |")
    print("| --- | --- | --- | --- | --- |")
    for share in SHARES:
        for text in SLOS:
            slo = parse_slo([text])
            found = capacity(exp, profile(share), CAPACITY_POLICIES, slo, 0.99, (1.0, 8.0), 0.02)
            rates = {r["policy"]: r["capacity"] for r in found}
            out["rows"].append({"share_f": share, "slo": slo, "capacity": rates, "searches": found})
            g = rates["gpu-only"]
            cells = [f"{rates['gpu-only']:.2f}"] + [f"{rates[p]:.2f} ({100 * (rates[p] / g - 1):+.0f}%)"
                                                    for p in ("mixed", "eta")]
            print(f"| {share} | {text} | " + " | ".join(cells) + " |", flush=True)
            if share == 0.8:
                name = text.replace("ttft:", "ttft").replace(" tpot:", "-tpot")
                draw(found, f"reference M2 (f = 0.8), simulated: 99% within {text} ms",
                     Path(f"results/simulate/m2-capacity-{name}.png"))
    Path("results/simulate/m2-capacity.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
    return 0


def main() -> int:
    if "--capacity" in sys.argv[1:]:
        return capacity_main()
    root = Path(__file__).resolve().parent
    out = {"command": "python experiments/m2_reference.py", "model": "step(b) = step(4) * (f + (1 - f) * b / 4)",
           "reference": REFERENCE, "predictions": []}
    print("| f (batch-independent share) | step(1) GPU / CPU ms | paper-8 gpu-only / mixed (s) | mixed to CPU "
          "| paper-48 gpu-only / mixed (s) | mixed to CPU |")
    print("| --- | --- | --- | --- | --- | --- |")
    for share in SHARES:
        prof = profile(share)
        row = {"share": share}
        cells = []
        for name in ("paper-8", "paper-48"):
            exp = load(root / f"{name}.toml")
            exp.backends = "gpu=mps,cpu=cpu"
            runs = {r["policy"]: r for r in simulate(exp, prof, ["gpu-only", "mixed"], None)}
            row[name] = {p: {"makespan": r["makespan"], "backend_requests": r["backend_requests"]}
                         for p, r in runs.items()}
            g, m = runs["gpu-only"]["makespan"], runs["mixed"]["makespan"]
            cells += [f"{g:.2f} / {m:.2f} ({100 * (m / g - 1):+.1f}%)", str(runs["mixed"]["backend_requests"].get("cpu", 0))]
        steps = " / ".join(f"{prof['backends'][b]['decode'][0]['step_ms']:.1f}" for b in ("gpu", "cpu"))
        print(f"| {share} | {steps} | " + " | ".join(cells) + " |")
        out["predictions"].append(row)
    path = Path("results/simulate/m2-reference.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
