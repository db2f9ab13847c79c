"""What a step's token budget (max_step_tokens) trades on one backend: a long prompt's time to its first token
against the worst gap it puts between the tokens of requests already decoding.

    python3 experiments/probes/step_budget.py [--model M] [--device cpu] [--budgets 32,64,...] [--prompt 1024]
        [--decodes 4] [--out FILE.json]

For each budget: D requests decode (prompts of 64 tokens) until each has made 8 tokens, then one cold prompt of
P tokens arrives. It reports the prompt's time from arrival to its first token (every chunk of it), the decodes'
worst and median gap between tokens while it is prefilled, and their median gap before it came (the decode
cadence). The budget's default on a device is the smallest whose TTFT is within 10% of the whole prompt's (the
largest budget here): chunks that small cost the prompt little, and every decode waits at most one of them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rich.console import Console
from rich.table import Table

from mvllm import SamplingParams
from mvllm.engine.engine import Engine, EngineConfig
from mvllm.env import describe


def one(model: str, device: str, budget: int, prompt_len: int, decodes: int, threads: int | None) -> dict:
    eng = Engine(EngineConfig(model, device=device, max_active=decodes + 1, max_step_tokens=budget,
                              threads=threads, num_blocks=(prompt_len + 64 * decodes + 2048) // 16))
    vocab = eng.source.config.vocab_size
    params = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    running = [eng.add_request([(7 * i + j) % vocab for j in range(64)], params) for i in range(decodes)]
    stamps: dict[str, list[float]] = {s.request_id: [] for s in running}

    def step() -> None:
        for out in eng.step():
            if out.seq.request_id in stamps:
                stamps[out.seq.request_id].append(time.perf_counter())

    while min(s.num_output_tokens for s in running) < 8:
        step()
    before = {rid: len(s) for rid, s in stamps.items()}
    long = eng.add_request([(13 * j + 5) % vocab for j in range(prompt_len)], SamplingParams(max_tokens=1))
    t0 = time.perf_counter()
    steps = 0
    while long.num_output_tokens == 0:
        step()
        steps += 1
    ttft = time.perf_counter() - t0
    cadence = statistics.median(b - a for rid, s in stamps.items() for a, b in zip(s[:before[rid] - 1], s[1:before[rid]]))
    during = [b - a for rid, s in stamps.items() for a, b in zip(s[before[rid] - 1:], s[before[rid]:])]
    for s in running:
        eng.abort(s.request_id)
    return {"budget": budget, "steps": steps, "ttft_s": ttft, "cadence_ms": cadence * 1e3,
            "worst_gap_ms": max(during) * 1e3, "median_gap_ms": statistics.median(during) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="synthetic:qwen2.5-0.5b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budgets", default="32,64,128,256,512,2048")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--decodes", type=int, default=4)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out")
    a = ap.parse_args()
    console = Console()
    rows = []
    for budget in (int(b) for b in a.budgets.split(",")):
        with console.status(f"budget {budget}"):
            rows.append(one(a.model, a.device, budget, a.prompt, a.decodes, a.threads))
    whole = rows[-1]["ttft_s"]
    table = Table(title=f"{a.prompt}-token prompt beside {a.decodes} decodes, {a.model} on {a.device}")
    for col in ("budget", "steps", "TTFT s", "x whole", "cadence ms", "worst gap ms", "median gap ms"):
        table.add_column(col, justify="right")
    for r in rows:
        r["ttft_vs_whole"] = r["ttft_s"] / whole
        table.add_row(str(r["budget"]), str(r["steps"]), f"{r['ttft_s']:.2f}", f"{r['ttft_vs_whole']:.2f}",
                      f"{r['cadence_ms']:.1f}", f"{r['worst_gap_ms']:.0f}", f"{r['median_gap_ms']:.0f}")
    console.print(table)
    pick = next(r["budget"] for r in rows if r["ttft_vs_whole"] <= 1.10)
    console.print(f"smallest budget within 10% of the whole prompt's TTFT: {pick}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"env": describe(), "args": vars(a), "rows": rows, "pick": pick}, f, indent=1)


if __name__ == "__main__":
    main()
