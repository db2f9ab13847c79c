"""CPU modes: how a CPU backend holds its weights and which kernels run them.

- `int8w` (accurate): int8 weights in groups of 32 input columns, one scale each (a float16 value), float32
  activations. Decode-sized batches (up to PACKED_MAX_ROWS tokens; LANES_MAX_ROWS where the weights are packed
  in the kernel's lanes layout, AVX2 or AVX-512; LANES8_MAX_ROWS in its lanes8 layout, AVX-512 VNNI) run
  mvllm's int8 kernel (kernels/cpu_int8.py),
  which reads each weight byte once per step: a quarter of float32's bytes. Prefill-sized batches run
  oneDNN's packed GEMM on a de-quantized bfloat16 copy (float32 where this CPU lacks native bf16), or with
  batch_invariant=on the int8 kernel too, so a row's result never depends on its batch mates. Where the lanes8
  kernel takes AMX tiles (cpu_int8.amx(): a Sapphire Rapids or later Xeon), or where the CPU has AVX-512 VNNI but
  no native bf16 (the GEMM would be float32), every batch runs the kernel (EVERY_ROW), with no de-quantized
  copy: there int8w is batch-invariant by default.
- `none` with dtype bfloat16 or float32: every Linear keeps its weight in oneDNN's blocked layout where that
  works (x86), else plain F.linear.
- `int8-lossy`: PyTorch's dynamic int8 Linear. Activations are quantized per call with one scale per
  tensor, and on SmolLM2-135M (real weights) it changes most answers: mean KL 1.0 nats/token against
  float32 (mvllm/profile/accuracy.py). Only behind this explicit name; `serve` warns when a backend runs it.

`cpu_mode` picks the mode of a CPU backend whose settings leave it open, per machine: int8w where the int8
kernel builds (with AVX-512, or its portable path: AVX2, NEON on an Apple M2, else plain loops), else
bfloat16 where oneDNN has native bf16 (x86 with AVX-512 BF16 or AMX), else float32. The tied lm_head gets its own quantized copy; the embedding stays float32.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
from torch import nn

from mvllm import machine
from mvllm.engine.modes import QUANTS, RENAMED
from mvllm.errors import InvalidRequestError
from mvllm.kernels import cpu_int8, cpu_layers
from mvllm.model.decoder import Decoder

PACKED_MAX_ROWS = 8  # int8w: up to this many tokens the int8 kernel, above it the packed GEMM
# ... and up to this many where the weights are in the kernel's lanes layout: the most rows at which the kernel beat
# the bf16 GEMM (results/profile/README.md, the lanes layout's kernel alone).
LANES_MAX_ROWS = 16
# ... and this many in the lanes8 layout (int8 activations, AVX-512 VNNI): the same, for lanes8
# (results/profile/README.md).
LANES8_MAX_ROWS = 32
# ... and this many where the lanes8 kernel has AMX tiles (cpu_int8.amx(); above 8 rows), or where the GEMM would
# run in float32 (no native bf16, where the kernel is several times faster at any row count:
# results/profile/dev2core-no-native-bf16.txt): every step, so no de-quantized copy is kept and a row's result never
# depends on its batch.
EVERY_ROW = math.inf
BATCH_INVARIANT = False  # int8w's default: batch_invariant=off
CPU = torch.device("cpu")


class Int8Linear(nn.Module):
    """int8w: int8 weights in groups of cpu_int8.GROUP, float32 activations in and out."""

    def __init__(self, linear: nn.Linear, invariant: bool = False):
        super().__init__()
        q, scales = cpu_int8.quantize_weight(linear.weight.detach().float())
        self.register_buffer("q", q)
        self.register_buffer("scales", scales)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernel_rows = math.inf if invariant else PACKED_MAX_ROWS  # batches up to this size take the kernel
        if cpu_int8.packs() and self.out_features % cpu_int8.LANE_OUTS == 0:  # the kernel's lanes layouts
            self.q, self.scales = cpu_int8.pack(q, scales)
            self.kernel_rows = max(self.kernel_rows, max_rows(self.q))
        self.gemm = None  # every row through the kernel (invariant, or AMX): no de-quantized copy
        if self.kernel_rows < math.inf:
            self.wide = torch.bfloat16 if packable(CPU, torch.bfloat16) else torch.float32
            self.gemm = dense(cpu_int8.dequantize(q, scales).to(self.wide), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= self.kernel_rows:
            y = cpu_int8.int8_linear(rows, self.q, self.scales, self.bias, check=False)
        else:
            y = self.gemm(rows.to(self.wide)).float()
        return y.view(*x.shape[:-1], self.out_features)


def max_rows(q: torch.Tensor) -> float:
    """The most tokens a step sends through the int8 kernel for weights in q's layout (above: the GEMM)."""
    if q.dim() == 3:
        if q.dtype == torch.uint8:
            return EVERY_ROW if lanes8_every_row() else LANES8_MAX_ROWS
        return LANES_MAX_ROWS
    return PACKED_MAX_ROWS


def lanes8_every_row() -> bool:
    """The lanes8 kernel takes every batch size: it has AMX tiles, or the GEMM it would leave prefill to lacks
    native bf16 here (float32 oneDNN, 2-4x the kernel's time)."""
    return cpu_int8.amx() or not packable(CPU, torch.bfloat16)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().to(linear.weight.dtype)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)


