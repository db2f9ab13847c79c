"""The compiled GPU step's layer with fewer kernels: the RMSNorms folded into the projections they feed, and
the residual adds into the projections that end each half of the layer.

A decode step is bound by its kernels per layer, not by its bytes. Two changes take three of them away:
- **Norms folded** (`fold_norms`): norm(x) W^T = rstd(x) * (x (W * g)^T), so the RMSNorm's weight g is
  multiplied into the QKV and gate/up weights once at start-up (and set to one, so every other path of the
  same model computes the same function). The projection then reads the residual stream x itself, and the
  kernel after it scales each row by rstd(x), summing the row's squares itself: `mvllm::rope_store` (with
  the QKV bias, now added after the scale) and `mvllm::silu_mul` here. The two norm kernels of a layer go.
- **Residual adds in the projection** (`mvllm::linear`): for steps of a few rows, one Triton kernel computes
  x W^T (+ residual), splitting K over several programs where the weight is large and letting the last
  program of each column block add up the partial sums (no second kernel, as cuBLAS's split-K needs). It
  serves o_proj and down_proj with their residual, and qkv_proj; gate_up_proj stays with cuBLAS. Larger
  steps (prefill) run cuBLAS and an add.
The decode graph's greedy pick (`argmax`) is a Triton kernel too: many programs a row, where torch's
reduction gives a row one block.
Rounding: the products are rounded to the model's dtype as the eager layer's are, then scaled, the SiLU and
the add done in float32 and rounded once. The PyTorch references run where Triton does not (CPU tests)."""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from mvllm.kernels.triton_attention import HAS_TRITON, cdiv, next_pow2, rstd


@functools.cache
def jit():
    """The kernels (mvllm/kernels/triton_ops_jit.py), imported at a GPU step's first launch."""
    from mvllm.kernels import triton_ops_jit

    return triton_ops_jit


SMALL_ROWS = 32  # linear: steps of up to this many rows take the Triton kernel, larger ones cuBLAS


def fold_norms(model) -> None:
    """Multiply each layer's RMSNorm weights into the projection after it, and set them to one (so a second
    call changes nothing)."""
    with torch.no_grad():
        for layer in model.layers:
            for norm, proj in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                               (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                proj.weight.copy_((proj.weight.float() * norm.weight.float()).to(proj.weight.dtype))
                norm.weight.fill_(1.0)
            layer.folded = True


@torch.library.custom_op("mvllm::silu_mul", mutates_args=())
def silu_mul(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up) -> SiLU(gate * r) * (up * r) [T, I], r = rstd(x) per row."""
    if gate_up.is_cuda and HAS_TRITON:
        return _triton_silu_mul(gate_up, x, eps)
    return reference_silu_mul(gate_up, x, eps)


@silu_mul.register_fake
def _(gate_up, x, eps):
    return gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)


def reference_silu_mul(gate_up, x, eps: float) -> torch.Tensor:
    gate, up = (gate_up.float() * rstd(x, eps)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


@torch.library.custom_op("mvllm::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
           residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x W^T (+ bias) (+ residual), the product rounded to the dtype before the add as the eager layer does."""
    if x.is_cuda and HAS_TRITON and x.shape[0] <= SMALL_ROWS:
        return _triton_linear(x, weight, bias, residual)
    return reference_linear(x, weight, bias, residual)


@linear.register_fake
def _(x, weight, bias=None, residual=None):
    return x.new_empty(x.shape[0], weight.shape[0])


def reference_linear(x, weight, bias=None, residual=None) -> torch.Tensor:
    y = F.linear(x, weight, bias)
    return y if residual is None else residual + y


def _triton_silu_mul(gate_up, x, eps: float) -> torch.Tensor:
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(t, inter)
    block = 1024
    jit()._silu_mul_kernel[(t, cdiv(inter, block))](
        gate_up, x, out, gate_up.stride(0), x.stride(0), out.stride(0), inter, x.shape[1], eps, BLOCK=block,
        BLOCK_H=min(1024, next_pow2(x.shape[1])))
    return out


_counters: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 zeros on the device, shared by the kernels that count their programs: each program that
    finishes a count sets its own back to zero, and kernels of one stream run one after another."""
    counter = _counters.get(device)
    if counter is None or counter.numel() < n:
        counter = _counters[device] = torch.zeros(max(4096, n), dtype=torch.int32, device=device)
    return counter


ARGMAX_BLOCK = 4096  # argmax: logits a program reads


def argmax(logits: torch.Tensor, out: torch.Tensor) -> None:
    """out[r] = torch.argmax(logits[r]) (the first index of the largest; a NaN counts as the largest), for the
    few rows of a decode step: each row's vocabulary is read by many programs and the last to finish picks
    among their maxima, one kernel where torch's reduction gives each row one block (8.7-13.7 µs a step on the
    H200 for Qwen2.5's and SmolLM2's vocabularies)."""
    if logits.is_cuda and HAS_TRITON:
        _triton_argmax(logits, out)
    else:
        torch.argmax(logits, dim=-1, out=out)


def _triton_argmax(logits: torch.Tensor, out: torch.Tensor) -> None:
    rows, vocab = logits.shape
    chunks = cdiv(vocab, ARGMAX_BLOCK)
    best = logits.new_empty(rows * chunks, dtype=torch.float32)
    at = logits.new_empty(rows * chunks, dtype=torch.int32)
    jit()._argmax_kernel[(rows, chunks)](logits, out, best, at, counters(logits.device, rows), vocab,
                                         logits.stride(0), CHUNKS=chunks, BLOCK=ARGMAX_BLOCK,
                                         BLOCK_C=next_pow2(chunks))


def config(rows: int, n: int, k: int) -> dict:
    """Block sizes and the split of K for [rows, k] x [k, n]: a column block of 32 per program,
    and K split in shares of at least 192 where it is over 1,024 (at most 8), so a large weight is streamed
    by a few hundred programs. Measured on the H200 at 4 rows (experiments/probes/small_linear_speed.py)."""
    split = 1 if k <= 1024 else min(8, 1 << ((k // 192).bit_length() - 1))
    return dict(BLOCK_M=max(16, next_pow2(rows)), BLOCK_N=32, BLOCK_K=128, split=split)


def _triton_linear(x, weight, bias=None, residual=None, **tune) -> torch.Tensor:
    rows, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(rows, n)
    cfg = config(rows, n, k) | tune
    split = cfg.pop("split")
    blocks = cdiv(n, cfg["BLOCK_N"])
    k_split = cdiv(cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = cdiv(k, k_split)
    ws = counter = out  # unused without a split
    if split > 1:  # partial sums, added up by the last program of each column block to finish
        ws = x.new_empty(split * cfg["BLOCK_M"] * n, dtype=torch.float32)
        counter = counters(x.device, blocks)
    jit()._linear_kernel[(blocks, split)](
        x, weight, x if bias is None else bias, x if residual is None else residual, out, ws, counter, rows, n, k,
        k_split, x.stride(0), weight.stride(0), 0 if residual is None else residual.stride(0), out.stride(0),
        BIAS=bias is not None, RES=residual is not None, SPLIT=split,
        IEEE=x.dtype == torch.float32, num_warps=4, num_stages=4, **cfg)
    return out
