"""The int8w kernel (mvllm/kernels/cpu_int8.py) against float32 F.linear on this CPU, in the same run: one
decode step's linears of a model (every layer its own weights, so they stream from memory as in a real step),
at 1 and 4 rows, the milliseconds of each and their ratio. --paths lanes,float4,int16 runs the kernel's paths
(MVLLM_INT8_PATH, read once per process) one process each, in the same call, and prints each against the
first; a path named twice (lanes,float4,lanes) alternates them. Knobs follow the name: float4:2 sets
MVLLM_INT8_AHEAD=2, lanes:tiles=2:prefetch=512 sets MVLLM_INT8_TILES=2 and MVLLM_INT8_PREFETCH=512; a key that starts
with OMP_ or GOMP_ is set as it is (lanes:OMP_PROC_BIND=spread:OMP_PLACES=cores pins the OpenMP threads).

    python experiments/probes/cpu_int8_speed.py [--model synthetic:qwen2.5-0.5b] [--rows 1,4] [--threads N]
        [--paths lanes,float4,int16] [--gemm] [--memory plain,huge] [--knobs chunks=0,chunks=8] [--layers 1]
        [--shapes] [--out FILE]

--layers 1 gives every layer the first layer's weights (one layer's 15 MB for qwen2.5-0.5b, a thread's share of it
in its L2 at 8 or more threads): the kernel's time with its weights mostly in cache, against the default, where they
stream from memory. At 20 rows against 1 row, it tells the float steps' cost from the weights' reading.

--memory plain,huge,plain packs the weights once per name (huge: cpu_int8.huge_empty's 2 MB pages; plain: 4 KB
pages) and times the copies in turn, a step each, --repeats times, in one process: each copy's median against the
first's, with the host's drift shared.

--knobs chunks=0,chunks=8:stage=0,chunks=8 times settings of the kernel's knobs in turn, in one process
(cpu_int8.knob: chunks, the chunks per thread each thread claims in turn, 0 one even range each; stage, the next
block's weights into L2 during a call's passes over a block; amx_above, the rows above which calls take AMX tiles;
bands, 1: a call's rows cut into bands the threads claim apart, 0: a chunk's rows all with the thread claiming it).

--shapes times each linear shape of a layer alone, the same weights call after call (in cache after the first), the
median of --repeats runs of 50 calls at each of --rows: microseconds a call and GMAC/s (a kernel's compute rate, with MVLLM_INT8_AMX=0 the VNNI
blocks').

--gemm also times the GEMM Int8Linear takes above its kernel rows (oneDNN bf16 on a de-quantized copy where
this CPU has native bf16, else float32), at the same rows: where the kernel could take over (warm prefill).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from mvllm import machine
from mvllm.engine import quant
from mvllm.kernels import cpu_int8
from mvllm.model.presets import PRESETS


def shapes(model: str) -> tuple[list[tuple[int, int]], int, int]:
    cfg = PRESETS[model.removeprefix("synthetic:")]
    h, i, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    qkv = (heads + 2 * cfg["num_key_value_heads"]) * (h // heads)
    return [(qkv, h), (h, h), (2 * i, h), (h, i)], cfg["num_hidden_layers"], cfg["vocab_size"]


class Wide:
    """quant.Int8Linear's GEMM above its kernel_rows: activations cast to its dtype, float32 out."""

    def __init__(self, gemm, dtype):
        self.gemm, self.dtype, self.in_features = gemm, dtype, gemm.in_features

    def __call__(self, x):
        return self.gemm(x.to(self.dtype)).float()


def random_weights(model: str, distinct: int = 0) -> list[torch.Tensor]:
    """Every linear of a decode step of `model`'s shapes, each layer its own (or the first `distinct` layers' over
    and over), and the LM head: float32, seed 0."""
    layer, layers, vocab = shapes(model)
    torch.manual_seed(0)
    own = [[torch.randn(o, i) * 0.02 for o, i in layer] for _ in range(min(distinct or layers, layers))]
    return [w for k in range(layers) for w in own[k % len(own)]] + [torch.randn(vocab, layer[1][1]) * 0.02]


