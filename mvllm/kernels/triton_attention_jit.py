"""The Triton kernels of triton_attention.py (which launches them), in a module of their own: importing Triton
costs a process about 0.3 s of CPU, which a CPU backend's worker need not pay (triton_attention.jit())."""

import triton
import triton.language as tl


@triton.jit
def rstd_row(x_ptr, HIDDEN, eps, BLOCK_H: tl.constexpr):
    """RMSNorm's 1 / rms of one row of x (HIDDEN values), its squares summed in float32."""
    squares = tl.zeros([BLOCK_H], tl.float32)
    for start in range(0, HIDDEN, BLOCK_H):
        h = start + tl.arange(0, BLOCK_H)
        v = tl.load(x_ptr + h, mask=h < HIDDEN, other=0.0).to(tl.float32)
        squares += v * v
    return 1.0 / tl.sqrt(tl.sum(squares, 0) / HIDDEN + eps)


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, cache_ptr, packed_ptr, q_ptr, b_ptr, x_ptr, eps, HIDDEN,
                       s_qkv, s_cos, s_sin, s_row, s_col, sc_kv, sc_slot, sc_h, sq_t, sq_h, s_x,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, BIAS: tl.constexpr,
                       NORM: tl.constexpr, BLOCK_H: tl.constexpr, ALL_HEADS: tl.constexpr):
    """Program per token: its query heads rotated into q, its KV heads' keys rotated and their values copied
    into the token's cache slot, all heads as one [ALL_HEADS, HALF] block (a program per head and token
    left most of a launch's work to scheduling tiny programs). Rotation in float32, rounded once. NORM: the
    row is first scaled by rstd(x), summed once here from the row of x; BIAS: the bias is added after."""
    row = tl.program_id(0)
    h = tl.arange(0, ALL_HEADS)[:, None]
    i = tl.arange(0, HALF)[None, :]
    dtype = q_ptr.dtype.element_ty  # cos and sin rounded to the model's dtype first, as the eager rotary does
    # every load first (the norm's sum waits on a barrier, and loads are not moved above one)
    real = h < HEADS + KV_HEADS
    kv = (h >= HEADS) & real
    kvh = tl.maximum(h - HEADS, 0)
    at = h * 2 * HALF + i
    v_at = (HEADS + KV_HEADS + kvh) * 2 * HALF + i
    y = qkv_ptr + row * s_qkv
    x1 = tl.load(y + at, mask=real, other=0.0).to(tl.float32)
    x2 = tl.load(y + HALF + at, mask=real, other=0.0).to(tl.float32)
    v1 = tl.load(y + v_at, mask=kv, other=0.0).to(tl.float32)
    v2 = tl.load(y + HALF + v_at, mask=kv, other=0.0).to(tl.float32)
    pos = tl.load(packed_ptr + row * s_row + s_col)
    slot = tl.load(packed_ptr + row * s_row + 2 * s_col)
    c = tl.load(cos_ptr + pos * s_cos + i).to(dtype).to(tl.float32)  # the table repeats its first half
    s = tl.load(sin_ptr + pos * s_sin + i).to(dtype).to(tl.float32)
    if NORM:
        scale = rstd_row(x_ptr + row * s_x, HIDDEN, eps, BLOCK_H)
        x1, x2, v1, v2 = x1 * scale, x2 * scale, v1 * scale, v2 * scale
    if BIAS:
        x1 += tl.load(b_ptr + at, mask=real, other=0.0).to(tl.float32)
        x2 += tl.load(b_ptr + HALF + at, mask=real, other=0.0).to(tl.float32)
        v1 += tl.load(b_ptr + v_at, mask=kv, other=0.0).to(tl.float32)
        v2 += tl.load(b_ptr + HALF + v_at, mask=kv, other=0.0).to(tl.float32)
    r1 = (x1 * c - x2 * s).to(dtype)
    r2 = (x2 * c + x1 * s).to(dtype)
    query = q_ptr + row * sq_t + h * sq_h + i
    tl.store(query, r1, mask=h < HEADS)
    tl.store(query + HALF, r2, mask=h < HEADS)
    key = cache_ptr + slot * sc_slot + kvh * sc_h + i
    tl.store(key, r1, mask=kv)
    tl.store(key + HALF, r2, mask=kv)
    tl.store(key + sc_kv, v1.to(dtype), mask=kv)
    tl.store(key + sc_kv + HALF, v2.to(dtype), mask=kv)


