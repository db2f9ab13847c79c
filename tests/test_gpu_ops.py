"""The compiled GPU layer's fewer-kernel ops (model/triton_ops.py): norms folded into the projections give the same
model, and the Triton kernels match their PyTorch references (on the GPU, or on the CPU under Triton's
interpreter where Triton is installed)."""

from __future__ import annotations

import os

import pytest
import torch
from test_gpu import rope_case

from mvllm import LLM
from mvllm.kernels import triton_attention, triton_ops
from mvllm.profile.accuracy import logits

needs_triton = pytest.mark.skipif(not triton_attention.HAS_TRITON, reason="Triton is not installed (CPU builds "
                                  "of torch ship without it); the kernels run on the GPU machine's tests")


def device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton without CUDA: set TRITON_INTERPRET=1 to run the kernels on the CPU")
    return "cpu"


def dtypes() -> list[tuple[torch.dtype, float]]:
    """float32 everywhere; bf16 on the GPU only (Triton's interpreter mishandles bf16 dots)."""
    return [(torch.float32, 1e-5)] + ([(torch.bfloat16, 2e-2)] if torch.cuda.is_available() else [])


def test_folded_norms_are_the_same_model(tiny, monkeypatch):
    """The table layout with the norms folded into qkv_proj and gate_up_proj (the kernels after them scaling
    by rstd, the residual adds inside o_proj and down_proj) gives the unfolded model's logits, in float32."""
    monkeypatch.setattr("mvllm.engine.model_runner.packable", lambda *a: False)  # plain Linear layers
    for name in ("llama", "qwen2"):  # qwen2: a QKV bias, added after the norm's scale
        llm = LLM(str(tiny(name)[0]), dtype="float32", fused=False)
        model, cpu, ids = llm.engine.model, torch.device("cpu"), list(range(3, 70))
        want = logits(model, ids, cpu, torch.float32, chunk=4, layout="table")
        norm = model.layers[0].input_layernorm.weight.clone()
        triton_ops.fold_norms(model)
        assert all(layer.folded for layer in model.layers) and model.layers[0].input_layernorm.weight.eq(1).all()
        assert not norm.eq(1).all()  # the tiny model's norms are not ones: folding changed the weights
        for chunk in (None, 4):
            got = logits(model, ids, cpu, torch.float32, chunk=chunk, layout="table")
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        standard = logits(model, ids, cpu, torch.float32, chunk=4)  # the folded weights on the eager layers
        torch.testing.assert_close(standard, want, atol=1e-4, rtol=1e-4)


@needs_triton
def test_silu_mul_kernel_matches_reference():
    dev = device()
    g = torch.Generator().manual_seed(0)
    for dtype, tol in dtypes():
        for rows, inter, hidden in ((1, 4864, 896), (5, 1536, 576), (3, 100, 40)):
            gate_up = torch.randn(rows, 2 * inter, generator=g).to(dev, dtype)
            x = (3 * torch.randn(rows, hidden, generator=g)).to(dev, dtype)
            want = triton_ops.reference_silu_mul(gate_up, x, 1e-6).float()
            got = triton_ops._triton_silu_mul(gate_up, x, 1e-6).float()
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@needs_triton
def test_linear_kernel_matches_reference():
    """One program per column block (K up to 1,024), and K split with the last program adding up the shares
    (run twice: the counters it leaves must be ready for the next call); with a residual and without."""
    dev = device()
    g = torch.Generator().manual_seed(1)
    for dtype, tol in dtypes():
        for rows, n, k, bias in ((1, 896, 896, False), (4, 576, 1536, True), (16, 100, 4864, False),
                                 (3, 40, 200, True), (32, 64, 1100, False)):
            x = torch.randn(rows, k, generator=g).to(dev, dtype)
            w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dev, dtype)
            b = torch.randn(n, generator=g).to(dev, dtype) if bias else None
            res = torch.randn(rows, n, generator=g).to(dev, dtype)
            want = triton_ops.reference_linear(x, w, b, res).float()
            for _ in range(2):
                got = triton_ops._triton_linear(x, w, b, res).float()
                torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            alone = triton_ops._triton_linear(x, w, b).float()  # no residual: the QKV projection
            torch.testing.assert_close(alone, triton_ops.reference_linear(x, w, b).float(), atol=tol, rtol=tol)
    assert triton_ops.config(4, 896, 4864)["split"] == 8 and triton_ops.config(4, 896, 896)["split"] == 1


@needs_triton
def test_rope_store_kernel_scales_and_adds_the_bias():
    """With x and a bias (norms folded): each row scaled by rstd(x), the bias added, then rotated and stored."""
    dev = device()
    for dtype, tol in dtypes():
        (qkv, cos, sin, cache, packed, heads, kv), _, _ = rope_case(dev, dtype)
        g = torch.Generator().manual_seed(2)
        x = (2 * torch.randn(qkv.shape[0], 896, generator=g)).to(dev, dtype)
        bias = torch.randn(qkv.shape[1], generator=g).to(dev, dtype)
        want_cache = cache.clone()
        want = triton_attention.reference_rope_store(qkv, cos, sin, want_cache, packed, heads, kv, bias, x, 1e-6)
        got = triton_attention._triton_rope_store(qkv, cos, sin, cache, packed, heads, kv, bias, x, 1e-6)
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
        torch.testing.assert_close(cache.float(), want_cache.float(), atol=tol, rtol=tol)


@needs_triton
def test_argmax_kernel_is_torch_argmax():
    """The decode graph's greedy pick: the first index of the largest, across chunks and inside one, with a
    vocabulary that is not a multiple of the chunk, a row of -inf, a NaN; run twice (the counters it leaves)."""
    dev = device()
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, vocab in ((1, 151936), (4, 49152), (7, 5000), (3, 100)):
            x = torch.randn(rows, vocab, generator=g)
            x[0, [vocab // 3, vocab - 1, 2 * vocab // 3]] = 50.0  # a tie across chunks: the first wins
            if rows > 1:
                x[1, [7, 9]] = 60.0  # a tie inside one chunk
                x[-1] = -float("inf")
            if rows > 2:
                x[2, vocab // 2] = float("nan")
            x = x.to(dev, dtype)
            want = torch.argmax(x.cpu().float(), dim=-1)
            for _ in range(2):
                out = torch.full((rows,), -1, dtype=torch.long, device=dev)
                triton_ops._triton_argmax(x, out)
                assert out.cpu().tolist() == want.tolist(), (rows, vocab, dtype)
