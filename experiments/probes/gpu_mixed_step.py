"""What a GPU step that admits long prompts costs, alone and beside running requests: where the time goes.

    python3 experiments/probes/gpu_mixed_step.py [MODEL] [--out FILE.json] [--profile]

Each case admits K fresh prompts of P tokens (random ids: nothing cached) into one step, while D requests of
context C decode (D = 0: the prefill alone), three times, and reports the step's wall time (synchronised: overlap
off), the host's share of it (GraphRunner.pack, the step's input built on the host), the input's size, and
whether torch.compile ran again (dynamo's counters before and after). With --profile, the slowest case's step
once more under torch.profiler: its kernels by total time. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from mvllm import LLM, SamplingParams
from mvllm.engine.cuda_graphs import GraphRunner

CASES = [  # (K prompts, P tokens each, D decoding requests, C their context)
    (4, 2500, 0, 0), (4, 2500, 12, 16000), (1, 10000, 0, 0), (1, 20000, 0, 0), (1, 20000, 12, 16000),
]


def compiles() -> int:
    from torch._dynamo.utils import counters
    return sum(counters["stats"].values()) if "stats" in counters else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="synthetic:qwen2.5-0.5b")
    ap.add_argument("--out")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the probe itself (with --scale)")
    ap.add_argument("--scale", type=int, default=1, help="divide every length by this")
    ap.add_argument("--cases", help="comma-separated indices into CASES (default: all)")
    ap.add_argument("--per-token", action="store_true", help="every row through the per-token attention kernel "
                    "(no tiled kernel for prefill chunks), for a same-machine comparison")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    if a.per_token:
        from mvllm.kernels import triton_attention
        triton_attention.TILED_MIN = 10 ** 9
    t0 = time.perf_counter()
    llm = LLM(a.model, device=a.device, dtype="bfloat16" if a.device == "cuda" else None, max_active=16, kv_cache_gb=8.0, overlap=False,
              max_step_tokens=1 << 20)  # every case's prompts in one step, as the kernels are compared
    eng = llm.engine
    print(f"{a.model} ready {time.perf_counter() - t0:.1f} s, {eng.blocks.num_blocks} blocks", flush=True)
    packs: list[tuple[float, int]] = []
    original = GraphRunner.pack

    def timed_pack(self, *args, **kw):
        t = time.perf_counter()
        buf = original(self, *args, **kw)
        packs.append((time.perf_counter() - t, buf.nbytes))
        return buf

    GraphRunner.pack = timed_pack
    g = torch.Generator().manual_seed(0)
    vocab = eng.source.config.vocab_size - 1

    def prompt(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    out = {"model": a.model, "per_token": a.per_token, "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "cases": []}
    worst = None
    cuda = a.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cases = [CASES[int(i)] for i in a.cases.split(",")] if a.cases else CASES
    for k, p, d, c in [(k, p // a.scale, d, c // a.scale) for k, p, d, c in cases]:
        running = [eng.add_request(prompt(c), SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True))
                   for _ in range(d)]
        while any(s.num_output_tokens < 2 for s in running):
            eng.step()
        sync()
        t = time.perf_counter()
        for _ in range(10):
            eng.step()
        sync()
        decode_ms = (time.perf_counter() - t) / 10 * 1e3 if d else 0.0
        walls, hosts, sizes, again = [], [], [], 0
        for _ in range(a.repeats):
            new = [eng.add_request(prompt(p), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
                   for _ in range(k)]
            before, packs[:] = compiles(), []
            sync()
            t = time.perf_counter()
            eng.step()
            sync()
            walls.append((time.perf_counter() - t) * 1e3)
            again += compiles() - before
            hosts.append(sum(x for x, _ in packs) * 1e3)
            sizes.append(sum(n for _, n in packs))
            for s in new:
                eng.abort(s.request_id)
        row = {"prompts": k, "tokens": p, "decoding": d, "context": c, "decode_step_ms": round(decode_ms, 3),
               "step_ms": [round(x, 2) for x in walls], "pack_ms": [round(x, 2) for x in hosts],
               "input_mb": round(max(sizes) / 1e6, 1), "compile_events": again}
        out["cases"].append(row)
        print(f"K={k} P={p} D={d} C={c}: step {statistics.median(walls):.1f} ms (runs {row['step_ms']}), "
              f"pack {statistics.median(hosts):.1f} ms, input {row['input_mb']} MB, decode-only step "
              f"{decode_ms:.2f} ms, compile events {again}", flush=True)
        if worst is None or statistics.median(walls) > worst[0]:
            worst = (statistics.median(walls), (k, p, d, c))
        if a.profile and (k, p * a.scale, d, c * a.scale) == CASES[-1]:
            new = [eng.add_request(prompt(p), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
                   for _ in range(k)]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                eng.step()
                sync()
            kernels = defaultdict(lambda: [0, 0.0])
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    kk = kernels[e.name[:80]]
                    kk[0] += 1
                    kk[1] += e.device_time_total
            top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]
            print("  kernels of that step (count, ms):")
            for name, (n, us) in top:
                print(f"   {n:5d} {us / 1e3:9.2f}  {name}")
            out["kernels"] = [{"name": n, "count": c_, "ms": round(us / 1e3, 3)} for n, (c_, us) in top]
            for s in new:
                eng.abort(s.request_id)
        for s in running:
            eng.abort(s.request_id)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
