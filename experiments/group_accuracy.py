"""int8w's group size against accuracy on real weights, on any CPU: the lanes8 path's numbers emulated in torch.

lanes8 (AVX-512 VNNI, AMX) rounds each activation row to int8 per group of inputs (scale absmax / 127) and sums
each group of int8 x int8 products exactly in int32; the group's sum times the weights' float16 scale times the
row's scale adds to the output. This runs those steps with torch (the integer sums exact in float32: at most
64 * 127 * 127 < 2^24) on every linear of the model, LM head included, and compares the logits with the float32
model's on the profile's evaluation text (mvllm.profile.accuracy: teacher-forced, mean KL and top-1), at each
group size asked for. Where this machine has no AVX-512, it is how lanes8's accuracy is measured here.

    python experiments/group_accuracy.py [--model smollm2-135m] [--groups 32,64] [--out FILE]

A setting may give some linears (by their name in the model) a group of their own: --groups 32,32:gate_proj=64:up_proj=64
is groups of 32 everywhere, then the same with the MLP's gate and up projections at 64.
"""

from __future__ import annotations

import argparse
import json

import torch
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


def swap(module: nn.Module, group: int, by_name: dict[str, int]) -> None:
    for name, child in module.named_children():
        g = by_name.get(name, group)
        if isinstance(child, nn.Linear) and child.in_features % g == 0:
            setattr(module, name, Lanes8Emulated(child, g))
        else:
            swap(child, group, by_name)


def parse(setting: str) -> tuple[int, dict[str, int]]:
    """"32:gate_proj=64" -> (32, {"gate_proj": 64})."""
    first, *rest = setting.split(":")
    return int(first), {k: int(v) for k, v in (r.split("=") for r in rest)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--groups", default="32,64")
    ap.add_argument("--out")
    a = ap.parse_args()
    source = resolve(a.model)
    ref = accuracy.Reference(source)
    cpu = torch.device("cpu")
    out = {"model": a.model, "tokens": len(ref.ids), "what": "lanes8's numbers emulated in torch, teacher-forced "
           "over mvllm/data/eval.txt in one forward, against float32; a linear whose inputs are not a multiple of the "
           "group stays float32", "command": f"python experiments/group_accuracy.py --groups {a.groups}",
           "environment": environment(a.model), "groups": {}}
    for setting in a.groups.split(","):
        group, by_name = parse(setting)
        model = build_model(source, cpu, torch.float32)
        quant._untie(model)  # the LM head quantized too, as int8w does
        swap(model, group, by_name)
        with torch.inference_mode():
            got = accuracy.compare(ref.logits, accuracy.logits(model, ref.ids, cpu, torch.float32))
        out["groups"][setting] = got
        print(f"group {setting}: mean KL {got['kl_mean']:.5f}, max {got['kl_max']:.3f}, top-1 {got['top1']:.2%}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
