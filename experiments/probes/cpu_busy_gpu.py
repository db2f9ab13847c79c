"""Does a busy CPU backend slow the GPU backend? Both share the host's cores: the GPU worker launches its
graphs from the CPU. GPU decode step times at batch 1, 4 and 16 with the CPU backend idle, then busy
(a separate process decoding batches of 4 with 8 threads, as paper-48's CPU backend runs), then idle again,
in one run.

    python3 experiments/probes/cpu_busy_gpu.py [--threads 8] [--model synthetic:qwen2.5-0.5b] [--out FILE]
"""

import argparse
import json
import multiprocessing as mp
import statistics
import sys

import torch

from mvllm import LLM, SamplingParams
from mvllm.env import describe
from mvllm.profile.run import decode_steps


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def cpu_load(model: str, threads: int, busy, stop) -> None:
    llm = LLM(model, device="cpu", threads=threads, max_active=4)
    vocab = llm.engine.source.config.vocab_size - 1
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (516,), generator=g).tolist() for _ in range(4)]
    engine, steps = llm.engine, 0
    while not stop.is_set():
        for p in prompts:
            engine.add_request(p, greedy(64))
        while engine.has_unfinished() and not stop.is_set():
            engine.step()
            steps += 1
            busy.set()


def decode_ms(llm: LLM, batch: int, steps: int = 30) -> float:
    vocab = llm.engine.source.config.vocab_size - 1
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, vocab, (560,), generator=g).tolist() for _ in range(batch)]
    return 1000 * statistics.median(decode_steps(llm.engine, prompts, greedy(steps + 2))[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="synthetic:qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()
    gpu = LLM(args.model, device="cuda", max_active=16)
    batches = (1, 4, 16)
    out = {"command": "python3 " + " ".join(sys.argv), "environment": describe(),
           "model": args.model, "cpu_threads": args.threads, "cpu_count": mp.cpu_count(),
           "gpu_compiled": gpu.engine.runner.compiled, "phases": {}}
    for b in batches:  # first steps of each size pay one-time costs
        decode_ms(gpu, b, 4)
    out["phases"]["idle"] = {b: decode_ms(gpu, b) for b in batches}
    ctx = mp.get_context("spawn")
    busy, stop = ctx.Event(), ctx.Event()
    worker = ctx.Process(target=cpu_load, args=(args.model, args.threads, busy, stop), daemon=True)
    worker.start()
    if not busy.wait(300):
        raise SystemExit("the CPU backend did not start decoding")
    out["phases"]["cpu_busy"] = {b: decode_ms(gpu, b) for b in batches}
    stop.set()
    worker.join(30)
    out["phases"]["idle_again"] = {b: decode_ms(gpu, b) for b in batches}
    for phase, ms in out["phases"].items():
        print(f"{phase:11} " + "  ".join(f"b{b} {v:.3f} ms" for b, v in ms.items()), flush=True)
    idle = {b: (out["phases"]["idle"][b] + out["phases"]["idle_again"][b]) / 2 for b in batches}
    out["busy_over_idle"] = {b: out["phases"]["cpu_busy"][b] / idle[b] for b in batches}
    print("busy / idle: " + "  ".join(f"b{b} {v:.3f}" for b, v in out["busy_over_idle"].items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
