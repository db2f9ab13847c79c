"""Attention over the paged KV cache.

The cache of one layer is a tensor [2, num_slots, kv_heads, head_dim]; slot = block * block_size + offset.
A batch is flattened to T tokens; `AttnMeta` says where each new token's K/V goes and which slots each
sequence reads, so one code path serves prefill, decode and a mix of both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttnMeta:
    slot_mapping: torch.Tensor  # [T] slot written by each new token
    gather_index: torch.Tensor  # [B, Lk] slots read by each sequence (padding masked out)
    q_index: torch.Tensor  # [B, Lq] row of each sequence's queries in the flat batch (T = padding row)
    out_index: torch.Tensor  # [T] row of each flat token in the padded [B * Lq] output
    mask: torch.Tensor  # [B, 1, Lq, Lk] True where a query may attend
    decode_only: bool = False


def build_meta(seqs_positions: list[tuple[int, int]], block_tables: list[list[int]], block_size: int,
               device: torch.device) -> AttnMeta:
    """seqs_positions: per sequence (start, end) of the tokens computed now; keys cover [0, end)."""
    lq = max(e - s for s, e in seqs_positions)
    lk = max(e for _, e in seqs_positions)
    slot_mapping, q_rows, out_rows, gathers, starts, ends = [], [], [], [], [], []
    t = 0
    total = sum(e - s for s, e in seqs_positions)
    for b, ((start, end), table) in enumerate(zip(seqs_positions, block_tables)):
        n = end - start
        slots = [table[p // block_size] * block_size + p % block_size for p in range(end)]
        slot_mapping.extend(slots[start:end])
        gathers.append(slots + [0] * (lk - end))
        q_rows.append(list(range(t, t + n)) + [total] * (lq - n))
        out_rows.extend(range(b * lq, b * lq + n))
        starts.append(start)
        ends.append(end)
        t += n
    starts_t = torch.tensor(starts).view(-1, 1, 1)
    ends_t = torch.tensor(ends).view(-1, 1, 1)
    qpos = starts_t + torch.arange(lq).view(1, -1, 1)
    kpos = torch.arange(lk).view(1, 1, -1)
    mask = (kpos <= qpos) & (kpos < ends_t)
    mask[:, :, 0] = True  # padded query rows attend to slot 0 rather than to nothing (no NaN)
    as_long = dict(dtype=torch.long, device=device)
    return AttnMeta(
        slot_mapping=torch.tensor(slot_mapping, **as_long),
        gather_index=torch.tensor(gathers, **as_long),
        q_index=torch.tensor(q_rows, **as_long),
        out_index=torch.tensor(out_rows, **as_long),
        mask=mask.unsqueeze(1).to(device),
        decode_only=lq == 1,
    )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttnMeta, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for the new tokens; returns [T, H * D]."""
    cache[0].index_copy_(0, meta.slot_mapping, k)
    cache[1].index_copy_(0, meta.slot_mapping, v)
    keys = cache[0][meta.gather_index].transpose(1, 2)  # [B, Hkv, Lk, D]
    values = cache[1][meta.gather_index].transpose(1, 2)
    if meta.decode_only:
        queries = q.unsqueeze(2)  # [B, H, 1, D]
    else:
        padded = torch.cat([q, q.new_zeros(1, *q.shape[1:])])
        queries = padded[meta.q_index].transpose(1, 2)  # [B, H, Lq, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask, scale=scale,
                                         enable_gqa=True)
    b, h, lq, d = out.shape
    out = out.transpose(1, 2).reshape(b * lq, h * d)
    return out if meta.decode_only else out[meta.out_index]
