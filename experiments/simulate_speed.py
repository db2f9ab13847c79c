"""How fast `mvllm simulate experiments/trace-conversation-full.toml` runs as typed, with its defaults (the ±8%
band included): the whole Mooncake conversation trace at scale 1, eta, results/capacity's profile.

The command runs as its own process, as a user runs it (`python -m mvllm.cli simulate EXP`; `--root` picks the
checkout, so another commit can be measured the same way), in a scratch folder so that its summaries go there
(results/<name>/simulated under it; no measured run is found there, as none is in this repository). Each run
reports its wall time, the host's load average before and after it (the development host is shared: a wall time
under load says little), and its CPU time: the parent's own (imports, the workload, the run as profiled, its
summary, the table) and the band's two child processes' (forked on Linux, both waited for). `cpu_bound_s` is
the wall time that CPU would take at best on two otherwise idle cores: the larger of the parent's CPU and half
the whole. --repeats runs it that many times and keeps every run; `best` is the run of least CPU.

    .venv/bin/python experiments/simulate_speed.py --out results/simulate/speed-scale1.json
    .venv/bin/python experiments/simulate_speed.py --root /path/to/other/checkout --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENT = "experiments/trace-conversation-full.toml"
# the CLI as `python -m mvllm.cli`, with its own and its waited children's CPU written at exit
WRAP = ("import atexit, json, resource, runpy, sys\n"
        "path = sys.argv.pop(1)\n"
        "def note():\n"
        "    me, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))\n"
        "    json.dump({'parent_cpu_s': me.ru_utime + me.ru_stime, 'children_cpu_s': kids.ru_utime + kids.ru_stime,\n"
        "               'peak_rss_mib': max(me.ru_maxrss, kids.ru_maxrss) / 1024}, open(path, 'w'))\n"
        "atexit.register(note)\n"
        "sys.argv[0] = 'mvllm'\n"
        "runpy.run_module('mvllm.cli', run_name='__main__')\n")


def run(root: Path, python: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        note = Path(tmp) / "rusage.json"
        cmd = [python, "-c", WRAP, str(note), "simulate", str(root / EXPERIMENT)]
        env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "120"}
        load = os.getloadavg()[0]
        start = time.perf_counter()
        done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode:
            sys.exit(f"the command failed (exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
        got = json.loads(note.read_text())
        summary = json.loads(next((Path(tmp) / "results").glob("*/simulated/eta/summary.json")).read_text())
    total = got["parent_cpu_s"] + got["children_cpu_s"]
    return {"wall_s": round(wall, 2), "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2),
            "cpu_s": round(total, 2), "parent_cpu_s": round(got["parent_cpu_s"], 2),
            "children_cpu_s": round(got["children_cpu_s"], 2),
            "cpu_bound_s": round(max(got["parent_cpu_s"], total / 2), 2), "peak_rss_mib": round(got["peak_rss_mib"]),
            "summary": {k: summary[k] for k in ("makespan", "completed", "failed", "p95_ttft_ms", "p95_e2el_ms",
                                                "backend_requests", "total_cached_tokens", "kv_blocks",
                                                "preemptions", "band")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose mvllm runs (default: this one)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--out", help="write the runs as JSON here")
    ap.add_argument("--host", default="dev host, 2 vCPU (AMD EPYC), shared", help="what --out says the machine was")
    args = ap.parse_args()
    root = Path(args.root).resolve()
    runs = []
    for i in range(args.repeats):
        r = run(root, args.python)
        runs.append(r)
        print(f"run {i + 1}: wall {r['wall_s']:.2f} s (load {r['load_before']:.2f} -> {r['load_after']:.2f}), CPU "
              f"{r['cpu_s']:.2f} s (parent {r['parent_cpu_s']:.2f}, band's children {r['children_cpu_s']:.2f}): "
              f"at best {r['cpu_bound_s']:.2f} s on two idle cores; peak RSS {r['peak_rss_mib']} MiB", flush=True)
    best = min(runs, key=lambda r: r["cpu_s"])
    s = best["summary"]
    print(f"eta: makespan {s['makespan']:.1f} s, p95 TTFT {s['p95_ttft_ms']:.0f} ms (band "
          f"{s['band']['p95_ttft_ms'][0]:.0f}-{s['band']['p95_ttft_ms'][1]:.0f}), completed {s['completed']}, "
          f"per backend {s['backend_requests']}")
    if args.out:
        git = ["git", "-C", str(root)]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        if subprocess.run([*git, "status", "--porcelain", "mvllm"], capture_output=True, text=True).stdout.strip():
            commit += " with uncommitted changes to mvllm/"
        out = {"command": f"mvllm simulate {EXPERIMENT}",
               "measured_by": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
               "commit": commit, "host": args.host, "cpus": os.cpu_count(), "python": platform.python_version(),
               "best": {k: v for k, v in best.items() if k != "summary"}, "runs": runs}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