def packed_weights(weights: list[torch.Tensor], packs: bool, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each weight quantized (and packed in the kernel's layout where `packs`) once per distinct tensor: with
    --layers 1 the layers share one packed copy, as they share the float one."""
    done = {}
    for w in weights:
        if id(w) not in done:
            q, s = cpu_int8.quantize_weight(w)
            done[id(w)] = cpu_int8.pack(q, s, **kw) if packs else (q, s)
    return [done[id(w)] for w in weights]


def write_out(path: str | None, obj) -> None:
    """obj as indented JSON to path (nothing without one)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=2, default=str)
            f.write("\n")


def step_ms(fns, repeats: int) -> float:
    for f in fns:  # warm
        f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for f in fns:
            f()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:qwen2.5-0.5b")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--gemm", action="store_true",
                    help="also time the GEMM int8w runs above its kernel rows (bf16 where native)")
    ap.add_argument("--paths", help="kernel paths to compare, one process each (MVLLM_INT8_PATH)")
    ap.add_argument("--memory", help="copies of the packed weights to time in turn: plain,huge,... (lanes layouts)")
    ap.add_argument("--knobs", help="kernel knob settings to time in turn: chunks=0,chunks=8:stage=0,...")
    ap.add_argument("--layers", type=int, default=0,
                    help="distinct layers of weights, repeated over the model's (1: one layer's, mostly in cache)")
    ap.add_argument("--shapes", action="store_true", help="each layer shape alone, in cache: us a call, GMAC/s")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.shapes:
        return each_shape(a)
    if a.knobs:
        return knobs(a)
    if a.paths:
        return compare(a)
    if a.memory:
        return memory(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    if not cpu_int8.available():
        raise SystemExit(f"the int8 kernel did not build: {cpu_int8.why_unavailable}")
    weights = random_weights(a.model, a.layers)
    gemms = []
    if a.gemm:
        wide = torch.bfloat16 if quant.packable(quant.CPU, torch.bfloat16) else torch.float32
        gemms = [Wide(quant.dense(cpu_int8.dequantize(*cpu_int8.quantize_weight(w)).to(wide), None), wide)
                 for w in weights]
    packed = packed_weights(weights, cpu_int8.packs())  # the lanes path: weights in its layout, as Int8Linear packs
    nbytes = sum(q.numel() + s.numel() * s.element_size() for q, s in packed)
    rows_out = []
    for rows in [int(r) for r in a.rows.split(",")]:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        f32 = [lambda w=w, xs=xs: F.linear(xs[w.shape[1]], w) for w in weights]
        i8 = [lambda q=q, s=s, w=w, xs=xs: cpu_int8.int8_linear(xs[w.shape[1]], q, s, check=False)
              for (q, s), w in zip(packed, weights)]
        t32, t8 = step_ms(f32, a.repeats), step_ms(i8, a.repeats)
        row = {"rows": rows, "float32_ms": round(t32, 3), "int8w_ms": round(t8, 3),
               "float32_over_int8w": round(t32 / t8, 2), "int8w_GB_s": round(nbytes / t8 / 1e6, 1)}
        if gemms:  # what Int8Linear runs above its kernel_rows
            row["gemm_ms"] = round(step_ms([lambda g=g, xs=xs: g(xs[g.in_features]) for g in gemms], a.repeats), 3)
            row["gemm_over_int8w"] = round(row["gemm_ms"] / t8, 2)
        rows_out.append(row)
        print(f"rows {rows}: float32 {t32:.2f} ms, int8w {t8:.2f} ms ({row['int8w_GB_s']} GB/s) a step's linears: "
              f"int8w {t32 / t8:.2f}x" + (f"; GEMM {row['gemm_ms']:.2f} ms ({row['gemm_over_int8w']}x)" if gemms else ""))
    info = {"model": a.model, "threads": torch.get_num_threads(), "avx512": machine.avx512(),
            "path": cpu_int8.build_info().get("path"),
            "build": cpu_int8.build_info(), "rows": rows_out}
    write_out(a.out, info)


def memory(a) -> None:
    """The same packed weights in plain and huge-page memory, a step of each in turn (one process)."""
    if a.threads:
        torch.set_num_threads(a.threads)
    if not cpu_int8.packs():
        raise SystemExit("--memory: the kernel here packs no lanes layout")
    weights = random_weights(a.model, a.layers)
    names = a.memory.split(",")
    if set(names) - {"plain", "huge"}:
        raise SystemExit(f"--memory: plain or huge, got {a.memory}")
    copies = [packed_weights(weights, True, huge=name == "huge") for name in names]
    huge_kb = int(open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0])
    out = {"model": a.model, "threads": torch.get_num_threads(), "path": cpu_int8.build_info().get("path"),
           "memory": names, "anon_huge_kb": huge_kb, "rows": []}
    for rows in [int(r) for r in a.rows.split(",")]:
        xs = [torch.randn(rows, w.shape[1]) for w in weights]
        steps = [[lambda q=q, s=s, x=x: cpu_int8.int8_linear(x, q, s, check=False) for (q, s), x in zip(c, xs)]
                 for c in copies]
        out["rows"].append(in_turn(rows, names, steps, [lambda: None] * len(names), a.repeats))
        print(f"  {huge_kb // 1024} MB in huge pages")
    write_out(a.out, out)


