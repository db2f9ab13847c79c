"""int8w's group size against accuracy on real weights, on any CPU: the lanes8 path's numbers emulated in torch.

lanes8 (AVX-512 VNNI, AMX) rounds each activation row to int8 per group of inputs (scale absmax / 127) and sums
each group of int8 x int8 products exactly in int32; the group's sum times the weights' float16 scale times the
row's scale adds to the output. This runs those steps with torch (the integer sums exact in float32: at most
64 * 127 * 127 < 2^24) on every linear of the model, LM head included, and compares the logits with the float32
model's on the profile's evaluation text (mvllm.profile.accuracy: teacher-forced, mean KL and top-1), at each
group size asked for. Where this machine has no AVX-512, it is how lanes8's accuracy is measured here.

    python experiments/probes/group_accuracy.py [--model smollm2-135m] [--groups 32,64] [--out FILE]

A setting may give some linears (by their name in the model) a group of their own: --groups 32,32:gate_up_proj=64 is
groups of 32 everywhere, then the same with the MLP's gate and up projection at 64. `attn=bf16` in a setting also
runs the attention as an AMX bf16 kernel would (experiments/probes/amx_attention_probe.cpp with one product): queries and
keys rounded to bf16 for the scores, exp(s - max) in float32, its bf16 rounding times values rounded to bf16, summed
in float32 and divided by the float32 sum; every row of the one forward so, an upper bound on a kernel that keeps
a prefill's newest row in float32.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn

from mvllm.engine import quant
from mvllm.kernels import cpu_int8
from mvllm.model.loader import build_model, resolve
from mvllm.profile import accuracy
from mvllm.profile.run import environment


class Lanes8Emulated(nn.Module):
    def __init__(self, linear: nn.Linear, group: int):
        super().__init__()
        q, s = cpu_int8.quantize_weight(linear.weight.detach().float(), group)
        self.group, self.out = group, q.shape[0]
        self.q = q.float().reshape(self.out, -1, group)  # [out, groups, group]
        self.s = s  # [out, groups]
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        xg = rows.reshape(rows.shape[0], -1, self.group)
        amax = xg.abs().amax(-1)
        xs = amax / 127
        x8 = torch.round(xg * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))[..., None])
        y = torch.zeros(rows.shape[0], self.out)
        for g in range(xg.shape[1]):
            y += (x8[:, g] @ self.q[:, g].T) * (xs[:, g, None] * self.s[None, :, g])
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out)


def swap(module: nn.Module, group: int, by_name: dict[str, int], seen: set[str]) -> None:
    """Every linear whose inputs the group divides -> Lanes8Emulated; the names of by_name it met go in seen."""
    for name, child in module.named_children():
        g = by_name.get(name, group)
        if isinstance(child, nn.Linear) and child.in_features % g == 0:
            setattr(module, name, Lanes8Emulated(child, g))
            seen.add(name)
        else:
            swap(child, group, by_name, seen)


def parse(setting: str) -> tuple[int, dict[str, int], str]:
    """"32:gate_up_proj=64:attn=bf16" -> (32, {"gate_up_proj": 64}, "bf16")."""
    first, *rest = setting.split(":")
    try:
        pairs = dict(r.split("=") for r in rest)
        attn = pairs.pop("attn", "float32")
        if attn not in ("float32", "bf16"):
            raise ValueError(f"attn={attn}")
        return int(first), {k: int(v) for k, v in pairs.items()}, attn
    except ValueError as e:
        raise SystemExit(f"bad --groups setting {setting!r} ({e}): GROUP[:LINEAR=GROUP...][:attn=bf16]") from None


def sdpa_bf16(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention with the products of a bf16 tile kernel (see the module's docstring)."""
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    bf = lambda x: x.to(torch.bfloat16).float()  # noqa: E731
    s = bf(q.float() * (q.shape[-1] ** -0.5 if scale is None else scale)) @ bf(k.float()).transpose(-2, -1)
    if is_causal:
        lq, lk = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))  # as torch: top-left aligned
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return (bf(p) @ bf(v.float())) / p.sum(-1, keepdim=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--groups", default="32,64")
    ap.add_argument("--out")
    a = ap.parse_args()
    settings = {setting: parse(setting) for setting in a.groups.split(",")}
    source = resolve(a.model)
    ref = accuracy.Reference(source)
    cpu = torch.device("cpu")
    out = {"model": a.model, "tokens": len(ref.ids), "what": "lanes8's numbers emulated in torch, teacher-forced "
           "over mvllm/data/eval.txt in one forward, against float32; a linear whose inputs are not a multiple of the "
           "group stays float32", "command": f"python experiments/probes/group_accuracy.py --groups {a.groups}",
           "environment": environment(a.model), "groups": {}}
    for setting, (group, by_name, attn) in settings.items():
        model = build_model(source, cpu, torch.float32)
        quant._untie(model)  # the LM head quantized too, as int8w does
        seen: set[str] = set()
        swap(model, group, by_name, seen)
        if missing := sorted(set(by_name) - seen):
            raise SystemExit(f"--groups {setting!r}: no linear of {a.model} named {', '.join(missing)} takes that group")
        sdpa = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = sdpa_bf16 if attn == "bf16" else sdpa
        try:
            with torch.inference_mode():
                got = accuracy.compare(ref.logits, accuracy.logits(model, ref.ids, cpu, torch.float32))
        finally:
            F.scaled_dot_product_attention = sdpa
        out["groups"][setting] = got
        print(f"group {setting}: mean KL {got['kl_mean']:.5f}, max {got['kl_max']:.3f}, top-1 {got['top1']:.2%}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
