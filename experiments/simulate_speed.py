"""How fast `mvllm simulate` replays the whole Mooncake conversation trace (12,031 requests over 3,537 s), and
in how much memory.

The run: kind "trace" at --scale (default 1: the trace's own lengths and 512-token blocks; 846 requests whose
prompt and output do not fit the model's 32,768-token context are dropped, 11,185 are sent), arrival "trace"
(the file's own timestamps, divided by --speedup), lengths hidden (the router is told the room left in the
context, the modelled engine stops at the trace's output length), policy eta, the two backends of
results/paper-48/profile.json (gpu, cpu; max_active 4). That profile predates `kv_blocks`, so a copy of it is
given the pools those backends have when served (engine._blocks_for_budget for Qwen2.5-0.5B's shapes: the GPU's
4 GiB of bfloat16 KV capped at max_active x 2 x 2048 = 16,384 blocks, the CPU's 1 GiB of float32 KV = 2,730
blocks), so each backend's LRU prefix cache evicts at its real size. The prompts stay hash ids (the simulator
keys its prefix cache on them: bench/idprompt.py). Building the workload and simulating it are timed apart, and
the peak resident memory of the whole process is read at the end; --spread adds simulate's band (the same run
with every step 8% faster and slower: two more runs). --out writes it all as JSON.

    .venv/bin/python experiments/simulate_speed.py --out results/simulate/speed-scale1.json
    .venv/bin/python experiments/simulate_speed.py [--scale 16] [--speedup 1] [--spread 0.08] [--policy eta]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import resource
import sys
import time
from pathlib import Path

STARTED = time.perf_counter()  # the process's wall time counts the simulator's imports
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mvllm.bench import workload as wl  # noqa: E402
from mvllm.bench.experiment import Experiment, Workload  # noqa: E402
from mvllm.simulate.sim import simulate  # noqa: E402

TRACE = Path("/work/shared/data/mooncake/conversation_trace.jsonl.gz")
SERVED_BLOCKS = {"gpu": 16384, "cpu": 2730}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--profile", default=str(ROOT / "results/paper-48/profile.json"))
    ap.add_argument("--speedup", type=float, default=1.0)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--policy", default="eta")
    ap.add_argument("--spread", type=float, default=0.0, help="0.08: with simulate's band, as the CLI's default")
    ap.add_argument("--unbounded", action="store_true", help="leave the profile without kv_blocks")
    ap.add_argument("--out", help="write the timings, peak memory and the run's summary here as JSON")
    ap.add_argument("--host", default="dev host, 2 vCPU", help="what --out says the machine was")
    args = ap.parse_args()
    profile = json.loads(Path(args.profile).read_text())
    if not args.unbounded:
        profile = copy.deepcopy(profile)
        for name, n in SERVED_BLOCKS.items():
            profile["backends"][name].setdefault("kv_blocks", n)
    w = Workload(kind="trace", path=args.trace, scale=args.scale, speedup=args.speedup)
    exp = Experiment(name="simulate-speed", model="synthetic:qwen2.5-0.5b", backends="gpu=cuda,cpu=cpu/threads=8",
                     max_active=4, workload=w)
    vocab = wl.vocab_of(exp.model, w)
    start = time.perf_counter()
    built = wl.build_all(w, vocab, exp.model, tokens=False)
    build_s = time.perf_counter() - start
    n = len(built.requests)
    start = time.perf_counter()
    [row] = simulate(exp, profile, [args.policy], None, spread=args.spread, built=built)
    sim_s = time.perf_counter() - start
    runs = 3 if args.spread > 0 else 1
    print(f"workload: {n} requests ({built.selection['first_turns']} first turns) over "
          f"{built.selection['span_s']:.0f} s of trace, speedup {args.speedup:g}, scale {args.scale:g}")
    print(f"build     {build_s:6.2f} s")
    print(f"simulate  {sim_s:6.2f} s  ({runs} run{'s' if runs > 1 else ''}: {runs * n / sim_s:,.0f} requests/s)")
    print(f"total     {build_s + sim_s:6.2f} s")
    print(f"policy {args.policy}: makespan {row['makespan']:.1f} s, p95 TTFT {row['p95_ttft_ms']:.0f} ms, "
          f"p95 E2EL {row['p95_e2el_ms']:.0f} ms, completed {row['completed']}, per backend {row['backend_requests']}, "
          f"cached tokens {row['total_cached_tokens']:,}, kv_blocks {row['kv_blocks']}, "
          f"preemptions {row['preemptions']}")
    if "band" in row:
        print(f"band ±{100 * args.spread:.0f}%: p95 TTFT {row['band']['p95_ttft_ms'][0]:.0f}-"
              f"{row['band']['p95_ttft_ms'][1]:.0f} ms")
    wall_s = time.perf_counter() - STARTED
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"process   {wall_s:6.2f} s wall (imports included), peak RSS {peak_mb:,.0f} MiB")
    if args.out:
        keys = ("makespan", "completed", "failed", "p95_ttft_ms", "p95_e2el_ms", "backend_requests",
                "total_cached_tokens", "kv_blocks", "preemptions", "band")
        out = {"command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "host": args.host,
               "python": platform.python_version(), "requests": n, "first_turns": built.selection["first_turns"],
               "dropped": built.selection.get("dropped"), "scale": args.scale, "speedup": args.speedup,
               "policy": args.policy, "runs": runs, "build_s": round(build_s, 2), "simulate_s": round(sim_s, 2),
               "total_s": round(build_s + sim_s, 2), "wall_s": round(wall_s, 2), "peak_rss_mib": round(peak_mb),
               "summary": {k: row[k] for k in keys if k in row}}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
