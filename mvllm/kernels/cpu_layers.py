"""The int8w decoder's layer loop in C++ (csrc/layers.cpp): the same fused and int8 kernels as
model/cpu_forward.py's Python loop, in the same order, called directly, so a decode step pays no Python and no
dispatcher between its ~220 ops. Steps of up to 64 tokens (decode, a warm prefill; weights in the lanes layouts or
[out, in], the portable path's) run their layers in one team of threads that meet at spin barriers (one OpenMP
region a step, not one an op), the waiting threads prefetching their share of the next linear's weights; a last
layer that trims its rows (out_rows: a prefill's last row past the KV write) does so in the team too.
`knob("team", 0)` (MVLLM_TEAM=0) keeps a region an op. Results are bitwise those of the Python loop either way
(tests/test_cpu_layers.py).

`Layers.of(model)` (engine/quant.py, for int8w) packs each layer's weights once; `forward` runs them for
batches of at most `max_rows` tokens, the smallest `kernel_rows` of the model's int8 linears (above it an
Int8Linear takes its GEMM, in Python). Built on first use and cached like the other kernels;
`available()` never raises, and without the build the Python loop runs. ENABLED = False forces the Python
loop (for same-run comparisons: experiments/probes/cpu_step_ops.py --python-loop).
"""

from __future__ import annotations

import functools

import torch

from mvllm.kernels import build, cpu_fused, cpu_int8

ENABLED = True
why_unavailable = ""
_op = None


def _load():
    if not (cpu_fused.available() and cpu_int8.available()):
        raise RuntimeError("the fused or int8 CPU kernels did not build")
    build.build("mvllm_layers", "layers.cpp")
    return torch.ops.mvllm_layers.decode_layers


@functools.cache
def available() -> bool:
    global _op, why_unavailable
    _op, why_unavailable = build.attempt(_load)
    return _op is not None


class Layers:
    """A decoder's int8w weights, flat in csrc/layers.cpp's order, and the batch size they serve."""

    def __init__(self, weights: list[torch.Tensor | None], final_norm: torch.Tensor, max_rows: float):
        self.weights, self.final_norm, self.max_rows = weights, final_norm, max_rows

    @classmethod
    def of(cls, model) -> Layers | None:
        """None where a layer's linears are not all int8 (q, scales, bias, kernel_rows) modules."""
        weights, max_rows = [], float("inf")
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(hasattr(m, "q") and hasattr(m, "kernel_rows") for m in linears):
                return None
            max_rows = min(max_rows, *(m.kernel_rows for m in linears))
            if mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
                return None
            weights += [layer.input_layernorm.weight, attn.qkv_proj.q, attn.qkv_proj.scales, attn.qkv_proj.bias,
                        attn.o_proj.q, attn.o_proj.scales, attn.o_proj.bias, layer.post_attention_layernorm.weight,
                        mlp.gate_up_proj.q, mlp.gate_up_proj.scales, mlp.down_proj.q, mlp.down_proj.scales]
        return cls([w.detach() if w is not None else None for w in weights], model.norm.weight.detach(), max_rows)

    def serves(self, rows: int) -> bool:
        return ENABLED and rows <= self.max_rows and available()

    def forward(self, model, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, caches: list[torch.Tensor],
                meta) -> torch.Tensor:
        cfg, attn = model.cfg, model.layers[0].self_attn
        return _op(x, self.weights, caches, self.final_norm, cos, sin, meta.slot_mapping,
                   meta.block_index, meta.token_seq, meta.key_len, meta.block_size, attn.scale, attn.heads,
                   attn.kv_heads, cfg.rms_norm_eps, meta.out_rows)


def knob(name: str, value: int) -> int:
    """Set the layer loop's knob in this process, for tests and same-process comparisons; the previous value back.
    "team": 1 runs steps of up to 64 tokens in one team of threads (MVLLM_TEAM, default 1), 0 a region an op.
    "times": 1 records the team's phase times (team_times), 0 (the default) does not."""
    if not available():
        raise RuntimeError(f"no C++ layer loop here: {why_unavailable}")
    return torch.ops.mvllm_layers.knob(name, value)


def team_calls() -> int:
    """Steps this process ran (wholly, or but their last layer) in one team of threads."""
    return torch.ops.mvllm_layers.team_calls() if available() else 0


PHASES = ("norm+round", "qkv", "rope", "attention", "round o", "o", "norm+round 2", "gate_up", "silu+round", "down")


def team_times() -> dict[str, tuple[float, float, float]]:
    """The team's phases since the last call (knob "times" 1 records them), summed over layers and steps, in ms:
    (wall, the threads' summed work before the phase's barrier, the slowest thread's). The counters are cleared."""
    return {name: tuple(row) for name, row in zip(PHASES, torch.ops.mvllm_layers.team_times().tolist())}
