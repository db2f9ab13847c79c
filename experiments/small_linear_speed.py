"""The fused projection kernel of experiments/small_linear.py against cuBLAS and the eager ops it replaces, on the
GPU, in the same run.

For each projection of a model's decode step (QKV with the RMSNorm before it, O with the residual add, gate/up
with the norm and SiLU * up, down with the residual add) and a few row counts: the microseconds of one call
inside a CUDA graph that runs it over one weight copy per layer (so the weights come from memory, not the L2
cache, as in a real step), for
- `ops`: the eager ops it replaces (rms_norm, F.linear with cuBLAS, SiLU * up, the add),
- `cublas`: F.linear alone,
- `kernel`: the fused kernel with its default block sizes and split, and each candidate (rows=4), each
  checked against the reference after its graph replays (the split-K reduction under real concurrency).
    python3 experiments/small_linear_speed.py --out results/small-linear.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from mvllm.model.presets import PRESETS

sys.path.insert(0, str(Path(__file__).parent))
import small_linear  # noqa: E402 - experiments/ is not a package

CANDIDATES = [dict(BLOCK_N=bn, BLOCK_K=bk, split=split)
              for bn, bk, split in itertools.product((16, 32, 64), (64, 128), (1, 2, 4, 8))]


def shapes(model: str) -> dict:
    cfg = PRESETS[model]
    h, i, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    d = h // heads
    q = (heads + 2 * cfg["num_key_value_heads"]) * d
    return dict(qkv=(q, h, dict(norm=True, bias=cfg["model_type"] == "qwen2")), o=(h, h, dict(res=True)),
                gate_up=(2 * i, h, dict(norm=True, silu=True)), down=(h, i, dict(res=True))), \
        cfg["num_hidden_layers"]


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="synthetic:qwen2.5-0.5b,synthetic:smollm2-135m")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    out = dict(device=torch.cuda.get_device_name(), rows={}, candidates={})
    for model in args.models.split(","):
        model = model.removeprefix("synthetic:")
        table, layers = shapes(model)
        for name, (n, k, kind) in table.items():
            w = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(layers)]
            b = torch.randn(n, device=dev, dtype=dt) if kind.get("bias") else None
            g = torch.rand(k, device=dev, dtype=dt) + 0.5 if kind.get("norm") else None
            n_out = n // 2 if kind.get("silu") else n
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, k, device=dev, dtype=dt)
                r = torch.randn(rows, n_out, device=dev, dtype=dt) if kind.get("res") else None
                call = dict(bias=b, norm=g, eps=1e-6, residual=r, silu=bool(kind.get("silu")))
                want = small_linear.reference(x, w[0], **call)
                got = small_linear.triton_linear(x, w[0], **call)
                err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                assert err < 2e-2, (model, name, rows, err)
                row = dict(
                    ops=timed(partial(small_linear.reference, x, **call), w),
                    cublas=timed(partial(F.linear, x), w),
                    kernel=timed(partial(small_linear.triton_linear, x, **call), w),
                    mb=round(n * k * 2 / 1e6, 2), max_rel_err=round(err, 5))
                row["tb_s"] = round(row["mb"] / row["kernel"], 2)
                out["rows"][f"{model}/{name}/{rows}"] = row
                print(f"{model:14s} {name:8s} rows {rows:3d}: ops {row['ops']:6.2f} µs  cublas {row['cublas']:6.2f}"
                      f"  kernel {row['kernel']:6.2f} ({row['tb_s']} TB/s)  ops/kernel "
                      f"{row['ops'] / row['kernel']:.2f}x", flush=True)
                if rows != 4:
                    continue
                times = {}
                for cand in CANDIDATES:
                    key = "n{BLOCK_N}k{BLOCK_K}s{split}".format(**cand)
                    times[key] = timed(partial(small_linear.triton_linear, x, **call, **cand), w)
                    again = small_linear.triton_linear(x, w[0], **call, **cand)
                    err = ((again.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    assert err < 2e-2, (model, name, key, err)
                best = min(times, key=times.get)
                out["candidates"][f"{model}/{name}"] = times
                print(f"    best of {len(times)}: {best} {times[best]} µs", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
