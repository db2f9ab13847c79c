"""Attention over the paged KV cache.

The cache of one layer is a tensor [2, num_slots, kv_heads, head_dim]; slot = block * block_size + offset.
A batch is flattened to T tokens; `AttnMeta` says where each new token's K/V goes and which slots each
query reads. These layouts share one entry point:
- "causal": every sequence starts cold; each attends to its own new K/V with is_causal SDPA (no gather);
- "rows": one query row per token (decode, and the CUDA-graph path for any small batch): row t reads
  gather_index[t] under mask[t];
- "paged": the general case (a cached prefix, mixed lengths): queries padded to [B, Lq];
- "fused": the CPU float32 kernels (kernels/cpu_fused.py): each token reads its keys from the paged cache;
- "table": the same per-token layout for the GPU's compiled path; the decoder calls its two ops itself
  (rotary with the cache write, then attention: kernels/triton_attention.py).
On CPU, "rows" and "paged" read whole blocks (`block_index`, one contiguous copy per block) instead of
gathering slot by slot, which costs 2-3x more there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mvllm.kernels import triton_attention  # registers mvllm::rope_store and mvllm::triton_attention


@dataclass(slots=True)
class AttnMeta:
    slot_mapping: torch.Tensor  # [T] slot written by each new token
    gather_index: torch.Tensor | None = None  # [B, Lk] slots read by each query group (padding masked out)
    q_index: torch.Tensor | None = None  # paged: [B, Lq] row of each query in the flat batch (T = padding)
    out_index: torch.Tensor | None = None  # paged: [T] row of each flat token in the padded [B * Lq] output
    mask: torch.Tensor | None = None  # [B, 1, Lq, Lk] True where a query may attend; None: all
    layout: str = "paged"
    lengths: list[int] | None = None  # causal: new tokens per sequence
    block_index: torch.Tensor | None = None  # on CPU: [B, width] blocks read, replacing gather_index
    block_size: int = 0  # with block_index
    keys_len: int = 0  # with block_index: Lk
    token_seq: torch.Tensor | None = None  # fused: [T] row of block_index each token belongs to
    key_len: torch.Tensor | None = None  # fused: [T] keys each token attends to (its position + 1)
    packed: torch.Tensor | None = None  # table: [T, 6] token id, position, slot, key length, row in tables, work
    tables: torch.Tensor | None = None  # table: [sequences, W] each sequence's block table
    out_rows: torch.Tensor | None = None  # fused: the rows whose hidden state is returned (None: all)


def build_meta(seqs_positions: list[tuple[int, int]], block_tables: list[list[int]], block_size: int,
               device: torch.device, layout: str = "") -> AttnMeta:
    """seqs_positions: per sequence (start, end) of the tokens computed now; keys cover [0, end).
    layout "fused" or "table": every token reads the paged cache itself through its block table;
    otherwise the layout that fits the batch."""
    if layout == "fused":  # the CPU kernels' layout
        return fused_meta(seqs_positions, block_tables, block_size)
    starts = torch.tensor([s for s, _ in seqs_positions])
    ends = torch.tensor([e for _, e in seqs_positions])
    counts = ends - starts
    width = max(len(t) for t in block_tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables])
    slots = (tables.unsqueeze(-1) * block_size + torch.arange(block_size)).flatten(1)  # [B, width * bs]
    new = torch.arange(int(counts.max())).unsqueeze(0)
    valid = new < counts.unsqueeze(1)
    slot_mapping = slots.gather(1, (starts.unsqueeze(1) + new).clamp(max=slots.shape[1] - 1))[valid]
    as_long = dict(dtype=torch.long, device=device)
    if layout == "table":
        token_seq = torch.arange(len(counts)).repeat_interleave(counts)
        key_len = (starts.unsqueeze(1) + new + 1)[valid]
        packed = triton_attention.pack_rows(key_len - 1, slot_mapping, key_len, token_seq, counts.tolist())
        return AttnMeta(slot_mapping.to(**as_long), layout=layout, block_size=block_size, packed=packed.to(**as_long),
                        tables=tables.to(**as_long))
    if not bool(starts.any()):
        return AttnMeta(slot_mapping.to(**as_long), layout="causal", lengths=counts.tolist())
    lk = int(ends.max())
    cpu = device.type == "cpu"  # whole blocks: one contiguous copy per block instead of one per slot
    blocks = dict(block_index=tables, block_size=block_size, keys_len=lk)
    kpos = torch.arange(lk).view(1, 1, -1)
    if bool((counts == 1).all()):
        mask = None if bool((ends == lk).all()) else (kpos < ends.view(-1, 1, 1)).unsqueeze(1).to(device)
        if cpu:
            return AttnMeta(slot_mapping, mask=mask, layout="rows", **blocks)
        return AttnMeta(slot_mapping.to(**as_long), slots[:, :lk].to(**as_long), mask=mask, layout="rows")
    lq, total = int(counts.max()), int(counts.sum())
    first = torch.cumsum(counts, 0) - counts
    q_index = torch.where(valid, first.unsqueeze(1) + new, total)
    out_index = (torch.arange(len(counts)).unsqueeze(1) * lq + new)[valid]
    qpos = starts.view(-1, 1, 1) + new.view(1, -1, 1)
    mask = (kpos <= qpos) & (kpos < ends.view(-1, 1, 1))
    mask[:, :, 0] = True  # padded query rows attend to slot 0 rather than to nothing (no NaN)
    gather = None if cpu else slots[:, :lk].to(**as_long)
    return AttnMeta(slot_mapping.to(**as_long), gather, q_index.to(**as_long), out_index.to(**as_long),
                    mask.unsqueeze(1).to(device), "paged", **(blocks if cpu else {}))


def fused_meta(seqs_positions: list[tuple[int, int]], block_tables: list[list[int]], block_size: int) -> AttnMeta:
    """The "fused" layout (CPU tensors) from Python lists and one tensor, of which the fields are views: a dozen
    small tensor ops cost a CPU decode step measurably more, its caches cold from streaming the weights
    (results/profile/README.md)."""
    slots, seq_of, key_len = [], [], []
    for row, ((start, end), table) in enumerate(zip(seqs_positions, block_tables)):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        seq_of += [row] * (end - start)
        key_len += range(start + 1, end + 1)
    width = max(len(t) for t in block_tables)
    flat = [*slots, *seq_of, *key_len]
    for t in block_tables:
        flat += t + [0] * (width - len(t))
    n = len(slots)
    packed = torch.tensor(flat, dtype=torch.long)
    return AttnMeta(packed[:n], layout="fused", block_index=packed[3 * n:].view(len(block_tables), width),
                    block_size=block_size, token_seq=packed[n:2 * n], key_len=packed[2 * n:3 * n])


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttnMeta, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] for the new tokens; returns [T, H * D]. (Not the "table" layout.)"""
    cache[0].index_copy_(0, meta.slot_mapping, k)
    cache[1].index_copy_(0, meta.slot_mapping, v)
    t, h, d = q.shape
    if meta.layout == "causal":
        outs = []
        for qs, ks, vs in zip(*(x.split(meta.lengths) for x in (q, k, v))):
            qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (qs, ks, vs))  # [1, heads, L, D]
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out[0].transpose(0, 1).reshape(t, h * d)
    if meta.block_index is not None:
        keys, values = _gather_blocks(cache, meta)
    else:
        keys, values = cache[:, meta.gather_index].transpose(2, 3).unbind(0)  # [B, Hkv, Lk, D] each
    if meta.layout == "rows":  # a row's query heads grouped by their KV head: no GQA expansion
        hkv = keys.shape[1]
        out = F.scaled_dot_product_attention(q.view(t, hkv, h // hkv, d), keys, values, attn_mask=meta.mask,
                                             scale=scale)
        return out.reshape(t, h * d)
    padded = torch.cat([q, q.new_zeros(1, h, d)])
    queries = padded[meta.q_index].transpose(1, 2)  # [B, H, Lq, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=True)
    b, _, lq, _ = out.shape
    return out.transpose(1, 2).reshape(b * lq, h * d)[meta.out_index]


def _gather_blocks(cache: torch.Tensor, meta: AttnMeta) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B, Hkv, Lk, D] of each row, copied block by block."""
    _, slots, hkv, d = cache.shape
    bs, (b, width), index = meta.block_size, meta.block_index.shape, meta.block_index.flatten()
    n = slots - slots % bs  # drops the scratch slot
    return tuple(c[:n].view(-1, bs * hkv * d).index_select(0, index).view(b, width * bs, hkv, d)[:, :meta.keys_len]
                 .transpose(1, 2) for c in cache.unbind(0))
