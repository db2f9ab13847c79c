"""The engine's host work a step, beside the model: the scheduler's `schedule` (what runs next) and `land` (the
sampled tokens into their sequences, full blocks into the prefix cache), in ms a step, at --active running
requests on the CPU backend of a tiny model (the model's own time is left out by timing only those two calls).
A GPU worker pays the same Python every step, so this is the part of its step the host work sets.

    python experiments/probes/step_host_cost.py --out /tmp/host.json
    git archive COMMIT mvllm | tar -x -C .old && PYTHONPATH=.old python experiments/probes/step_host_cost.py
        # an older tree's package against this one's: run both, alternating (.old is git-ignored)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import mvllm
from mvllm import LLM, SamplingParams
from mvllm.engine import scheduler


def timed(name: str, totals: dict, calls: dict) -> None:
    """Scheduler.<name> adds its time to totals[name] and counts its calls (schedule's: the steps)."""
    original = getattr(scheduler.Scheduler, name)

    def wrapper(self, *args, **kwargs):
        t = time.perf_counter()
        result = original(self, *args, **kwargs)
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - t
        calls[name] = calls.get(name, 0) + 1
        return result

    setattr(scheduler.Scheduler, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="synthetic:tiny-llama")
    ap.add_argument("--active", type=int, default=256)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    llm = LLM(args.model, max_active=args.active)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 500) for _ in range(args.prompt)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:args.active], params)  # warm
    totals: dict[str, float] = {}
    calls: dict[str, int] = {}
    for name in ("schedule", "land"):
        timed(name, totals, calls)
    runs = []
    for _ in range(args.repeats):
        totals.clear()
        calls.clear()
        llm.engine.reset_prefix_cache()
        llm.generate(prompts, params)
        n = calls["schedule"]
        runs.append({name: 1000 * totals[name] / n for name in ("schedule", "land")} | {"steps": n})
    result = {"tree": mvllm.__file__, "model": args.model, "active": args.active, "requests": args.requests,
              "prompt": args.prompt, "output": args.output, "runs": runs,
              **{f"{name}_ms": statistics.median(r[name] for r in runs) for name in ("schedule", "land")}}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
