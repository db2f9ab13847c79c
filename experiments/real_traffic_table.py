"""The real-traffic runs on the H200 against what `mvllm simulate` predicted before they ran: makespan, p95 TTFT,
p95 E2EL and prefix-hit rate per experiment and policy, as a markdown table and JSON.

    python experiments/real_traffic_table.py [results/real-traffic] [--out results/real-traffic/vs-predicted.json]

Measured runs of an experiment are those in its folder and in any <experiment>-r<N> beside it (more runs of
the same experiment in a later call, as in results/routing).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

KEYS = (("makespan", "batch completion s", 1.0), ("p95_ttft_ms", "p95 TTFT s", 1e-3),
        ("p95_e2el_ms", "p95 E2EL s", 1e-3), ("hit_rate", "hit rate %", 100.0))


def measured(folder: Path) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {}
    for s in sorted(folder.glob("*/summary.json")):
        d = json.loads(s.read_text())
        runs.setdefault(d["policy"], []).append(d)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", default="results/real-traffic", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = []
    for pred_dir in sorted((a.folder / "predicted").iterdir()):
        runs = measured(a.folder / pred_dir.name)
        for more in sorted(a.folder.glob(f"{pred_dir.name}-r[0-9]*")):
            for policy, got in measured(more).items():
                runs.setdefault(policy, []).extend(got)
        for pol_dir in sorted(d for d in pred_dir.iterdir() if d.is_dir()):
            p = json.loads((pol_dir / "summary.json").read_text())
            got = runs.get(p["policy"])
            if not got:
                continue
            row = {"experiment": pred_dir.name, "policy": p["policy"], "runs": len(got),
                   "backend_requests": [r["backend_requests"] for r in got]}
            for key, _, _ in KEYS:
                vals = [r[key] for r in got if r.get(key) is not None]
                row[key] = {"predicted": p.get(key), "band": (p.get("band") or {}).get(key),
                            "measured": statistics.mean(vals) if vals else None,
                            "sd": statistics.stdev(vals) if len(vals) > 1 else 0.0}
            rows.append(row)
    head = "| experiment | policy | runs | " + " | ".join(f"{t}: predicted / measured" for _, t, _ in KEYS) + " |"
    print(head)
    print("|" + " --- |" * (3 + len(KEYS)))
    for r in rows:
        cells = []
        for key, _, scale in KEYS:
            v = r[key]
            if v["measured"] is None or v["predicted"] is None:
                cells.append("–")
                continue
            pr, me, sd = v["predicted"] * scale, v["measured"] * scale, v["sd"] * scale
            err = f" ({100 * (v['predicted'] / v['measured'] - 1):+.1f}%)" if key != "hit_rate" else \
                f" ({pr - me:+.1f} pt)"
            cells.append(f"{pr:.2f} / {me:.2f} ± {sd:.2f}{err}")
        print(f"| {r['experiment']} | {r['policy']} | {r['runs']} | " + " | ".join(cells) + " |")
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
