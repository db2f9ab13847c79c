"""mvllm::linear (model/small_linear.py): the projections of few-token steps with their norm, bias, SiLU and
residual add fused in. Its PyTorch reference against the decoder's own modules, the Triton kernel against the
reference (on the GPU, or on the CPU under TRITON_INTERPRET=1), and the decoder's "table" layout, which takes
the fused path for small steps, against the standard layouts."""

from __future__ import annotations

import os

import pytest
import torch

from mvllm.accuracy import logits
from mvllm.model import small_linear
from mvllm.model.decoder import MLP, Decoder, RMSNorm
from mvllm.model.loader import build_model, resolve


def case(device: str, dtype: torch.dtype, rows: int, n: int, k: int, norm=False, bias=False, res=False,
         silu=False, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=g).to(device, dtype)  # noqa: E731
    out = n // 2 if silu else n
    return rand(rows, k), rand(n, k) / k ** 0.5, dict(
        bias=rand(n) if bias else None, norm=(torch.rand(k, generator=g) + 0.5).to(device, dtype) if norm else None,
        eps=1e-6, residual=rand(rows, out) if res else None, silu=silu)


def test_reference_is_the_decoder_modules_op_by_op():
    """norm -> projection (+bias) -> SiLU(gate) * up -> + residual, as RMSNorm, nn.Linear and MLP compute it."""
    torch.manual_seed(0)
    x, residual = torch.randn(5, 48), torch.randn(5, 40)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    proj = torch.nn.Linear(48, 40)
    want = residual + proj(norm(x))
    got = small_linear.apply(x, proj, norm=norm, residual=residual)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    mlp = MLP(type("C", (), dict(hidden_size=48, intermediate_size=32))())
    torch.testing.assert_close(small_linear.apply(x, mlp.gate_up_proj, silu=True) @ mlp.down_proj.weight.t(),
                               mlp(x), atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(small_linear.triton is None, reason="Triton is not installed (CPU builds of torch ship "
                    "without it); the kernel runs on the GPU machine's tests")
def test_triton_linear_matches_reference():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton without CUDA: set TRITON_INTERPRET=1 to run the kernel on the CPU")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Triton's interpreter mishandles bf16 dots: bf16 is checked on the GPU
    dtypes = ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)) if device == "cuda" else ((torch.float32, 1e-5),)
    kinds = [dict(n=72, k=64, norm=True, bias=True), dict(n=64, k=96, res=True),
             dict(n=160, k=64, norm=True, silu=True), dict(n=64, k=300, res=True)]  # K not a block multiple
    for dtype, tol in dtypes:
        for kind in kinds:
            for rows in (1, 3, 16, 17):  # rows pad to 16 and 32
                x, w, call = case(device, dtype, rows, **kind)
                want = small_linear.reference(x.float(), w.float(), **{
                    k: v.float() if isinstance(v, torch.Tensor) else v for k, v in call.items()})
                got = small_linear._triton_linear(x, w, **call).float()
                torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol,
                                           msg=lambda m: f"{dtype} {kind} rows {rows}: {m}")


def unpacked(name: str) -> Decoder:
    """A synthetic model as built, before an engine swaps its Linear layers for packed ones."""
    return build_model(resolve(f"synthetic:{name}"), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
def test_table_layout_small_steps_match_the_standard_layouts(name, monkeypatch):
    """Steps of up to MAX_ROWS tokens take the fused projections (a whole 90-token prompt does not)."""
    model = unpacked(name)
    ids, cpu = list(range(3, 93)), torch.device("cpu")
    want = logits(model, ids, cpu, torch.float32, chunk=4)
    calls, apply = [], small_linear.apply
    monkeypatch.setattr(small_linear, "apply", lambda *a, **kw: (calls.append(a[0].shape[0]), apply(*a, **kw))[1])
    for chunk in (None, 4, 16):
        got = logits(model, ids, cpu, torch.float32, chunk=chunk, layout="table")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert max(calls) <= small_linear.MAX_ROWS
    assert len(calls) == 4 * model.cfg.num_layers * (23 + 6)  # chunks of 4 (23) and of 16 (6); never all 90
