"""The Llama-family decoder (Llama, Qwen2, SmolLM2): GQA, RoPE, RMSNorm, SwiGLU, fused projections."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mvllm.errors import UnsupportedModelError
from mvllm.kernels import triton_ops  # noqa: F401 - registers mvllm::silu_mul and mvllm::linear
from mvllm.model.attention import AttnMeta, paged_attention
from mvllm.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """On the CPU, also where the model is built on the meta device (there torch's ops run Python reference
    kernels, whose first call imports torch._dynamo: results/server-start)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    s = cfg.rope_scaling
    if not s:
        return inv
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return inv / s["factor"]
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv = rope_inv_freq(cfg)
        freqs = torch.outer(torch.arange(cfg.max_position, dtype=torch.float32, device=inv.device), inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] for the positions of one forward pass, shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def rotate(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [T, heads, D]: queries and keys rotated together, in one pass."""
    cos, sin = rope
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.scale = self.head_dim ** -0.5

    def forward(self, x, rope, cache: torch.Tensor, meta: AttnMeta):
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = rotate(qk.view(-1, self.heads + self.kv_heads, self.head_dim), rope)
        q, k = qk.split([self.heads, self.kv_heads], dim=1)
        v = v.view(-1, self.kv_heads, self.head_dim)
        return self.o_proj(paged_attention(q, k, v, cache, meta, self.scale))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.folded = False  # the norms' weights multiplied into qkv_proj and gate_up_proj (triton_ops.fold_norms)

    def forward(self, x, rope, cache, meta):
        if meta.layout == "table":
            return self._table(x, rope, cache, meta)
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def _table(self, x, rope, cache, meta):
        """The GPU's compiled layer: rotary with the cache write (and the QKV bias) in one kernel, attention
        through the block table in one. Folded (kernels/triton_ops.py): no norm kernels, the kernels after qkv_proj
        and gate_up_proj scale each row by its RMSNorm rstd, the residual adds happen inside o_proj and
        down_proj, and these three take mvllm's small-row GEMM. Unfolded (any Linear, CPU-packed too): the
        norms and the rest as modules."""
        attn, ops = self.self_attn, torch.ops.mvllm
        if not self.folded:
            q = ops.rope_store(attn.qkv_proj(self.input_layernorm(x)), *rope, cache, meta.packed, attn.heads,
                               attn.kv_heads)
            x = x + attn.o_proj(ops.table_attention(q, cache, meta.packed, meta.tables, meta.block_size, attn.scale))
            return x + self.mlp(self.post_attention_layernorm(x))
        qkv = ops.linear(x, attn.qkv_proj.weight)
        q = ops.rope_store(qkv, *rope, cache, meta.packed, attn.heads, attn.kv_heads, attn.qkv_proj.bias, x,
                           self.input_layernorm.eps)
        out = ops.table_attention(q, cache, meta.packed, meta.tables, meta.block_size, attn.scale)
        x = ops.linear(out, attn.o_proj.weight, attn.o_proj.bias, x)
        h = ops.silu_mul(F.linear(x, self.mlp.gate_up_proj.weight), x, self.post_attention_layernorm.eps)
        return ops.linear(h, self.mlp.down_proj.weight, None, x)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # its weight given, not drawn: the model is built on the meta device and its weights loaded after, and
        # nn.Embedding's normal_ on meta runs a Python reference kernel that imports torch._dynamo (results/server-start)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor],
                meta: AttnMeta) -> torch.Tensor:
        if meta.layout == "fused":
            from mvllm.model import cpu_forward

            return cpu_forward.forward(self, input_ids, positions, caches, meta)
        x = self.embed_tokens(input_ids)
        # "table": the rotary kernel reads each token's row of the whole tables itself
        rope = (self.rotary.cos, self.rotary.sin) if meta.layout == "table" else self.rotary.at(positions, x.dtype)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, rope, cache, meta)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face parameter names, fusing q/k/v and gate/up."""
        get = lambda name: tensors.pop(name)  # noqa: E731
        with torch.no_grad():
            self.embed_tokens.weight.copy_(get("model.embed_tokens.weight"))
            self.norm.weight.copy_(get("model.norm.weight"))
            head = tensors.pop("lm_head.weight", None)
            if not self.cfg.tie_word_embeddings:
                self.lm_head.weight.copy_(head if head is not None else self.embed_tokens.weight)
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                attn = layer.self_attn
                attn.qkv_proj.weight.copy_(torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]))
                if attn.qkv_proj.bias is not None:
                    attn.qkv_proj.bias.copy_(torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                attn.o_proj.weight.copy_(get(p + "self_attn.o_proj.weight"))
                if attn.o_proj.bias is not None:
                    attn.o_proj.bias.copy_(get(p + "self_attn.o_proj.bias"))
                layer.mlp.gate_up_proj.weight.copy_(
                    torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]))
                layer.mlp.down_proj.weight.copy_(get(p + "mlp.down_proj.weight"))
                layer.input_layernorm.weight.copy_(get(p + "input_layernorm.weight"))
                layer.post_attention_layernorm.weight.copy_(get(p + "post_attention_layernorm.weight"))
        unused = [k for k in tensors if k.startswith("model.layers.") or k.endswith(("_proj.weight", "_proj.bias"))]
        if unused:
            raise UnsupportedModelError(f"the weights hold tensors this decoder does not use: {', '.join(unused[:3])}")
