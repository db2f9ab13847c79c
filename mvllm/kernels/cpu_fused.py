"""Fused float32 CPU kernels for a decoder layer's non-matmul work (csrc/fused.cpp): with them a layer is
about 9 calls (norm, qkv matmul, rope_store, paged_attention, o matmul, norm, gate_up matmul, silu_mul,
down matmul) instead of ~40 small torch ops plus a copy of the paged KV context before attention.

Built on first use by kernels/build.py and cached, like cpu_kernels. `available()` never raises: when the build
fails it returns False and `why_unavailable` says why (one line: the compiler's first error); the wrappers then
run the `reference_*` versions (plain torch ops, the specification of each kernel's semantics, used by the
tests). `build_info()`: build.status("fused"), the flags it built with and whether with OpenMP (without
it at::parallel_for runs on one thread), or its error.

Shapes (T tokens of a flattened batch, D head_dim, all float32 and contiguous):
- add_rms_norm(x [T, hidden], residual [T, hidden] or None, weight [hidden], eps) -> (normed, residual_out)
- rope_store(qkv [T, (heads + 2 * kv_heads) * D], cos [T, D], sin [T, D], cache [2, slots, kv_heads, D],
  slots int64 [T], heads, kv_heads) -> q [T, heads, D]
- paged_attention(q [T, heads, D], cache, block_table int32/int64 [B, max_blocks], seq_of_token int64 [T],
  key_len int64 [T], block_size, scale) -> [T, heads * D]; a row with fewer keys than another of its sequence (a
  prefill's rows but its newest), or every row where the lanes are 8 wide, takes the lanes path
  (attention_knob "lanes"), the rest one (token, kv head) at a time
- silu_mul(gate_up [T, 2 * I]) -> [T, I]
- argmax(x [rows, n]) -> int64 [rows]: torch.argmax(x, -1) (first index of the largest; a NaN counts as
  largest), in vector code: torch's is slow on one vocabulary-sized row
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mvllm.kernels import build

why_unavailable = ""
_ops = None


def _load():
    build.build("mvllm_fused", "fused.cpp")
    return torch.ops.mvllm_fused


@functools.cache
def available() -> bool:
    global _ops, why_unavailable
    _ops, why_unavailable = build.attempt(_load)
    return _ops is not None


def build_info() -> dict:
    """How the kernels built in this process (build.status): builds nothing; call available() first."""
    return build.status("fused")


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(r) * weight, r) with r = residual + x, added into `residual` in place; r = x without one."""
    if not available():
        return reference_add_rms_norm(x, residual, weight, eps)
    return _ops.add_rms_norm(x, residual, weight, eps), (x if residual is None else residual)


def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
               heads: int, kv_heads: int) -> torch.Tensor:
    """Rotated q [T, heads, D]; rotated k and v written into cache[0] and cache[1] at `slots`."""
    if not available():
        return reference_rope_store(qkv, cos, sin, cache, slots, heads, kv_heads)
    return _ops.rope_store(qkv, cos, sin, cache, slots, heads, kv_heads)


def paged_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_of_token: torch.Tensor,
                    key_len: torch.Tensor, block_size: int, scale: float, check: bool = False) -> torch.Tensor:
    """[T, heads * D]: token t attends to key positions [0, key_len[t]) of block_table[seq_of_token[t]].
    check: validate key_len and the block ids in Python first (ValueError). The engine's inputs are valid by
    construction and skip it; the C++ op's own checks crashed the process instead of raising on one machine
    (torch 2.11 with the extension built by g++ 13)."""
    if check:
        check_attention_inputs(cache, block_table, seq_of_token, key_len, block_size)
    if not available():
        return reference_paged_attention(q, cache, block_table, seq_of_token, key_len, block_size, scale)
    return _ops.paged_attention(q, cache, block_table, seq_of_token, key_len, block_size, scale)


def attention_knob(name: str, value: int) -> int:
    """Set paged_attention's knob in this process, for tests and same-process comparisons; the previous value back.
    "lanes" (MVLLM_ATTN_LANES), the only one: which rows take the lanes path, query rows in vector lanes: 0 none, 1
    a prefill's rows but its newest (the default with AVX-512), 2 every row (the default where the lanes are 8 wide:
    AVX2, NEON). Needs the build: call available() first."""
    return int(_ops.attention_knob(name, int(value)))


def check_attention_inputs(cache, block_table, seq_of_token, key_len, block_size: int) -> None:
    if seq_of_token.numel() and not 0 <= int(seq_of_token.min()) <= int(seq_of_token.max()) < block_table.shape[0]:
        raise ValueError("seq_of_token names a row outside block_table")
    if key_len.numel() and (int(key_len.min()) < 1 or int(key_len.max()) > block_table.shape[1] * block_size):
        raise ValueError("key_len must be between 1 and the block_table's width in slots")
    blocks = (cache.shape[1] - 1) // block_size
    for t in range(key_len.numel()):
        used = block_table[int(seq_of_token[t]), : -(-int(key_len[t]) // block_size)]
        if used.numel() and not 0 <= int(used.min()) <= int(used.max()) < blocks:
            raise ValueError(f"block_table holds a block id outside the cache's {blocks} blocks")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = gate | up [T, 2 * I]."""
    if not available():
        return reference_silu_mul(gate_up)
    return _ops.silu_mul(gate_up)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of float32 logits [rows, n]."""
    if not available():
        return x.argmax(dim=-1)
    return _ops.argmax(x.contiguous())


# ---- reference versions: plain torch, the semantics the kernels implement ----

def reference_add_rms_norm(x, residual, weight, eps):
    r = x if residual is None else residual.add_(x)
    return weight * (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + eps)), r


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def reference_rope_store(qkv, cos, sin, cache, slots, heads, kv_heads):
    t = qkv.shape[0]
    q, k, v = qkv.view(t, heads + 2 * kv_heads, -1).split([heads, kv_heads, kv_heads], dim=1)
    cos, sin = cos.reshape(t, 1, -1), sin.reshape(t, 1, -1)
    cache[0].index_copy_(0, slots, _rotate(k, cos, sin))
    cache[1].index_copy_(0, slots, v)
    return _rotate(q, cos, sin).contiguous()


def reference_paged_attention(q, cache, block_table, seq_of_token, key_len, block_size, scale):
    """Gathers each token's keys and values and runs softmax attention in float64."""
    t, heads, d = q.shape
    group = heads // cache.shape[2]
    out = torch.empty(t, heads, d, dtype=torch.float64)
    for i in range(t):
        pos = torch.arange(int(key_len[i]))
        slots = block_table[int(seq_of_token[i])].long()[pos // block_size] * block_size + pos % block_size
        k, v = (c[slots].double().repeat_interleave(group, dim=1).transpose(0, 1) for c in cache)  # [H, L, D]
        p = torch.softmax((k @ q[i].double().unsqueeze(-1)).squeeze(-1) * scale, dim=-1)  # [H, L]
        out[i] = (p.unsqueeze(1) @ v).squeeze(1)
    return out.view(t, heads * d).float()


def reference_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
