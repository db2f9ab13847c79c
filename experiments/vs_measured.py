"""Regenerates results/simulate/serving.json and results/simulate/vs-measured.json:

    .venv/bin/python experiments/vs_measured.py

serving.json: the serving overheads (request_ms, step_ms per backend) measured from paper-48's runs.
vs-measured.json: every committed H200 experiment simulated from its own profile plus those overheads,
each cell beside the measured mean; and the hit-rate check (the gpu's admission priced by served mixed steps).
results/{,compiled-gpu/}<experiment>/simulated/*/summary.json: the predictions `mvllm report` draws (redraw
with `mvllm report results/paper-48` and so on).
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mvllm.simulate.proof import COMPILED, drift_check, hit_rate_check, prove, ran, serving, with_serving  # noqa: E402
from mvllm.simulate.sim import DRIFT, simulate  # noqa: E402


def main() -> None:
    out = ROOT / "results" / "simulate"
    block = serving(ROOT)
    (out / "serving.json").write_text(json.dumps(block, indent=2) + "\n")
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    data = {"command": ".venv/bin/python experiments/vs_measured.py", "git_commit": commit,
            "serving": "results/simulate/serving.json", **prove(ROOT, block),
            "hit_rate_check": hit_rate_check(ROOT, block),
            "drift_check": {name: drift_check(ROOT, name, block) for name in COMPILED}}
    (out / "vs-measured.json").write_text(json.dumps(data, indent=2) + "\n")
    for name in ("paper-8", "paper-48", *COMPILED):  # the predictions `mvllm report` draws beside the bars
        exp = ran(ROOT, name)
        profile = with_serving(json.loads((ROOT / "results" / name / "profile.json").read_text()), block)
        simulate(exp, profile, exp.policies, ROOT / "results" / name / "simulated", spread=DRIFT)
    print(f"{'experiment':28} cells  makespan median  worst    p95 TTFT median")
    for name, e in {**data["experiments"], "all": data["all"], "hit-rate check": data["hit_rate_check"]}.items():
        print(f"{name:28} {e['cells_n']:5}  {100 * e['median_makespan_error']:+14.1f}%  "
              f"{100 * e['worst_makespan_error']:+6.1f}%  {100 * e['median_p95_ttft_error']:+14.1f}%")
    print("drift check (each run's own served TPOT):")
    for name, e in data["drift_check"].items():
        print(f"{name:28} {e['runs_n']:5} runs  {100 * e['median_makespan_error']:+8.1f}%  "
              f"p95 TTFT {100 * e['median_p95_ttft_error']:+6.1f}% (worst {100 * e['worst_p95_ttft_error']:+.1f}%)")


if __name__ == "__main__":
    main()
