"""mvllm::linear (model/triton_ops.py) against what it replaces, on the GPU, in the same run.

For the QKV, O and down projections of a model's decode step and a few row counts: the microseconds of one call
inside a CUDA graph that runs it over one weight copy per layer (so the weights come from memory, not the L2
cache, as in a real step), for
- `ops`: cuBLAS and the residual add (two kernels; QKV: cuBLAS alone),
- `cublas`: F.linear alone,
- `kernel`: linear's Triton kernel with its default blocks and split, and (at 4 rows) each candidate,
  each checked against the reference after its graph replays (the split-K sum under real concurrency).
    python3 experiments/probes/small_linear_speed.py --out results/small-linear.json
(The earlier version of this experiment, a kernel that also fused the norms and the SiLU into QKV and gate/up
and lost to cuBLAS there, is in commit 3451b21.)
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
import torch.nn.functional as F

from mvllm.kernels import triton_ops
from mvllm.model.presets import PRESETS

CANDIDATES = [dict(BLOCK_N=bn, BLOCK_K=bk, split=split)
              for bn, bk, split in itertools.product((16, 32, 64), (64, 128), (1, 2, 4, 8))]


def shapes(model: str) -> tuple[dict, int]:
    """name -> (n, k, with a residual) for the projections mvllm::linear serves."""
    cfg = PRESETS[model]
    h, i, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    qkv = (heads + 2 * cfg["num_key_value_heads"]) * (h // heads)
    return dict(qkv=(qkv, h, False), o=(h, h, True), down=(h, i, True)), cfg["num_hidden_layers"]


def timed(fn, weights: list[torch.Tensor], repeats: int = 20) -> float:
    """Microseconds per call fn(weight): a CUDA graph of one call per layer's weight, replayed."""
    layers = len(weights)
    for w in weights:
        fn(w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(w)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / repeats / layers)
    return round(best, 2)


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="synthetic:qwen2.5-0.5b,synthetic:smollm2-135m")
    ap.add_argument("--rows", default="1,4,16,32,64")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    out = dict(device=torch.cuda.get_device_name(), rows={}, candidates={})
    for model in args.models.split(","):
        model = model.removeprefix("synthetic:")
        table, layers = shapes(model)
        for name, (n, k, add) in table.items():
            w = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(layers)]
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k, device=dev, dtype=dt)
                r = torch.randn(rows, n, device=dev, dtype=dt) if add else None
                want = triton_ops.reference_linear(x, w[0], None, r)
                kernel = partial(triton_ops._triton_linear, x, bias=None, residual=r)
                err = error(kernel(w[0]), want)
                assert err < 2e-2, (model, name, rows, err)
                row = dict(ops=timed(partial(triton_ops.reference_linear, x, bias=None, residual=r), w),
                           cublas=timed(partial(F.linear, x), w), kernel=timed(kernel, w),
                           mb=round(n * k * 2 / 1e6, 2), max_rel_err=round(err, 5))
                row["tb_s"] = round(row["mb"] / row["kernel"], 2)
                out["rows"][f"{model}/{name}/{rows}"] = row
                print(f"{model:14s} {name:5s} rows {rows:3d}: ops {row['ops']:6.2f} µs  cublas {row['cublas']:6.2f}"
                      f"  kernel {row['kernel']:6.2f} ({row['tb_s']} TB/s)  ops/kernel "
                      f"{row['ops'] / row['kernel']:.2f}x", flush=True)
                if rows != 4:
                    continue
                times = {}
                for cand in CANDIDATES:
                    key = "n{BLOCK_N}k{BLOCK_K}s{split}".format(**cand)
                    times[key] = timed(partial(kernel, **cand), w)
                    err = error(kernel(w[0], **cand), want)
                    assert err < 2e-2, (model, name, key, err)
                best = min(times, key=times.get)
                out["candidates"][f"{model}/{name}"] = times
                default = "n{BLOCK_N}k{BLOCK_K}s{split}".format(**triton_ops.config(4, n, k))
                print(f"    best of {len(times)}: {best} {times[best]} µs (default {default}: "
                      f"{times.get(default)})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
