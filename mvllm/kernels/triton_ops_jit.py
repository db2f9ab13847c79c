"""The Triton kernels of triton_ops.py (which launches them), in a module of their own, imported at a GPU step's
first launch (triton_ops.jit())."""

import triton
import triton.language as tl

from mvllm.kernels.triton_attention_jit import rstd_row


@triton.jit
def _silu_mul_kernel(gu_ptr, x_ptr, out_ptr, s_gu, s_x, s_out, INTER, HIDDEN, eps, BLOCK: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    """Program (row, column block): the row's rstd from x, then SiLU(gate) * up in float32."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < INTER
    gate = tl.load(gu_ptr + row * s_gu + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * s_gu + INTER + cols, mask=ok, other=0.0).to(tl.float32)
    scale = rstd_row(x_ptr + row * s_x, HIDDEN, eps, BLOCK_H)
    gate = gate * scale
    up = up * scale
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * s_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, K_SPLIT, s_x, s_w, s_r,
                   s_out, BIAS: tl.constexpr, RES: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (column block, split): BLOCK_N output columns of every row over the split's share of K.
    Rows are padded to BLOCK_M (at least 16) for the tensor cores."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    lo = split * K_SPLIT
    hi = tl.minimum(lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(lo, hi, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        k_ok = k < hi
        a = tl.load(x_ptr + rows[:, None] * s_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * s_w + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w))
    if SPLIT > 1:  # partial sums out; the last program of this column block to finish adds them up
        part = (split * BLOCK_M + rows)[:, None] * N + cols[None, :]
        tl.store(ws_ptr + part, acc, mask=col_ok[None, :])
        if tl.atomic_add(count_ptr + block, 1) == SPLIT - 1:  # acq_rel: the other splits' stores are seen
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(0, SPLIT):
                part = (s * BLOCK_M + rows)[:, None] * N + cols[None, :]
                acc += tl.load(ws_ptr + part, mask=col_ok[None, :], other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + block, 0)  # ready for the next call (and the next graph replay)
            _out(acc, b_ptr, r_ptr, out_ptr, rows, cols, row_ok, col_ok, s_r, s_out, BIAS, RES)
    else:
        _out(acc, b_ptr, r_ptr, out_ptr, rows, cols, row_ok, col_ok, s_r, s_out, BIAS, RES)


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, best_ptr, at_ptr, count_ptr, N, s_x, CHUNKS: tl.constexpr,
                   BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (row, chunk): the chunk's largest logit and its first index; the row's last program to finish
    picks the first chunk holding the row's largest (chunks are in index order) and writes its index."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * s_x + cols, mask=cols < N, other=-float("inf")).to(tl.float32)
    v = tl.where(v != v, float("inf"), v)  # NaN: the largest, as torch.argmax has it
    top = tl.max(v, 0)
    tl.store(best_ptr + row * CHUNKS + chunk, top)
    tl.store(at_ptr + row * CHUNKS + chunk, tl.min(tl.where(v == top, cols, N), 0))
    if tl.atomic_add(count_ptr + row, 1) == CHUNKS - 1:  # acq_rel: the other chunks' stores are seen
        c = tl.arange(0, BLOCK_C)
        ok = c < CHUNKS
        tops = tl.load(best_ptr + row * CHUNKS + c, mask=ok, other=-float("inf"), cache_modifier=".cg")
        ats = tl.load(at_ptr + row * CHUNKS + c, mask=ok, other=N, cache_modifier=".cg")
        first = tl.min(tl.where(tops == tl.max(tops, 0), ats, N), 0)
        tl.store(out_ptr + row, first.to(tl.int64))
        tl.atomic_xchg(count_ptr + row, 0)


@triton.jit
def _out(acc, b_ptr, r_ptr, out_ptr, rows, cols, row_ok, col_ok, s_r, s_out, BIAS: tl.constexpr,
         RES: tl.constexpr):
    """The bias, the product rounded to the output's dtype, then the residual added and rounded once."""
    dtype = out_ptr.dtype.element_ty
    if BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    ok = row_ok[:, None] & col_ok[None, :]
    y = acc.to(dtype)
    if RES:
        y = (y.to(tl.float32) + tl.load(r_ptr + rows[:, None] * s_r + cols[None, :], mask=ok,
                                        other=0.0).to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows[:, None] * s_out + cols[None, :], y, mask=ok)
