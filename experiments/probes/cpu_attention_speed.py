"""The fused CPU attention (mvllm/kernels/csrc/fused.cpp) with its lanes path on and off, in one process: a step's
paged_attention at the profile's cells (Qwen2.5-0.5B's 24 layers, each its own cache, of 14 heads over 2 KV heads
of 64), alternating the settings --rounds times, each setting's best median, and the error against the torch
reference. --settings lanes=0,lanes=2 compares other settings of cpu_fused.attention_knob instead (each against
the first; its only knob is "lanes" now). The 8-wide lanes of AVX2 and NEON on an AVX-512 machine:
`python experiments/probes/march.py haswell experiments/probes/cpu_attention_speed.py ...`.

    python experiments/probes/cpu_attention_speed.py [--threads 8] [--rounds 3] [--settings lanes=0,lanes=1,lanes=2] [--cells warm,decode] [--hot]
        [--out FILE]

Cells: warm prefill (20 new after 496 cached), cold prefill of 516, four warm prefills at once, decode at 516
(batch 1 and 4: no lanes rows, so level), a 40-token prefill beside three decodes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mvllm.kernels import cpu_fused

HEADS, KV, D, BLOCK, LAYERS = 14, 2, 64, 16, 24
CELLS = {
    "warm 20 after 496": [(516, 20)],
    "cold 516": [(516, 516)],
    "4 warm prefills": [(516, 20)] * 4,
    "decode at 516": [(516, 1)],
    "decode at 516, batch 4": [(516, 1)] * 4,
    "prefill 40 beside 3 decodes": [(140, 40), (700, 1), (300, 1), (17, 1)],
}


def setup(seqs: list[tuple[int, int]]):
    """(context, new tokens) per sequence: its cache blocks shuffled, the new tokens causal at the end."""
    g = torch.Generator().manual_seed(0)
    needed = [-(-c // BLOCK) for c, _ in seqs]
    total = sum(needed)
    caches = [torch.randn(2, total * BLOCK + 1, KV, D, generator=g) for _ in range(LAYERS)]
    order = torch.randperm(total, generator=g).tolist()
    table = torch.zeros(len(seqs), max(needed), dtype=torch.long)
    start = 0
    for row, n in enumerate(needed):
        table[row, :n] = torch.tensor(order[start:start + n])
        start += n
    seq = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(seqs)])
    key_len = torch.cat([torch.arange(c - n + 1, c + 1) for c, n in seqs])
    q = torch.randn(len(seq), HEADS, D, generator=g)
    return q, caches, table, seq, key_len


def timed(q, caches, rest, reps: int) -> float:
    """A step's attention, every layer's cache in turn (so the keys come from memory, as in a step)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for cache in caches:
            cpu_fused.paged_attention(q, cache, *rest)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def apply(setting: str) -> None:
    for pair in setting.split(":"):
        name, value = pair.split("=")
        cpu_fused.attention_knob(name, int(value))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", default="lanes=0,lanes=1,lanes=2")
    ap.add_argument("--cells", help="only the cells whose names hold one of these, comma-separated (warm,decode)")
    ap.add_argument("--hot", action="store_true",
                    help="every layer the first layer's cache (in cache after the first): compute against reading")
    ap.add_argument("--out")
    a = ap.parse_args()
    if not cpu_fused.available():
        raise SystemExit(f"the fused kernels did not build: {cpu_fused.why_unavailable}")
    torch.set_num_threads(a.threads)
    settings = a.settings.split(",")
    defaults = {name: cpu_fused.attention_knob(name, 1) for name in ("lanes",)}
    for name, value in defaults.items():
        cpu_fused.attention_knob(name, value)
    rows = []
    for name, seqs in CELLS.items():
        if a.cells and not any(c in name for c in a.cells.split(",")):
            continue
        q, caches, table, seq, key_len = setup(seqs)
        if a.hot:
            caches = caches[:1] * LAYERS
        rest = (table, seq, key_len, BLOCK, D ** -0.5)
        ref = cpu_fused.reference_paged_attention(q, caches[0], *rest)
        reps = max(3, min(40, 2_000 // int(key_len.sum())))
        ms, err = {k: [] for k in settings}, {}
        for _ in range(a.rounds):
            for k in settings:
                apply(k)
                err[k] = float((cpu_fused.paged_attention(q, caches[0], *rest) - ref).abs().max())
                ms[k].append(timed(q, caches, rest, reps))
                for knob, value in defaults.items():
                    cpu_fused.attention_knob(knob, value)
        best = {k: min(v) for k, v in ms.items()}
        rows.append({"cell": name, "ms": best, "rounds": ms, "max_err": err,
                     "ratio": {k: best[k] / best[settings[0]] for k in settings}})
        cols = "  ".join(f"{k} {best[k]:7.3f} ms ({best[k] / best[settings[0]]:.2f}x)" for k in settings)
        print(f"{name:<28} a step: {cols}  (max error against torch {max(err.values()):.1e})", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"threads": a.threads, "rounds": a.rounds, "settings": settings, "defaults": defaults,
                       "flags": cpu_fused.build_info().get("flags"),
                       "build": cpu_fused.build_info(), "cells": rows}, f, indent=1)


if __name__ == "__main__":
    main()
