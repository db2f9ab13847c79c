"""The CPU engine's default model under one tree's kernels, for an old-against-new check of a change that must keep
every default: greedy tokens of three fixed prompts (64 new tokens each, alone), the median decode step at batch 1
and batch 8, and the median cold prefill of a 512-token prompt, as one JSON object. Run it once per tree, the
same host, no MVLLM_* variable set, and compare the two: the tokens equal, the times within the host's noise.

    PYTHONPATH=.old/pre-knobs python experiments/probes/knob_check.py > old.json   # an older tree's mvllm/
    PYTHONPATH=. python experiments/probes/knob_check.py > new.json
        [--threads N] [--steps 30] [--repeats 5] [--model synthetic:smollm2-135m]

(An older tree: `git archive COMMIT mvllm | tar -x -C .old/pre-knobs`; .old/ is git-ignored.) The kernels build on
first use for each tree, cached apart by their source. --model: another model spec; one without a tokenizer (a
synthetic preset: random weights of the real shapes) takes each prompt's bytes as its token ids.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch

import mvllm
from mvllm.engine.engine import Engine, EngineConfig
from mvllm.engine.params import SamplingParams
from mvllm.kernels import cpu_int8
from mvllm.model.loader import load_tokenizer
from mvllm.model.presets import DEFAULT_MODEL
from mvllm.model.tokenizer import Tokenizer

PROMPTS = ["The capital of France is", "Write a short poem about the sea.",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\""]


def run_all(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()


def greedy(engine: Engine, ids: list[int], tokens: int = 64) -> list[int]:
    seq = engine.add_request(ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    run_all(engine)
    return seq.output_ids


def decode_ms(engine: Engine, batch: int, steps: int) -> float:
    """Median ms of a decode step of `batch` sequences (16-token prompts, prefilled first)."""
    gen = random.Random(batch)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    seqs = [engine.add_request([gen.randrange(100, 40000) for _ in range(16)], params) for _ in range(batch)]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()  # the prefills
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    run_all(engine)
    return 1000 * statistics.median(times)


def prefill_ms(engine: Engine, repeats: int, length: int = 512) -> float:
    """Median ms of the step that prefills a fresh `length`-token prompt (no cached prefix)."""
    times = []
    for r in range(repeats):
        engine.reset_prefix_cache()
        gen = random.Random(1000 + r)
        engine.add_request([gen.randrange(100, 40000) for _ in range(length)], SamplingParams(max_tokens=1))
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        run_all(engine)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--steps", type=int, default=30, help="decode steps timed at each batch size")
    ap.add_argument("--repeats", type=int, default=5, help="prefills timed")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    a = ap.parse_args()
    start = time.perf_counter()
    engine = Engine(EngineConfig(model=a.model, device="cpu", threads=a.threads, max_active=8))
    if engine.source.synthetic:
        prompts = [[100 + b for b in p.encode()] for p in PROMPTS]
    else:
        prompts = [Tokenizer(load_tokenizer(engine.source), a.model).encode(p) for p in PROMPTS]
    greedy(engine, prompts[0], 8)  # warm-up: the kernels built and loaded, the first steps' allocations made
    out = {"mvllm": mvllm.__file__, "model": a.model, "quant": engine.config.quant,
           "threads": torch.get_num_threads(), "int8_path": cpu_int8.build_info().get("path"), "amx": cpu_int8.amx()}
    out["tokens"] = [greedy(engine, ids) for ids in prompts]
    out["decode_ms"] = {str(b): round(decode_ms(engine, b, a.steps), 3) for b in (1, 8)}
    out["prefill_512_ms"] = round(prefill_ms(engine, a.repeats), 2)
    out["seconds"] = round(time.perf_counter() - start, 1)
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
