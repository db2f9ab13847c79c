"""Weight quantization for the CPU backend (float32 activations in and out of every layer).

- `int8`: PyTorch's dynamic int8 Linear (fbgemm/onednn): weights int8 with one scale per output row;
  inside each Linear the activations are quantized to int8 per call, with one scale per tensor.
  The fastest CPU path measured (results/profile/README.md), but activation outliers hurt it: on
  SmolLM2-135M (real weights) its logits kept a mean cosine of only 0.72 to float32's.
- `int8w`: weight-only int8 (one scale per output row), float32 activations: accurate (SmolLM2: mean
  cosine 0.998) but slow, since `torch._weight_int8pack_mm` is slower than the float32 GEMV on x86
  (1.19 vs 0.13 ms for a 896x9728 projection at batch 1 on the H200 machine's 16-core Xeon). Batches of
  more than PACKED_MAX_ROWS tokens de-quantize the weight and run the float32 GEMM instead.
tests/test_quant.py states the tolerances. The tied lm_head gets its own quantized copy; the embedding
stays float32.

Unquantized float32 models on x86 CPUs get `pack`: every Linear keeps its weight in oneDNN's blocked layout
and runs through oneDNN's linear, which measured 2-3x faster than `F.linear` for decode's 1-4 rows
(results/profile/README.md).
"""

from __future__ import annotations

import functools
import platform
import warnings

import torch
from torch import nn

from mvllm.errors import InvalidRequestError
from mvllm.model.decoder import Decoder

QUANTS = ("none", "int8", "int8w")
PACKED_MAX_ROWS = 8  # above this many tokens, de-quantize and use the float32 GEMM


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        self.register_buffer("weight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= PACKED_MAX_ROWS:
            y = torch._weight_int8pack_mm(rows.contiguous(), self.weight, self.scale)
        else:
            y = rows @ (self.weight.float() * self.scale[:, None]).t()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def packable(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and platform.machine().lower() in ("x86_64", "amd64") and _packing_works())


@functools.cache
def _packing_works() -> bool:
    """The oneDNN ops are internal to PyTorch: check once that this build has them and they agree with
    F.linear, else stay on F.linear."""
    try:
        linear = nn.Linear(32, 24)
        x = torch.randn(3, 32)
        with torch.no_grad():
            return torch.allclose(PackedLinear(linear)(x), linear(x), atol=1e-5)
    except (RuntimeError, AttributeError, TypeError):
        return False


def pack(module: nn.Module) -> nn.Module:
    """Swap every float32 nn.Linear for a PackedLinear, in place (call only where `packable`)."""
    for name, child in module.named_children():
        if type(child) is nn.Linear and child.weight.dtype == torch.float32:
            setattr(module, name, PackedLinear(child))
        else:
            pack(child)
    return module


def _untie(model: Decoder) -> None:
    if model.lm_head.weight is model.embed_tokens.weight:
        head = nn.Linear(model.cfg.hidden_size, model.cfg.vocab_size, bias=False)
        head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone())
        model.lm_head = head


def _swap(module: nn.Module) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child))
        else:
            _swap(child)


def quantize(model: Decoder, quant: str, device: torch.device) -> Decoder:
    if quant == "none":
        return model
    if quant not in QUANTS:
        raise InvalidRequestError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}", "quant")
    if device.type != "cpu":
        raise InvalidRequestError(f"quant={quant} runs on the cpu device only", "quant")
    model = model.float()
    _untie(model)
    if quant == "int8w":
        _swap(model)
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear: qconfig}, inplace=True)
