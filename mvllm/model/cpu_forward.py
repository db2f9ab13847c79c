"""The decoder's forward on the CPU in float32 through mvllm's fused kernels (kernels/cpu_fused.py).

One layer is nine calls: residual add + RMSNorm, QKV projection, RoPE + KV-cache write, attention read
straight from the paged cache through the block table (no copy of the context), O projection, residual add +
RMSNorm, gate/up projection, SiLU * up, down projection. Same arithmetic as Decoder.forward, fewer ops:
on a CPU most of a decode step was per-op overhead and context copies, not matrix work. An int8w model
(engine/quant.py) carries `cpu_layers`: the same loop in C++ (kernels/cpu_layers.py), for the batch sizes where
every linear takes the int8 kernel. With meta.out_rows (the rows the LM head reads: each prefill's last token) the
last layer computes only those rows past its KV-cache write, as llama.cpp does, and only they are returned.
"""

from __future__ import annotations

import torch

from mvllm.kernels import cpu_fused
from mvllm.model.attention import AttnMeta


def forward(model, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
            meta: AttnMeta) -> torch.Tensor:
    cfg = model.cfg
    x = model.embed_tokens(input_ids)
    cos, sin = model.rotary.cos[positions], model.rotary.sin[positions]
    layers = getattr(model, "cpu_layers", None)
    rows = meta.out_rows
    if layers is not None and layers.serves(x.shape[0]):
        return layers.forward(model, x, cos, sin, caches, meta)  # with out_rows: those rows only
    residual, token_seq, key_len, last = None, meta.token_seq, meta.key_len, len(model.layers) - 1
    for i, (layer, cache) in enumerate(zip(model.layers, caches)):
        attn, mlp = layer.self_attn, layer.mlp
        h, residual = cpu_fused.add_rms_norm(x, residual, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q = cpu_fused.rope_store(attn.qkv_proj(h), cos, sin, cache, meta.slot_mapping, attn.heads, attn.kv_heads)
        if i == last and rows is not None:  # past the last KV write only the returned rows count (a prefill's last)
            q, residual, token_seq, key_len = q[rows], residual[rows], token_seq[rows], key_len[rows]
        out = cpu_fused.paged_attention(q, cache, meta.block_index, token_seq, key_len, meta.block_size,
                                        attn.scale)
        h, residual = cpu_fused.add_rms_norm(attn.o_proj(out), residual, layer.post_attention_layernorm.weight,
                                             cfg.rms_norm_eps)
        x = mlp.down_proj(cpu_fused.silu_mul(mlp.gate_up_proj(h)))
    return cpu_fused.add_rms_norm(x, residual, model.norm.weight, cfg.rms_norm_eps)[0]
