"""oneDNN-packed Linear layers (the CPU float32 and bfloat16 paths): same results as F.linear, swapped in by the
runner."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mvllm.engine.quant import PackedLinear, pack, packable

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not packable(CPU, torch.float32), reason="no oneDNN on this CPU")


@pytest.mark.parametrize("rows", [1, 4, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_linear(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 160, bias=bias)
    x = torch.randn(2, rows, 96)
    ref = F.linear(x, linear.weight, linear.bias)
    out = PackedLinear(linear)(x)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_pack_swaps_float32_linears_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4)), nn.Linear(4, 4).double())
    pack(model)
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert type(model[2]) is nn.Linear
    assert not packable(CPU, torch.float16) and not packable(torch.device("meta"), torch.float32)


@pytest.mark.skipif(not packable(CPU, torch.bfloat16), reason="no native bf16 in oneDNN on this CPU")
def test_packed_bfloat16_close_to_float32():
    torch.manual_seed(0)
    linear = nn.Linear(96, 160)
    x = torch.randn(4, 96)
    out = PackedLinear(linear.bfloat16())(x.bfloat16()).float()
    torch.testing.assert_close(out, F.linear(x, linear.weight.float(), linear.bias.float()), rtol=0.05, atol=0.05)
