"""An experiment, not wired into the engine: the projections of a decode step, one Triton kernel each, with
what sits around them fused in. Measured on the H200 (experiments/small_linear_speed.py), it lost to cuBLAS on
Qwen2.5-0.5B's larger weights and made decode slower end to end (results/profile/README.md). Wired in (commits
ff97455 and 3451b21), a layer ran four of these around rotary-with-cache-write and attention, where cuBLAS and
inductor run eight kernels: four GEMMs, a split-K reduce, two norms with their residual adds, and the SiLU.

A decode step's projection reads its whole weight for a handful of rows, so it is bound by memory and by
launches. `triton_linear` is one kernel that may also take:
- the RMSNorm before the projection: x's squares are summed as the rows are read, and the per-row scale is
  applied to the product at the end (norm(x) W^T = rstd * ((x * g) W^T));
- the bias;
- SiLU(gate) * up after a fused gate/up projection (the weight's first half is gate, the second up);
- the residual add after it.
Each program owns BLOCK_N output columns for every row (rows padded to 16 for the tensor cores) over a share
of K; with several shares (split-K), the last program of a column block to finish adds up the partial sums.
Rounding follows the eager layer: the product is rounded to the model's dtype before the SiLU and before
the residual add. `reference` is the same in PyTorch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mvllm.model.table_attention import triton

if triton is not None:
    import triton.language as tl

def reference(x, weight, bias, norm, eps: float, residual, silu: bool) -> torch.Tensor:
    """The same in PyTorch, op by op as the eager layer runs it."""
    if norm is not None:
        x = F.rms_norm(x, norm.shape, norm, eps)
    y = F.linear(x, weight, bias)
    if silu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y if residual is None else residual + y


_counters: dict[torch.device, torch.Tensor] = {}


def config(rows: int, n: int, k: int, silu: bool, device: torch.device) -> dict:
    """Block sizes, and how many programs split the reduction (K), for a [rows, k] x [k, n] product (n:
    output columns): enough programs for every multiprocessor to stream its share of the weight."""
    block_n, block_k = (32 if silu else 16), 128
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    blocks = triton.cdiv(n, block_n)
    split = max(1, min(2 * sms // blocks, triton.cdiv(k, 2 * block_k)))
    return dict(BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k, split=split,
                num_warps=4, num_stages=4)


def triton_linear(x, weight, bias, norm, eps: float, residual, silu: bool, **tune) -> torch.Tensor:
    rows, k = x.shape
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    out = x.new_empty(rows, n)
    cfg = config(rows, n, k, silu, x.device) | tune
    split = cfg.pop("split")
    blocks = triton.cdiv(n, cfg["BLOCK_N"])
    k_split = triton.cdiv(triton.cdiv(k, split), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split = triton.cdiv(k, k_split)
    ws = ss = counter = out  # unused without a split
    if split > 1:  # partial sums, reduced by the last program of each column block to finish
        ws = x.new_empty(split * (2 if silu else 1) * cfg["BLOCK_M"] * n, dtype=torch.float32)
        ss = x.new_empty(blocks * split * cfg["BLOCK_M"], dtype=torch.float32)
        counter = _counters.get(x.device)
        if counter is None or counter.numel() < blocks:  # zero; each program that reduces sets its own back
            counter = _counters[x.device] = torch.zeros(max(4096, blocks), dtype=torch.int32, device=x.device)
    _linear_kernel[(blocks, split)](
        x, weight, x if bias is None else bias, x if norm is None else norm, x if residual is None else residual,
        out, ws, ss, counter, rows, n, k, k_split, split, eps, x.stride(0), weight.stride(0),
        0 if residual is None else residual.stride(0), out.stride(0), NORM=norm is not None, BIAS=bias is not None,
        RES=residual is not None, SILU=silu, SPLIT_K=split > 1, IEEE=x.dtype == torch.float32, **cfg)
    return out


if triton is not None:
    @triton.jit
    def _dot(a, w, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, tl.trans(w), input_precision="ieee")
        return tl.dot(a, tl.trans(w))

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, b_ptr, g_ptr, r_ptr, out_ptr, ws_ptr, ss_ptr, count_ptr, M, N, K, K_SPLIT,
                       SPLIT, eps, s_x, s_w, s_r, s_out, NORM: tl.constexpr, BIAS: tl.constexpr, RES: tl.constexpr,
                       SILU: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program (column block, split): BLOCK_N output columns for every row (and the matching up columns,
        with SILU) over the split's share of K. The norm's scale is per row, so it is applied at the end:
        norm(x) W^T = rstd * ((x * g) W^T), with x's squares summed in the same pass."""
        dtype = out_ptr.dtype.element_ty
        block = tl.program_id(0)
        split = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        lo = split * K_SPLIT
        hi = tl.minimum(lo + K_SPLIT, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        squares = tl.zeros([BLOCK_M], tl.float32)
        for start in range(lo, hi, BLOCK_K):
            k = start + tl.arange(0, BLOCK_K)
            k_ok = k < hi
            a = tl.load(x_ptr + rows[:, None] * s_x + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                a = a.to(tl.float32)
                squares += tl.sum(a * a, 1)
                a = (a * tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
            w_at = w_ptr + cols[:, None] * s_w + k[None, :]
            w_ok = col_ok[:, None] & k_ok[None, :]
            acc += _dot(a, tl.load(w_at, mask=w_ok, other=0.0), IEEE)
            if SILU:
                up += _dot(a, tl.load(w_at + N * s_w, mask=w_ok, other=0.0), IEEE)
        if SPLIT_K:  # partial sums out; the last program of this column block to finish adds them up
            part = (split * BLOCK_M + rows)[:, None] * N + cols[None, :]
            tl.store(ws_ptr + part, acc, mask=col_ok[None, :])
            if SILU:
                tl.store(ws_ptr + SPLIT * BLOCK_M * N + part, up, mask=col_ok[None, :])
            if NORM:
                tl.store(ss_ptr + (block * SPLIT + split) * BLOCK_M + rows, squares)
            if tl.atomic_add(count_ptr + block, 1) == SPLIT - 1:  # acq_rel: the other splits' stores are seen
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                squares = tl.zeros([BLOCK_M], tl.float32)
                for s in range(0, SPLIT):
                    part = (s * BLOCK_M + rows)[:, None] * N + cols[None, :]
                    acc += tl.load(ws_ptr + part, mask=col_ok[None, :], other=0.0, cache_modifier=".cg")
                    if SILU:
                        up += tl.load(ws_ptr + SPLIT * BLOCK_M * N + part, mask=col_ok[None, :], other=0.0,
                                      cache_modifier=".cg")
                    if NORM:
                        squares += tl.load(ss_ptr + (block * SPLIT + s) * BLOCK_M + rows, cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + block, 0)  # ready for the next call (and the next graph replay)
                _finish(acc, up, squares, b_ptr, r_ptr, out_ptr, rows, cols, row_ok, col_ok, K, eps, s_r, s_out,
                        NORM, BIAS, RES, SILU)
        else:
            _finish(acc, up, squares, b_ptr, r_ptr, out_ptr, rows, cols, row_ok, col_ok, K, eps, s_r, s_out, NORM,
                    BIAS, RES, SILU)

    @triton.jit
    def _finish(acc, up, squares, b_ptr, r_ptr, out_ptr, rows, cols, row_ok, col_ok, K, eps, s_r, s_out,
                NORM: tl.constexpr, BIAS: tl.constexpr, RES: tl.constexpr, SILU: tl.constexpr):
        """The norm's scale, bias, SiLU(gate) * up and the residual add, rounded as the eager layer's ops."""
        dtype = out_ptr.dtype.element_ty
        if NORM:
            scale = 1.0 / tl.sqrt(squares / K + eps)
            acc = acc * scale[:, None]
            up = up * scale[:, None]
        if BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        y = acc.to(dtype)  # the projection's output, rounded as the eager layer's
        if SILU:
            gate = y.to(tl.float32)
            y = (gate / (1.0 + tl.exp(-gate))).to(dtype)
            y = (y.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
        out_ok = row_ok[:, None] & col_ok[None, :]
        if RES:
            y = (y.to(tl.float32) + tl.load(r_ptr + rows[:, None] * s_r + cols[None, :], mask=out_ok,
                                            other=0.0).to(tl.float32)).to(dtype)
        tl.store(out_ptr + rows[:, None] * s_out + cols[None, :], y, mask=out_ok)
