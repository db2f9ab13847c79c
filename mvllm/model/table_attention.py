"""Attention that reads K/V straight from the paged cache through each token's block table (no gather).

One custom op, `mvllm::table_attention`, writes the new tokens' K/V into their slots, then lets every new
token attend to the first `key_len[t]` keys of its sequence, found through `tables[token_seq[t]]`. A token
of a sequence computed several tokens at a time sees the keys up to its own position, so one layout serves
decode, warm-prefix prefill and mixed steps. On CUDA with Triton the attention is one kernel: a program per
(token, KV head) holds that head's group of query heads and streams the keys block by block with an online
softmax; when few tokens would leave the GPU idle (decode), each token's keys are split over several
programs and a second kernel merges their partial sums (flash-decoding). Elsewhere (and as the reference in tests) it runs in plain PyTorch. torch.compile sees the op as
one opaque call that mutates the cache, so the rest of the layer fuses around it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton
    triton = None


def available(device: torch.device) -> bool:
    """Triton is installed and the GPU has bf16 tensor cores (compute capability 8.0, Ampere, or newer);
    elsewhere the GPU backend runs its plain path."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


@torch.library.custom_op("mvllm::table_attention", mutates_args=("cache",))
def table_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    slots: torch.Tensor, tables: torch.Tensor, token_seq: torch.Tensor, key_len: torch.Tensor,
                    block_size: int, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D], cache [2, slots, Hkv, D], tables [B, W], token_seq/key_len [T]
    (any strides: under torch.compile they are columns of the step's packed input); returns [T, H * D]."""
    cache[0].index_copy_(0, slots, k)
    cache[1].index_copy_(0, slots, v)
    if q.is_cuda and triton is not None:
        return _triton(q, cache, tables, token_seq, key_len, block_size, scale)
    return reference(q, cache, tables, token_seq, key_len, block_size, scale)


@table_attention.register_fake
def _(q, k, v, cache, slots, tables, token_seq, key_len, block_size, scale):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def reference(q, cache, tables, token_seq, key_len, block_size: int, scale: float) -> torch.Tensor:
    """The same attention in PyTorch: each token's keys gathered slot by slot, masked past key_len."""
    t, h, d = q.shape
    width = tables.shape[1] * block_size
    slots = (tables[token_seq].unsqueeze(-1) * block_size + torch.arange(block_size, device=q.device))
    slots = slots.view(t, width)
    keys, values = cache[:, slots].transpose(2, 3).unbind(0)  # [T, Hkv, width, D]
    hkv = keys.shape[1]
    mask = (torch.arange(width, device=q.device) < key_len.unsqueeze(1)).view(t, 1, 1, width)
    out = F.scaled_dot_product_attention(q.view(t, hkv, h // hkv, d), keys, values, attn_mask=mask, scale=scale)
    return out.reshape(t, h * d)


def _triton(q, cache, tables, token_seq, key_len, block_size: int, scale: float,
            splits: int | None = None) -> torch.Tensor:
    t, h, d = q.shape
    hkv = cache.shape[2]
    group = h // hkv
    splits = splits or _splits(t * hkv, q.device)
    out = q.new_empty(t, h, d)
    part = dict(acc=out, m=out, l=out)  # unused when one split writes the output itself
    if splits > 1:
        part = dict(acc=q.new_empty(t, splits, h, d, dtype=torch.float32),
                    m=q.new_empty(t, splits, h, dtype=torch.float32), l=q.new_empty(t, splits, h, dtype=torch.float32))
    _rows_kernel[(t, hkv, splits)](
        q, cache, out, part["acc"], part["m"], part["l"], tables, token_seq, key_len, scale,
        q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), tables.stride(0),
        token_seq.stride(0), key_len.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK=block_size,
        BLOCK_N=max(64, block_size), SPLITS=splits, IEEE=q.dtype == torch.float32)
    if splits > 1:
        _combine_kernel[(t, h)](part["acc"], part["m"], part["l"], out, out.stride(0), out.stride(1), H=h, D=d,
                                SPLITS=splits)
    return out.view(t, h * d)


def _splits(programs: int, device: torch.device) -> int:
    """Split each token's keys over this many programs when few tokens would leave the GPU idle (decode):
    about two programs per multiprocessor, a power of two, at most 64."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = 2 * sms // programs
    return 1 if want < 2 else min(64, 1 << (want.bit_length() - 1))


if triton is not None:
    @triton.jit
    def _rows_kernel(q_ptr, cache_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, tables_ptr, seq_ptr, len_ptr, scale,
                     sq_t, sq_h, sc_kv, sc_slot, sc_h, s_table, s_seq, s_len, so_t, so_h,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                     BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr):
        """Program (token, KV head, split): the split's share of the token's keys, for the KV head's group
        of query heads. One split writes the output; several write partial sums for _combine_kernel."""
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        n = tl.load(len_ptr + row * s_len)
        chunk = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n)
        table = tables_ptr + tl.load(seq_ptr + row * s_seq) * s_table
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + row * sq_t + heads[:, None] * sq_h + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            valid = j < hi
            block = tl.load(table + j // BLOCK, mask=valid, other=0)
            at = (block * BLOCK + j % BLOCK)[:, None] * sc_slot + kvh * sc_h + d[None, :]
            keys = tl.load(cache_ptr + at, mask=valid[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(keys)) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            values = tl.load(cache_ptr + sc_kv + at, mask=valid[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
            total = total * alpha + tl.sum(p, 1)
            m = m_new
        mask = (g < GROUP)[:, None]
        if SPLITS == 1:
            tl.store(out_ptr + row * so_t + heads[:, None] * so_h + d[None, :],
                     (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            H = GROUP * tl.num_programs(1)
            at = (row * SPLITS + split) * H + heads
            tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=mask)
            tl.store(m_ptr + at, m, mask=g < GROUP)
            tl.store(l_ptr + at, total, mask=g < GROUP)

    @triton.jit
    def _combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, so_t, so_h, H: tl.constexpr, D: tl.constexpr,
                        SPLITS: tl.constexpr):
        """Program (token, query head): the splits' partial softmax sums merged into the output."""
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        at = (row * SPLITS + s) * H + head
        m = tl.load(m_ptr + at)
        weight = tl.exp(m - tl.max(m, 0))  # empty splits: m = -inf, weight 0
        total = tl.sum(weight * tl.load(l_ptr + at), 0)
        acc = tl.sum(weight[:, None] * tl.load(acc_ptr + at[:, None] * D + d[None, :]), 0)
        tl.store(out_ptr + row * so_t + head * so_h + d, (acc / total).to(out_ptr.dtype.element_ty))