def dense(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A Linear over `weight` in its dtype: oneDNN-packed where that works here, else plain."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return PackedLinear(linear) if packable(CPU, weight.dtype) else linear


def packable(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed Linear runs here: an x86 build with oneDNN (never the macOS wheel), native bf16 for
    bfloat16. Checked through `machine`, whose probes cannot raise on a build without oneDNN."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (machine.onednn() and machine.x86()):
        return False
    if dtype == torch.bfloat16 and not machine.onednn_bf16():
        return False
    return _packing_works(dtype)


@functools.cache
def _packing_works(dtype: torch.dtype) -> bool:
    """The oneDNN ops are internal to PyTorch: check once that this build has them and they agree with
    F.linear, else stay on F.linear."""
    try:
        linear = nn.Linear(32, 24, dtype=dtype)
        x = torch.randn(3, 32, dtype=dtype)
        with torch.no_grad():
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            return torch.allclose(PackedLinear(linear)(x).float(), linear(x).float(), atol=tol, rtol=tol)
    except (RuntimeError, AttributeError, TypeError):
        return False


def pack(module: nn.Module) -> nn.Module:
    """Swap every float32 or bfloat16 nn.Linear for a PackedLinear, in place (call only where `packable`)."""
    for name, child in module.named_children():
        if type(child) is nn.Linear and child.weight.dtype in (torch.float32, torch.bfloat16):
            setattr(module, name, PackedLinear(child))
        else:
            pack(child)
    return module


def cpu_modes() -> dict[str, str]:
    """The CPU modes this machine runs, each with what it is."""
    modes = {"dtype=float32": "float32 weights and activations"}
    if packable(CPU, torch.bfloat16):
        modes["dtype=bfloat16"] = "bfloat16 weights and activations, oneDNN with native bf16"
    if cpu_int8.available():
        modes["quant=int8w"] = f"int8 weights in groups of {cpu_int8.GROUP}, float32 activations"
    if torch.backends.quantized.supported_engines != ["none"]:
        modes["quant=int8-lossy"] = "dynamic int8 activations per tensor: changes answers"
    return modes


def cpu_mode(dtype: str | None, quant: str | None) -> tuple[str, str, str]:
    """(dtype, quant, why) of a CPU backend; settings left open (None) are picked for this machine."""
    if quant in RENAMED:
        raise InvalidRequestError(f"quant={quant} is now called quant={RENAMED[quant]}: it changes the model's "
                                  "answers (mean KL 1.0 nats/token on SmolLM2); the accurate fast mode is "
                                  "quant=int8w", "quant")
    if quant is not None and quant not in QUANTS:
        raise InvalidRequestError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}", "quant")
    if quant in ("int8w", "int8-lossy"):
        if dtype not in (None, "float32"):
            raise InvalidRequestError(f"quant={quant} runs with float32 activations only", "quant")
        if f"quant={quant}" not in cpu_modes():
            why = cpu_int8.why_unavailable.splitlines()[0] if quant == "int8w" else "no quantized engine"
            raise InvalidRequestError(f"quant={quant} does not run on this machine ({why}); it runs: "
                                      f"{', '.join(cpu_modes())}", "quant")
        return "float32", quant, "as asked"
    if dtype == "bfloat16" and not packable(CPU, torch.bfloat16):
        why = "oneDNN lacks native bf16 on this CPU" if machine.onednn() else "this torch build has no oneDNN"
        raise InvalidRequestError(f"dtype=bfloat16 does not run on this CPU ({why}: every op would be emulated, "
                                  f"slower than float32); it runs: {', '.join(cpu_modes())}", "dtype")
    if dtype is not None or quant == "none":
        return dtype or "float32", "none", "as asked"
    if cpu_int8.available():
        how = "with AVX-512" if avx512() else "without AVX-512: its portable path (AVX2, NEON or plain loops)"
        return "float32", "int8w", f"picked: the int8 kernel built {how} here"
    why = cpu_int8.why_unavailable.splitlines()[0] if cpu_int8.why_unavailable else "it did not build"
    if packable(CPU, torch.bfloat16):
        return "bfloat16", "none", f"picked: oneDNN has native bf16 here (no int8 kernel: {why})"
    return "float32", "none", f"picked: no int8 kernel ({why}) and no native bf16 here"


def avx512() -> bool:
    """Whether this CPU runs AVX-512, as PyTorch's own kernel dispatch sees it (the int8 kernel is built
    with -march=native, so it uses AVX-512 exactly where this holds)."""
    return machine.avx512()


def _untie(model: Decoder) -> None:
    if model.lm_head.weight is model.embed_tokens.weight:
        head = nn.Linear(model.cfg.hidden_size, model.cfg.vocab_size, bias=False)
        head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone())
        model.lm_head = head


def _swap(module: nn.Module, invariant: bool) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.in_features % cpu_int8.GROUP == 0:
            setattr(module, name, Int8Linear(child, invariant))
        else:
            _swap(child, invariant)


def quantize(model: Decoder, quant: str, device: torch.device, batch_invariant: bool | None = False) -> Decoder:
    """batch_invariant (int8w only): every row through the int8 kernel (EngineConfig resolves its default)."""
    if quant == "none":
        return model
    if quant not in QUANTS:
        raise InvalidRequestError(f"quant must be one of {', '.join(QUANTS)}, got {quant!r}", "quant")
    if device.type != "cpu":
        raise InvalidRequestError(f"quant={quant} runs on the cpu device only", "quant")
    model = model.float()
    _untie(model)
    if quant == "int8w":
        _swap(model, bool(batch_invariant))
        model.cpu_layers = cpu_layers.Layers.of(model)
        if model.cpu_layers is not None:
            cpu_layers.available()  # built now, while the backend loads, not in its first request's step
        return model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear: qconfig}, inplace=True)
