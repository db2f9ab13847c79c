"""The tiled attention kernel's launch settings swept on one GPU, against torch's SDPA on the same prompts.

    python3 experiments/probes/tiled_sweep.py [--out FILE.json] [--budget-s 240] [--lengths 2048,10000,20000]
    TRITON_INTERPRET=1 python3 experiments/probes/tiled_sweep.py --device cpu --lengths 96 --chunk 40   # smoke

One layer of Qwen2.5-0.5B's attention (14 query heads over 2 KV heads, head dim 64, bf16) for a cold prompt of
each length, cut into chunks of the step budget (--chunk, 8,192) as the engine runs it: each chunk's rows attend
through the paged cache (blocks of 16, shuffled) to every key before them, its input packed before the timing.
For each setting (rows a tile holds, 8 a token: the group's 7 heads padded; keys a loop step; warps; pipeline
stages) the kernel's time summed over the chunks (median of --repeats, CUDA events), checked against the default
setting's output. Beside it, in the same run, SDPA on the whole prompt (causal, GQA; cuDNN and flash, the
faster; prefill_floor.py's own timing): the floor the engine is measured against. The sweep times the
longest length first, stops at --budget-s, then times the best few settings at every length.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from types import SimpleNamespace

import torch
from prefill_floor import sdpa_ms, timed  # this folder: the same timing and SDPA as the engine's floor

from mvllm.kernels import triton_attention as ta

HEADS, KV_HEADS, D, BLOCK = 14, 2, 64, 16


def settings() -> list[dict]:
    """The default first, then the grid."""
    base = {"rows": 128, **{k: ta.TILED[k] for k in ("block_n", "num_warps", "num_stages")}}
    grid = [{"rows": r, "block_n": n, "num_warps": w, "num_stages": s}
            for r, n, (w, s) in itertools.product((128, 64, 256), (128, 64, 256),
                                                  ((4, 2), (4, 3), (8, 2), (8, 3), (4, 4), (8, 1)))]
    return [base] + [g for g in grid if g != base]


def apply(setting: dict) -> None:
    ta.set_tiled(setting, HEADS // KV_HEADS)


def chunks_of(n: int, chunk: int, device: str, gen: torch.Generator):
    """The chunks of an n-token prompt: (q, packed, tables) each, over one shared cache."""
    blocks = -(-n // BLOCK)
    table = torch.randperm(blocks, generator=gen).to(device).view(1, blocks)
    out = []
    for start in range(0, n, chunk):
        c = min(chunk, n - start)
        positions = torch.arange(start, start + c, device=device)
        slots = table[0, positions // BLOCK] * BLOCK + positions % BLOCK
        q = torch.randn(c, HEADS, D, generator=gen).to(device, DTYPE)
        out.append((q, positions, slots, c, table))
    return out


def packed_chunks(chunks) -> list[tuple]:
    """Each chunk's input packed for the current setting (its tiles depend on TILE), outside the timing."""
    return [(q, ta.pack_rows(positions, slots, positions + 1, torch.zeros_like(positions), [c]), table)
            for q, positions, slots, c, table in chunks]


def run_chunks(packed, cache) -> list[torch.Tensor]:
    return [ta._triton(q, cache, p, table, BLOCK, D ** -0.5) for q, p, table in packed]


def timed_ms(fn, repeats: int) -> float:
    """prefill_floor.timed on the GPU (CUDA events); under the CPU's interpreter one wall-clock run."""
    if DEVICE == "cuda":
        return timed(fn, repeats)
    fn()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    global DEVICE, DTYPE
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="2048,10000,20000")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--best", type=int, default=4, help="settings timed at every length")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    a = ap.parse_args()
    DEVICE = a.device
    DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    if DEVICE == "cuda" and not torch.cuda.is_available():
        sys.exit("tiled_sweep: needs a CUDA GPU (or --device cpu under TRITON_INTERPRET=1)")
    torch.set_grad_enabled(False)
    lengths = sorted(int(x) for x in a.lengths.split(","))
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, (-(-max(lengths) // BLOCK)) * BLOCK, KV_HEADS, D, generator=gen).to(DEVICE, DTYPE)
    cases = {n: chunks_of(n, a.chunk, DEVICE, gen) for n in lengths}
    out = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "triton": ta.jit().triton.__version__ if ta.HAS_TRITON else None, "chunk": a.chunk,
           "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
           "git_commit": os.environ.get("MVLLM_GIT_COMMIT"), "sdpa_ms": {}, "sweep": [], "best": []}
    if DEVICE == "cuda":
        for n in lengths:
            out["sdpa_ms"][n] = sdpa_ms(SimpleNamespace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=D), n,
                                        DTYPE, a.repeats)
            print(f"SDPA {n}: {out['sdpa_ms'][n]}", flush=True)
    longest = max(lengths)
    reference = {}
    t0 = time.perf_counter()
    all_settings = settings()
    for i, s in enumerate(all_settings):
        if time.perf_counter() - t0 > a.budget_s:
            print(f"budget spent after {i} settings", flush=True)
            break
        apply(s)
        try:
            packed = packed_chunks(cases[longest])
            got = run_chunks(packed, cache)
            ms = timed_ms(lambda packed=packed: run_chunks(packed, cache), a.repeats)
        except Exception as e:  # a setting past the GPU's shared memory or registers
            out["sweep"].append({**s, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"})
            print(f"{s}: {out['sweep'][-1]['error']}", flush=True)
            continue
        if not reference:
            reference[longest] = got
        err = max((g.float() - r.float()).abs().max().item() for g, r in zip(got, reference[longest]))
        out["sweep"].append({**s, "ms": round(ms, 4), "max_abs_diff": err})
        print(f"{i:3d} {s}: {ms:.3f} ms, max |diff| {err:.2e}", flush=True)
    fine = [r for r in out["sweep"] if "ms" in r and r["max_abs_diff"] < (3e-2 if DTYPE == torch.bfloat16 else 1e-4)]
    fine.sort(key=lambda r: r["ms"])
    keys = ("rows", "block_n", "num_warps", "num_stages")
    picks = [{k: r[k] for k in keys} for r in fine[:a.best]]
    if all_settings[0] not in picks:
        picks.append(all_settings[0])
    for s in picks:
        apply(s)
        row = {**s, "ms": {}}
        for n in lengths:
            packed = packed_chunks(cases[n])
            row["ms"][n] = round(timed_ms(lambda packed=packed: run_chunks(packed, cache), a.repeats), 4)
        out["best"].append(row)
        print(f"{s}: {row['ms']}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


DEVICE, DTYPE = "cuda", torch.bfloat16

if __name__ == "__main__":
    main()