def each_shape(a) -> None:
    """Each linear shape of a layer alone, its packed weights in cache, at each row count: us a call, GMAC/s."""
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    out = {"model": a.model, "threads": torch.get_num_threads(), "path": cpu_int8.build_info().get("path"), "shapes": []}
    if not cpu_int8.available():
        raise SystemExit(f"the int8 kernel did not build: {cpu_int8.why_unavailable}")
    for o, i in shapes(a.model)[0]:
        q, s = packed_weights([torch.randn(o, i) * 0.02], cpu_int8.packs())[0]
        cells = []
        for rows in [int(r) for r in a.rows.split(",")]:
            x = torch.randn(rows, i)
            calls = 50
            us = step_ms([functools.partial(cpu_int8.int8_linear, x, q, s, check=False)] * calls, a.repeats) * 1000 / calls
            cells.append({"rows": rows, "us": round(us, 1), "GMAC_s": round(rows * o * i / us / 1e3, 1)})
        out["shapes"].append({"out": o, "in": i, "cells": cells})
        print(f"{o}x{i}: " + ", ".join(f"{c['rows']} rows {c['us']:.0f} us {c['GMAC_s']:.0f} GMAC/s" for c in cells),
              flush=True)
    write_out(a.out, out)


def in_turn(rows: int, names: list[str], steps: list[list], setups: list, repeats: int) -> dict:
    """Each variant's step (after its setup) in turn, repeats + 1 rounds (the first warms): medians, each against
    the first variant's, and in how many rounds the last beat the first. Prints a line."""
    times = [[] for _ in steps]
    for _ in range(repeats + 1):
        for fns, setup, ts in zip(steps, setups, times):
            setup()
            t = time.perf_counter()
            for f in fns:
                f()
            ts.append(time.perf_counter() - t)
    ms = [1000 * statistics.median(ts[1:]) for ts in times]
    wins = sum(b < a_ for a_, b in zip(times[0][1:], times[-1][1:]))
    print(f"rows {rows}: " + ", ".join(f"{n} {m:.2f} ms ({m / ms[0]:.2f}x)" for n, m in zip(names, ms)) +
          f"; {names[-1]} faster than {names[0]} in {wins} of {repeats} rounds", flush=True)
    return {"rows": rows, "ms": [round(m, 3) for m in ms], "over_first": [round(m / ms[0], 3) for m in ms],
            "last_faster_rounds": wins, "rounds": repeats}


def knobs(a) -> None:
    """The same packed weights under several settings of the kernel's knobs (cpu_int8.knob: chunks=8:stage=1), a
    step of each in turn (one process)."""
    if a.threads:
        torch.set_num_threads(a.threads)
    if not cpu_int8.available():
        raise SystemExit(f"the int8 kernel did not build: {cpu_int8.why_unavailable}")
    names = a.knobs.split(",")
    settings = [[(k, int(v)) for k, _, v in (item.partition("=") for item in name.split(":"))] for name in names]
    weights = random_weights(a.model, a.layers)
    packed = packed_weights(weights, cpu_int8.packs())
    out = {"model": a.model, "threads": torch.get_num_threads(), "path": cpu_int8.build_info().get("path"),
           "knobs": names, "rows": []}
    for rows in [int(r) for r in a.rows.split(",")]:
        xs = [torch.randn(rows, w.shape[1]) for w in weights]
        fns = [lambda q=q, s=s, x=x: cpu_int8.int8_linear(x, q, s, check=False) for (q, s), x in zip(packed, xs)]
        setups = [lambda kv=kv: [cpu_int8.knob(k, v) for k, v in kv] for kv in settings]
        out["rows"].append(in_turn(rows, names, [fns] * len(names), setups, a.repeats))
    write_out(a.out, out)


def compare(a) -> None:
    """Each path in a process of its own, one after the other; every path's ms against the first path's."""
    runs = {}
    for i, path in enumerate(a.paths.split(",")):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = [sys.executable, __file__, "--model", a.model, "--rows", a.rows, "--repeats", str(a.repeats),
                   "--out", f.name, "--layers", str(a.layers)] + (["--threads", str(a.threads)] if a.threads else []) + \
                  (["--gemm"] if a.gemm else [])
            name, *knobs = path.split(":")  # float4:2 = float4:ahead=2; lanes:tiles=2:prefetch=1024
            extra = {"MVLLM_INT8_PATH": name}
            for knob in knobs:
                key, _, value = knob.rpartition("=")
                key = (key or "ahead").upper()
                extra[key if key.startswith(("OMP_", "GOMP_")) else f"MVLLM_INT8_{key}"] = value
            env = {**os.environ, **extra}
            print(" ".join(f"{k}={v}" for k, v in extra.items()) + ":", flush=True)
            subprocess.run(cmd, check=True, env=env)
            runs[path if path not in runs else f"{path}#{i + 1}"] = json.load(open(f.name))  # lanes,float4,lanes
    first = next(iter(runs))
    for path, run in runs.items():
        for row, base in zip(run["rows"], runs[first]["rows"]):
            row[f"over_{first}"] = round(row["int8w_ms"] / base["int8w_ms"], 3)
            print(f"rows {row['rows']}: {path} ({run['path']}) {row['int8w_ms']:.2f} ms, "
                  f"{row[f'over_{first}']:.2f}x {first}'s" + (f"; GEMM {row['gemm_ms']:.2f} ms" if "gemm_ms" in row else ""))
    write_out(a.out, {"paths": runs})


if __name__ == "__main__":
    main()
