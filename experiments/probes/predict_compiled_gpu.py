"""The simulator's prediction of paper-8, paper-48 and gpu-serial with the compiled GPU
backend (results/compiled-gpu), committed before those experiments are run on it. Added before the same runs (and still
before any of them): `makespan` and gpu-serial's split:K oracle, sweep-rate at the new GPU's capacity (12, 18
and 24 req/s for 30 s) and sweep-hit-rate; the first prediction's numbers are unchanged.

    .venv/bin/python experiments/probes/predict_compiled_gpu.py

The profile it predicts from is composed of two H200 measurements of different sessions:
- gpu: results/profile/h200-gpu-compiled.json (the compiled GPU backend, profiled up to 16 active;
  each experiment cuts it to its own max_active);
- cpu: results/paper-48/profile.json (int8w at 8 threads, as paper-48 last ran it);
plus the serving overheads of results/simulate/serving.json (measured on the GPU path before it was compiled).
Hosts vary by 30% between sessions, so the run that checks this prediction profiles both backends again in
its own session; the prediction is stated here, before that run, from what is known now.
Writes results/simulate/predicted-compiled-gpu.json (the prediction of every policy, the profile used).
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mvllm.bench.experiment import load  # noqa: E402
from mvllm.simulate.proof import with_serving  # noqa: E402
from mvllm.simulate.sim import simulate  # noqa: E402

KEYS = ("value", "backend_requests", "duration", "median_ttft_ms", "p95_ttft_ms", "median_e2el_ms", "p95_e2el_ms")


def profile() -> dict:
    gpu = json.loads((ROOT / "results/profile/h200-gpu-compiled.json").read_text())
    cpu = json.loads((ROOT / "results/paper-48/profile.json").read_text())
    composed = {"model": gpu["model"], "backends": {"gpu": gpu["backends"]["gpu"], "cpu": cpu["backends"]["cpu"]},
                "environment": {"gpu": gpu["environment"], "cpu": cpu["environment"]}}
    serving = json.loads((ROOT / "results/simulate/serving.json").read_text())
    return with_serving(composed, serving)


def main() -> None:
    data = profile()
    out = {"command": ".venv/bin/python experiments/probes/predict_compiled_gpu.py",
           "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip(),
           "profile": {"gpu": "results/profile/h200-gpu-compiled.json", "cpu": "results/paper-48/profile.json",
                       "serving": "results/simulate/serving.json"},
           "experiments": {}}
    for name in ("paper-8", "paper-48", "gpu-serial", "sweep-rate", "sweep-hit-rate"):
        exp = load(ROOT / "experiments" / f"{name}.toml")
        rows = simulate(exp, data, exp.policies, None)
        cells = {(r["policy"] if r["value"] is None else f"{r['value']} {r['policy']}"): {k: r.get(k) for k in KEYS}
                 for r in rows}
        out["experiments"][name] = cells
        print(f"{name}:")
        gpu_only = {r["value"]: r["duration"] for r in rows if r["policy"] == "gpu-only"}
        for label, r in cells.items():
            base = gpu_only[r["value"]]
            print(f"  {label:16} makespan {r['duration']:6.2f} s ({100 * (r['duration'] / base - 1):+6.1f}%)  "
                  f"p95 TTFT {r['p95_ttft_ms']:7.1f} ms  to cpu {r['backend_requests'].get('cpu', 0)}")
    path = ROOT / "results/simulate/predicted-compiled-gpu.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
