"""int8w's kernel at two group sizes, same process: each of Qwen2.5-0.5B's linear shapes (random weights, packed for
this machine's layout) at a few row counts, the groups alternated --rounds times, each one's median call and the
ratio to the first group's. Weights of --copies copies a shape cycled through, so they come from memory as in a step.

    python experiments/group_speed.py [--threads 8] [--rows 1,20] [--groups 32,64] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mvllm.kernels import cpu_int8

SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864)}


def weights(out: int, inputs: int, group: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    made = []
    for _ in range(copies):
        q, s = cpu_int8.quantize_weight(torch.randn(out, inputs, generator=g) * 0.02, group)
        made.append(cpu_int8.pack(q, s) if cpu_int8.packs() else (q, s))
    return made


def timed(x: torch.Tensor, ws, calls: int) -> float:
    t = time.perf_counter()
    for i in range(calls):
        q, s = ws[i % len(ws)]
        cpu_int8.int8_linear(x, q, s, None, check=False)
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    result = {"threads": a.threads, "groups": groups, "rounds": a.rounds, "copies": a.copies,
              "build": cpu_int8.build_info(), "cells": []}
    for name, (out, inputs) in SHAPES.items():
        ws = {g: weights(out, inputs, g, a.copies) for g in groups}
        for rows in rows_list:
            x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(1))
            us = {g: [] for g in groups}
            for _ in range(a.rounds):
                for g in groups:
                    timed(x, ws[g], a.copies)
                    us[g].append(timed(x, ws[g], 4 * a.copies))
            med = {g: statistics.median(v) for g, v in us.items()}
            first = med[groups[0]]
            cols = "  ".join(f"group {g} {med[g]:8.1f} us ({med[g] / first:.3f}x)" for g in groups)
            print(f"{name:8} {out:5}x{inputs:<5} rows {rows:3}: {cols}", flush=True)
            result["cells"].append({"shape": name, "out": out, "in": inputs, "rows": rows, "us": us, "median_us": med})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
