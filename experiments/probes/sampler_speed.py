"""The batched sampler against the per-row one it replaced, in the same run.

    .venv/bin/python experiments/probes/sampler_speed.py [--out results/profile/dev2core-sampler.json]

Times `mvllm.engine.sampler.sample` and `before` (the sampler as it was at commit 0c406b7: a loop over the
batch, one softmax, one sort for top-p and one `torch.multinomial` with a host sync per non-greedy row),
batches 1 / 4 / 16, for greedy requests, OpenAI's default (temperature 1) and temperature 0.8 with top-p
0.95, on two kinds of logits: SmolLM2's own over the evaluation text (vocabulary 49,152), and random normal
ones of Qwen2.5's vocabulary (151,936), whose flat tail puts top-p 0.95 beyond the 1,024 candidates (the
sampler's fallback, a sort of the whole row). Then whole engine steps of SmolLM2 at batch 4, temperature 1
with and without top-p 0.95, with each sampler. Medians; the ratio is before / now. On CUDA where present,
else the CPU.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mvllm.engine import model_runner  # noqa: E402
from mvllm.engine.params import SamplingParams  # noqa: E402
from mvllm.engine.sampler import sample  # noqa: E402
from mvllm.engine.sequence import Sequence  # noqa: E402
from mvllm.profile.run import decode_steps  # noqa: E402


def before(logits: torch.Tensor, seqs: list[Sequence], argmax: torch.Tensor | None = None) -> torch.Tensor:
    """The per-row sampler of commit 0c406b7 (min_tokens masking left out: no request here uses it; `argmax`,
    which the engine now passes, ignored; the ids returned as a tensor, as the engine now takes them)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if 0 < p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = row.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs > p.top_p
            row = row.scatter(0, order[drop], float("-inf"))
        if seq.generator is None:
            seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            seq.generator = torch.Generator(device=logits.device).manual_seed(seed)
        tokens[i] = int(torch.multinomial(row.softmax(-1), 1, generator=seq.generator))
    return torch.tensor(tokens)


def timed(fn, logits, seqs, repeats: int) -> float:
    """Median ms of fn, up to its token ids on the host."""
    fn(logits, seqs).tolist()
    out = []
    for _ in range(repeats):
        if logits.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(logits, seqs).tolist()
        out.append(time.perf_counter() - t)
    return 1000 * statistics.median(out)


def engine_steps(engine, sampler, top_p: float, steps: int = 40) -> float:
    """Median ms of a decode step of 4 requests at temperature 1 (seeded), with `sampler` in the engine."""
    model_runner.sample = sampler
    try:
        prompts = [list(range(100 + i, 400 + i)) for i in range(4)]
        params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, seed=0, top_p=top_p)
        return 1000 * statistics.median(decode_steps(engine, prompts, params)[1])
    finally:
        model_runner.sample = sample


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = {"greedy": dict(temperature=0.0), "temperature 1": dict(temperature=1.0),
             "temperature 0.8, top-p 0.95": dict(temperature=0.8, top_p=0.95)}
    from mvllm import LLM
    from mvllm.profile.accuracy import eval_tokens
    from mvllm.profile.accuracy import logits as text_logits

    llm = LLM("smollm2-135m", device="cpu", dtype="float32")
    real = text_logits(llm.engine.model, eval_tokens(llm.engine.source)[:200], torch.device("cpu"), torch.float32)
    del llm
    rows = []
    for kind, vocab in (("SmolLM2 logits", 49152), ("random normal", 151936)):
        for batch in (1, 4, 16):
            if kind == "random normal":
                logits = torch.randn(batch, vocab, device=device) * 3
            else:
                logits = real[100:100 + batch].to(device)
            for name, kw in cases.items():
                seqs = [Sequence([1], SamplingParams(seed=i, **kw)) for i in range(batch)]
                old, new = timed(before, logits, seqs, args.repeats), timed(sample, logits, seqs, args.repeats)
                rows.append({"logits": kind, "vocab": vocab, "batch": batch, "params": name, "before_ms": old,
                             "now_ms": new, "ratio": old / new})
                print(f"{kind:14} {vocab:6}  batch {batch:2}  {name:28} before {old:7.3f} ms  now {new:7.3f} ms  "
                      f"{old / new:5.2f}x")
    engine, steps = LLM("smollm2-135m", device=device.type, max_active=4).engine, {}
    engine_steps(engine, sample, 1.0, 4)  # first steps pay one-time costs
    for top_p in (1.0, 0.95):
        for label, fn in (("before", before), ("now", sample), ("before again", before)):
            key = f"top_p {top_p}, {label}"
            steps[key] = engine_steps(engine, fn, top_p)
            print(f"SmolLM2 engine step, batch 4, temperature 1, top-p {top_p}, sampler {label}: "
                  f"{steps[key]:.2f} ms")
    out = {"command": "python experiments/probes/sampler_speed.py" + (f" --out {args.out}" if args.out else ""),
           "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip(),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({os.cpu_count()} cores, "
           f"{torch.get_num_threads()} threads)", "torch": torch.__version__, "samplers": rows,
           "engine_step_ms": steps}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
