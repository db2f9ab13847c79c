"""A cold prompt's time to first token in the engine against its floor on the same GPU, in the same run.

    python3 experiments/probes/prefill_floor.py [MODEL] [--lengths 2048,10000,20000] [--out FILE.json]
                                                [--max-step-tokens N] [--per-token]

The floor of a cold prompt of L tokens: the model's layers' GEMMs (QKV, output, gate-up and down projections, in
cuBLAS through torch.matmul, the model's dtype, each layer its own weights) plus
torch.nn.functional.scaled_dot_product_attention on the same shapes (causal, the model's GQA), the faster of
the cuDNN and flash backends, timed with CUDA events (the median of --repeats runs of all layers). Norms,
rotary, the cache writes and the last token's logits are left out: small at these lengths. Beside it, the
engine's own time from admission to the first token of the same kind of prompt (random ids: nothing cached),
every chunk of it under the engine's step budget (--max-step-tokens where the engine has one), synchronised
(overlap off); then the ratio engine / floor per length. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def layer_weights(cfg, n: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, ...]]:
    """n layers' projection weights [in, out], as the engine's layers hold them (QKV and gate-up fused)."""
    h, d = cfg.hidden_size, cfg.head_dim
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d
    shapes = [(h, qkv), (cfg.num_heads * d, h), (h, 2 * cfg.intermediate_size), (cfg.intermediate_size, h)]
    return [tuple(torch.randn(a, b, device="cuda", dtype=dtype) * a ** -0.5 for a, b in shapes) for _ in range(n)]


def gemms(x: torch.Tensor, attn: torch.Tensor, act: torch.Tensor, layers) -> None:
    """x [n, hidden] through every layer's projections: attn [n, heads * D] (attention's output) into the output
    projection, act [n, intermediate] (the MLP's product) into down."""
    for w_qkv, w_o, w_gu, w_down in layers:
        torch.matmul(x, w_qkv)
        torch.matmul(attn, w_o)
        torch.matmul(x, w_gu)
        torch.matmul(act, w_down)


def attention_inputs(cfg, n: int, dtype: torch.dtype, expand: bool):
    """q [1, heads, n, D], k and v [1, kv heads, n, D] (expand: repeated to every query head)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, cfg.num_heads, n, cfg.head_dim, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(1, cfg.num_kv_heads, n, cfg.head_dim, device="cuda", dtype=dtype, generator=g) for _ in "kv")
    if expand:
        group = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    return q, k, v


def timed(fn, repeats: int) -> float:
    """The median of `repeats` runs of fn in milliseconds, by CUDA events (after two warm-up runs)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def sdpa_ms(cfg, n: int, dtype: torch.dtype, repeats: int, layers: int = 1) -> dict:
    """SDPA on an n-token causal prompt (cfg's heads, KV heads and head dim), `layers` times, per backend (cuDNN,
    flash): milliseconds, or why it failed. GQA in the kernel where the backend takes it; else K/V repeated first."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        for expand in (False, True):
            q, k, v = attention_inputs(cfg, n, dtype, expand)

            def run(q=q, k=k, v=v, expand=expand, scale=cfg.head_dim ** -0.5):
                for _ in range(layers):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=not expand)
            try:
                with sdpa_kernel(backend):
                    ms = timed(run, repeats)
            except RuntimeError as e:
                out[f"{name}{'-expanded' if expand else ''}"] = f"failed: {str(e).splitlines()[0][:120]}"
                continue
            out[f"{name}{'-expanded' if expand else ''}"] = round(ms, 3)
            break
    return out


def floor(cfg, n: int, dtype: torch.dtype, layers, repeats: int) -> dict:
    """The floor of an n-token cold prompt: the layers' GEMMs and SDPA (best backend), each timed on its own."""
    x = torch.randn(n, cfg.hidden_size, device="cuda", dtype=dtype)
    attn = torch.randn(n, cfg.num_heads * cfg.head_dim, device="cuda", dtype=dtype)
    act = torch.randn(n, cfg.intermediate_size, device="cuda", dtype=dtype)
    gemm_ms = timed(lambda: gemms(x, attn, act, layers), repeats)
    sdpa = sdpa_ms(cfg, n, dtype, repeats, len(layers))
    timings = {k: v for k, v in sdpa.items() if isinstance(v, float)}
    if not timings:
        raise SystemExit(f"prefill_floor: no SDPA backend ran for {n} tokens: {sdpa}")
    best = min(timings, key=timings.get)
    return {"gemm_ms": round(gemm_ms, 3), "sdpa_ms": timings[best], "sdpa_backend": best, "sdpa": sdpa,
            "floor_ms": round(gemm_ms + timings[best], 3)}


def engine_ttft(eng, n: int, repeats: int, vocab: int, g: torch.Generator) -> dict:
    """Admission to first token of fresh n-token prompts, one at a time, with the engine's steps counted."""
    from mvllm import SamplingParams

    walls, steps = [], []
    for i in range(repeats + 1):  # the first: warm-up (a size compiled or captured late)
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        torch.cuda.synchronize()
        t = time.perf_counter()
        seq = eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        k = 0
        while seq.num_output_tokens < 1:
            eng.step()
            k += 1
        torch.cuda.synchronize()
        if i:
            walls.append((time.perf_counter() - t) * 1e3)
            steps.append(k)
        while eng.has_unfinished():
            eng.step()
    return {"engine_ms": round(statistics.median(walls), 2), "engine_runs_ms": [round(w, 2) for w in walls],
            "engine_steps": steps[-1]}


def git_commit() -> str | None:
    if os.environ.get("MVLLM_GIT_COMMIT"):
        return os.environ["MVLLM_GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="synthetic:qwen2.5-0.5b")
    ap.add_argument("--lengths", default="2048,10000,20000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--max-step-tokens", type=int, help="the engine's step budget (default: the engine's own)")
    ap.add_argument("--per-token", action="store_true", help="every row through the per-token attention kernel")
    ap.add_argument("--tiled", help="the tiled kernel's launch setting, as JSON or a tiled_sweep.py output (its best)")
    a = ap.parse_args()
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
    except ValueError:
        print(f"prefill_floor: --lengths must be comma-separated integers, got {a.lengths!r}", file=sys.stderr)
        sys.exit(2)
    if not torch.cuda.is_available():
        print("prefill_floor: needs a CUDA GPU (none here)", file=sys.stderr)
        sys.exit(2)
    if min(lengths) < 1 or a.repeats < 1:
        print("prefill_floor: lengths and --repeats must be at least 1", file=sys.stderr)
        sys.exit(2)
    torch.set_grad_enabled(False)
    from mvllm import LLM
    from mvllm.kernels import triton_attention

    if a.per_token:
        triton_attention.TILED_MIN = 10 ** 9
    tiled = None
    if a.tiled:
        tiled = json.loads(open(a.tiled).read() if os.path.isfile(a.tiled) else a.tiled)
        tiled = {k: v for k, v in (tiled["best"][0] if "best" in tiled else tiled).items() if k != "ms"}
    kw = dict(max_active=16, kv_cache_gb=8.0, overlap=False, max_model_len=max(lengths) + 16)
    if a.max_step_tokens is not None:
        kw["max_step_tokens"] = a.max_step_tokens
    if tiled:  # before the engine is built: its CUDA graphs capture the launch
        from mvllm.model.loader import resolve
        source = resolve(a.model).config
        triton_attention.set_tiled(tiled, source.num_heads // source.num_kv_heads)
    t0 = time.perf_counter()
    llm = LLM(a.model, device="cuda", dtype="bfloat16", **kw)
    eng = llm.engine
    cfg, dtype = eng.model.cfg, eng.dtype
    budget = eng.config.max_step_tokens
    print(f"{a.model} ready {time.perf_counter() - t0:.1f} s on {torch.cuda.get_device_name()}, step budget "
          f"{budget}", flush=True)
    layers = layer_weights(cfg, cfg.num_layers, dtype)
    g = torch.Generator().manual_seed(0)
    out = {"model": a.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "git_commit": git_commit(),
           "max_step_tokens": budget, "per_token": a.per_token, "tiled": dict(triton_attention.TILED,
                                                                                tile=triton_attention.TILE), "dtype": str(dtype).removeprefix("torch."),
           "lengths": []}
    for n in lengths:
        row = {"tokens": n, **floor(cfg, n, dtype, layers, a.repeats)}
        torch.cuda.empty_cache()
        row.update(engine_ttft(eng, n, a.repeats, cfg.vocab_size - 1, g))
        row["ratio"] = round(row["engine_ms"] / row["floor_ms"], 2)
        out["lengths"].append(row)
        print(f"{n:6d} tokens: floor {row['floor_ms']:.2f} ms (GEMMs {row['gemm_ms']:.2f} + SDPA {row['sdpa_ms']:.2f}, "
              f"{row['sdpa_backend']}), engine {row['engine_ms']:.2f} ms in {row['engine_steps']} steps: "
              f"{row['ratio']:.2f}x the floor", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
