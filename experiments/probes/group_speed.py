"""int8w's kernel at two group sizes, same process: each of a model's linear shapes (random weights, packed for this
machine's layout) at a few row counts, the groups alternated --rounds times, each one's median call and the ratio to
the first group's. Weights of --copies copies a shape cycled through, so they come from memory as in a step.

    python experiments/probes/group_speed.py [--model synthetic:qwen2.5-0.5b] [--threads 8] [--rows 1,20] [--groups 32,64]
        [--rounds 5] [--copies 24] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

from mvllm.kernels import cpu_int8

sys.path.insert(0, str(Path(__file__).parent))
from cpu_int8_speed import shapes, step_ms, write_out  # noqa: E402 - experiments/ is not a package

NAMES = ("qkv", "o", "gate_up", "down")  # the order of cpu_int8_speed.shapes


def weights(out: int, inputs: int, group: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    made = []
    for _ in range(copies):
        q, s = cpu_int8.quantize_weight(torch.randn(out, inputs, generator=g) * 0.02, group)
        made.append(cpu_int8.pack(q, s) if cpu_int8.packs() else (q, s))
    return made


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--rows", default="1,20")
    ap.add_argument("--groups", default="32,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copies", type=int, default=24)
    ap.add_argument("--out")
    a = ap.parse_args()
    if not cpu_int8.available():
        raise SystemExit(f"the int8 kernel did not build: {cpu_int8.why_unavailable}")
    torch.set_num_threads(a.threads)
    groups = [int(g) for g in a.groups.split(",")]
    rows_list = [int(r) for r in a.rows.split(",")]
    result = {"model": a.model, "threads": a.threads, "groups": groups, "rounds": a.rounds, "copies": a.copies,
              "build": cpu_int8.build_info(), "cells": []}
    for name, (out, inputs) in zip(NAMES, shapes(a.model)[0]):
        ws = {g: weights(out, inputs, g, a.copies) for g in groups}
        for rows in rows_list:
            x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(1))
            us = {g: [] for g in groups}
            calls = {g: [partial(cpu_int8.int8_linear, x, q, s, None, check=False) for q, s in ws[g]] for g in groups}
            for _ in range(a.rounds):
                for g in groups:  # each a warm pass over the copies, then the median of 4 passes
                    us[g].append(step_ms(calls[g], 4) * 1000 / a.copies)
            med = {g: statistics.median(v) for g, v in us.items()}
            first = med[groups[0]]
            cols = "  ".join(f"group {g} {med[g]:8.1f} us ({med[g] / first:.3f}x)" for g in groups)
            print(f"{name:8} {out:5}x{inputs:<5} rows {rows:3}: {cols}", flush=True)
            result["cells"].append({"shape": name, "out": out, "in": inputs, "rows": rows, "us": us, "median_us": med})
    write_out(a.out, result)


if __name__ == "__main__":
    main()