@triton.jit
def listed_row(packed_ptr, p, T, s_row, s_col, LISTED: tl.constexpr):
    """The row a per-token program p takes: p itself, or (LISTED) the p-th from the back of column 5, -1
    where that entry is not a per-token row."""
    if LISTED:
        row = tl.maximum(-2 - tl.load(packed_ptr + (T - 1 - p) * s_row + 5 * s_col), -1)
    else:
        row = p + 0 * T
    return row


@triton.jit
def _rows_kernel(q_ptr, cache_ptr, out_ptr, acc_ptr, m_ptr, l_ptr, packed_ptr, tables_ptr, scale, T,
                 sq_t, sq_h, sc_kv, sc_slot, sc_h, s_row, s_col, st_seq, st_col, so_t, so_h,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, LISTED: tl.constexpr):
    """Program (p, KV head, split): the split's share of one token's keys (row p, or the p-th per-token row
    of column 5), for the KV head's group of query heads. One split writes the output; several write
    partial sums (at p) for _combine_kernel."""
    p = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = listed_row(packed_ptr, p, T, s_row, s_col, LISTED)
    if row >= 0:
        n = tl.load(packed_ptr + row * s_row + 3 * s_col)
        chunk = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, n)
        table = tables_ptr + tl.load(packed_ptr + row * s_row + 4 * s_col) * st_seq
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D)
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + row * sq_t + heads[:, None] * sq_h + d[None, :], mask=(g < GROUP)[:, None],
                    other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            valid = j < hi
            block = tl.load(table + (j // BLOCK) * st_col, mask=valid, other=0)
            at = (block * BLOCK + j % BLOCK)[:, None] * sc_slot + kvh * sc_h + d[None, :]
            keys = tl.load(cache_ptr + at, mask=valid[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(keys), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(keys)) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            prob = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            values = tl.load(cache_ptr + sc_kv + at, mask=valid[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(prob, values, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(prob.to(values.dtype), values)
            total = total * alpha + tl.sum(prob, 1)
            m = m_new
        mask = (g < GROUP)[:, None]
        if SPLITS == 1:
            tl.store(out_ptr + row * so_t + heads[:, None] * so_h + d[None, :],
                     (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            H = GROUP * tl.num_programs(1)
            at = (p * SPLITS + split) * H + heads
            tl.store(acc_ptr + at[:, None] * D + d[None, :], acc, mask=mask)
            tl.store(m_ptr + at, m, mask=g < GROUP)
            tl.store(l_ptr + at, total, mask=g < GROUP)


@triton.jit
def attend(q, acc, mx, total, cache_ptr, table, start, hi, key_len, kvh, qk_scale, sc_kv, sc_slot, sc_h,
           st_col, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
           IEEE: tl.constexpr):
    """One block of BLOCK_N keys from `start` (through the block table) into a tile's online softmax, in
    base 2 (qk_scale has log2(e) in it). MASKED: keys past hi are not loaded, and each row sees its first
    key_len keys only; otherwise every row sees every key of the block."""
    j = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    seen = j < hi
    if MASKED:
        block = tl.load(table + (j // BLOCK) * st_col, mask=seen, other=0)
    else:
        block = tl.load(table + (j // BLOCK) * st_col)
    at = (block * BLOCK + j % BLOCK)[:, None] * sc_slot + kvh * sc_h + d[None, :]
    if MASKED:
        keys = tl.load(cache_ptr + at, mask=seen[:, None], other=0.0)
        values = tl.load(cache_ptr + sc_kv + at, mask=seen[:, None], other=0.0)
    else:
        keys = tl.load(cache_ptr + at)
        values = tl.load(cache_ptr + sc_kv + at)
    if IEEE:
        s = tl.dot(q, tl.trans(keys), input_precision="ieee") * qk_scale
    else:
        s = tl.dot(q, tl.trans(keys)) * qk_scale
    if MASKED:
        s = tl.where(j[None, :] < key_len[:, None], s, float("-inf"))
    m_new = tl.maximum(mx, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(mx - m_new)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
    return acc, m_new, total * alpha + tl.sum(p, 1)


@triton.jit
def _tiles_kernel(q_ptr, cache_ptr, out_ptr, packed_ptr, tables_ptr, qk_scale, PROGRAMS,
                  sq_t, sq_h, sc_kv, sc_slot, sc_h, s_row, s_col, st_seq, st_col, so_t, so_h,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TILE: tl.constexpr, D: tl.constexpr,
                  BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Program (p, KV head): a tile of column 5 (read from the PROGRAMS-th entry down, so the later tiles of
    a sequence, with more keys, start first): up to TILE consecutive rows of one sequence times the KV
    head's group of query heads, as one block of queries over the sequence's keys up to the tile's longest
    key length. Blocks every row sees run unmasked; in the rest each row is masked past its own key length
    (causal within the chunk, after whatever context is cached). Entries that are not tiles do nothing."""
    e = tl.load(packed_ptr + (PROGRAMS - 1 - tl.program_id(0)) * s_row + 5 * s_col)
    kvh = tl.program_id(1)
    if e >= 0:
        r0 = e // TILE
        n = e % TILE + 1
        i = tl.arange(0, TILE * GROUP_PAD)
        m = i // GROUP_PAD
        g = i % GROUP_PAD
        inside = m < n
        valid = inside & (g < GROUP)
        rows = r0 + m
        heads = kvh * GROUP + g
        d = tl.arange(0, D)
        q = tl.load(q_ptr + rows[:, None] * sq_t + heads[:, None] * sq_h + d[None, :], mask=valid[:, None],
                    other=0.0)
        key_len = tl.load(packed_ptr + rows * s_row + 3 * s_col, mask=inside, other=1)
        hi = tl.max(key_len, 0)
        unmasked = tl.min(tl.where(inside, key_len, hi), 0) // BLOCK_N * BLOCK_N  # keys every row sees
        table = tables_ptr + tl.load(packed_ptr + r0 * s_row + 4 * s_col) * st_seq
        mx = tl.full([TILE * GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([TILE * GROUP_PAD], tl.float32)
        acc = tl.zeros([TILE * GROUP_PAD, D], tl.float32)
        for start in range(0, unmasked, BLOCK_N):
            acc, mx, total = attend(q, acc, mx, total, cache_ptr, table, start, hi, key_len, kvh, qk_scale,
                                    sc_kv, sc_slot, sc_h, st_col, D, BLOCK, BLOCK_N, False, IEEE)
        for start in range(unmasked, hi, BLOCK_N):
            acc, mx, total = attend(q, acc, mx, total, cache_ptr, table, start, hi, key_len, kvh, qk_scale,
                                    sc_kv, sc_slot, sc_h, st_col, D, BLOCK, BLOCK_N, True, IEEE)
        tl.store(out_ptr + rows[:, None] * so_t + heads[:, None] * so_h + d[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, packed_ptr, T, s_row, s_col, so_t, so_h, H: tl.constexpr,
                    D: tl.constexpr, SPLITS: tl.constexpr, LISTED: tl.constexpr):
    """Program (p, query head): the splits' partial softmax sums of _rows_kernel's program p merged into its
    row of the output."""
    p = tl.program_id(0)
    head = tl.program_id(1)
    row = listed_row(packed_ptr, p, T, s_row, s_col, LISTED)
    if row >= 0:
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        at = (p * SPLITS + s) * H + head
        m = tl.load(m_ptr + at)
        weight = tl.exp(m - tl.max(m, 0))  # empty splits: m = -inf, weight 0
        total = tl.sum(weight * tl.load(l_ptr + at), 0)
        acc = tl.sum(weight[:, None] * tl.load(acc_ptr + at[:, None] * D + d[None, :]), 0)
        tl.store(out_ptr + row * so_t + head * so_h + d, (acc / total).to(out_ptr.dtype.element_ty))
