"""Where a compiled GPU decode step's graph spends its time: every kernel of one replay, by name.

    python3 experiments/probes/gpu_step_kernels.py [MODEL] [--batches 1,4,16] [--out FILE.json]

Runs decode at each batch size to a steady state (context ~580), then profiles 20 replays of that step's
CUDA graph with torch.profiler (CUPTI sees the kernels inside a graph) and prints, per kernel name, how many
run per step and their total time; "busy" is the kernels' summed time, "replay" the wall time of one replay,
"step" the engine step around it. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections import defaultdict

import torch

from mvllm import LLM, SamplingParams


def short(name: str) -> str:
    name = re.sub(r"<.*", "", name)
    return name[:70]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="synthetic:qwen2.5-0.5b")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--out")
    ap.add_argument("--compile", default="on")
    ap.add_argument("--overlap", default="off", help="off (the default here): a step is timed whole")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    llm = LLM(a.model, device="cuda", dtype="bfloat16", max_active=16, num_blocks=1000, compile=a.compile == "on",
              overlap=a.overlap == "on")
    ready = time.perf_counter() - t0
    print(f"{a.model} ready {ready:.1f} s", flush=True)
    eng, r = llm.engine, llm.engine.runner
    g = torch.Generator().manual_seed(0)
    vocab = eng.source.config.vocab_size - 1
    out = {"model": a.model, "ready_s": round(ready, 1), "device": torch.cuda.get_device_name(), "batches": {}}
    for b in map(int, a.batches.split(",")):
        seqs = [eng.add_request(torch.randint(0, vocab, (570,), generator=g).tolist(),
                                SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)) for _ in range(b)]
        for _ in range(5):
            eng.step()
        steps = []
        for _ in range(30):
            torch.cuda.synchronize()
            t = time.perf_counter()
            eng.step()
            steps.append((time.perf_counter() - t) * 1e3)
        key = r.graphs.bucket([(len(s) - 1, len(s)) for s in seqs])
        graph = r.graphs.graphs[key]
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()
        replay = (time.perf_counter() - t) / 50 * 1e3
        n = 20
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                graph.replay()
            torch.cuda.synchronize()
        kernels = defaultdict(lambda: [0, 0.0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k = kernels[short(e.name)]
                k[0] += 1
                k[1] += e.device_time_total
        busy = sum(v[1] for v in kernels.values()) / n / 1e3
        count = sum(v[0] for v in kernels.values()) / n
        steps.sort()
        print(f"b{b}: step {steps[len(steps) // 2]:.3f} ms, replay {replay:.3f} ms, kernels busy {busy:.3f} ms, "
              f"{count:.0f} kernels/step", flush=True)
        rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
        for name, (c, us) in rows:
            print(f"   {c / n:6.1f} x {us / c:7.2f} us = {us / n:8.1f} us  {name}")
        out["batches"][b] = {"step_ms": round(steps[len(steps) // 2], 4), "replay_ms": round(replay, 4),
                             "busy_ms": round(busy, 4), "kernels_per_step": count,
                             "kernels": [{"name": k, "per_step": c / n, "us_each": round(us / c, 2)}
                                         for k, (c, us) in rows]}
        while eng.has_unfinished():
            eng.step()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
