"""Attention that reads K/V straight from the paged cache through each sequence's block table (no gather).

Two custom ops. `mvllm::rope_store` rotates the new tokens' queries and keys and writes their K/V into their
slots, in one kernel straight from the QKV projection's output. `mvllm::table_attention` then lets every new
token attend to the first keys of its sequence (its key length), found through its block table. A token
of a sequence computed several tokens at a time sees the keys up to its own position, so one layout serves
decode, chunked and warm-prefix prefill and mixed steps. Elsewhere (and as the reference in tests) both run in
plain PyTorch. torch.compile sees each op as one opaque call (rope_store mutates the cache), so the rest of the
layer fuses around them. Both ops read the step's packed input whole: one row per token (token id, position,
slot, key length, the row of its sequence in `tables`, and an entry of the step's work list: see below), and
the attention reads `tables` [sequences, W], each sequence's block table once: a step's input grows with its
tokens plus its sequences' blocks, not with their product.

On CUDA with Triton the attention runs two kernels, each told its work by column 5 (`work_list`):
- the tiled kernel, for the rows of a sequence with TILED_MIN new tokens or more (prefill chunks, with or
  without a cached context before them): a program per tile of up to TILE consecutive tokens of one sequence
  and one KV head holds the tile's tokens times the head's group of query heads (16 x 7 rows for Qwen2.5-0.5B's
  14 heads over 2) as one block of queries, and loads each block of keys and values once for all of them,
  through the sequence's block table; blocks every row of the tile may see run unmasked, the last ones causally;
- the per-token kernel, for the other rows (decodes): a program per (token, KV head) streams the token's keys
  with an online softmax; when few tokens would leave the GPU idle, each token's keys are split over several
  programs and a third kernel merges their partial sums (flash-decoding).
A step of no more tokens than sequences (all decodes, or small mixed steps) runs the per-token kernel alone
for every row: a second launch would cost a decode step more than it saves. TILED_MIN is the one switch:
1 sends decodes through the tiled kernel too, a large value every row through the per-token kernel.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from mvllm.kernels import cpu_fused

TILE = 16  # tokens a program of the tiled kernel takes
TILED_MIN = 2  # a sequence with this many new tokens in a step or more runs through the tiled kernel
# the tiled kernel's launch: keys a loop step (block_n), warps and pipeline stages (None: Triton's default), the
# best of experiments/probes/tiled_sweep.py on an H100 within its noise (results/serving-engine)
TILED = {"block_n": 128, "num_warps": 4, "num_stages": 2}
LOG2E = 1.4426950408889634

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch ship without Triton
    triton = None


def set_tiled(setting: dict, group: int) -> None:
    """Launch the tiled kernel with `setting` (rows a tile holds, block_n, num_warps, num_stages) for a model
    whose KV heads each serve `group` query heads: TILE becomes the tokens that many rows hold."""
    global TILE
    TILE = setting["rows"] // (1 << (group - 1).bit_length())
    TILED.update({k: setting[k] for k in ("block_n", "num_warps", "num_stages")})


def available(device: torch.device) -> bool:
    """Triton is installed and the GPU has bf16 tensor cores (compute capability 8.0, Ampere, or newer);
    elsewhere the GPU backend runs its plain path."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


@torch.library.custom_op("mvllm::rope_store", mutates_args=("cache",))
def rope_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: torch.Tensor, packed: torch.Tensor,
               heads: int, kv_heads: int, bias: Optional[torch.Tensor] = None, x: Optional[torch.Tensor] = None,
               eps: float = 0.0) -> torch.Tensor:
    """qkv [T, (heads + 2 kv_heads) * D] (q | k | v), cos/sin [positions, D] (the whole rotary tables) ->
    rotated q [T, heads, D]; the rotated k and v written into cache[0] and cache[1] at each token's slot.
    packed [T, 6]: each token's (token id, position, slot, key length, sequence row, tile start), the step's
    input itself (slicing it here costs no kernel; columns handed to the op would each be copied).
    With `x` (norms folded into the projection, kernels/triton_ops.py) each row is first scaled by RMSNorm's
    rstd(x); then `bias` is added."""
    if qkv.is_cuda and triton is not None:
        return _triton_rope_store(qkv, cos, sin, cache, packed, heads, kv_heads, bias, x, eps)
    return reference_rope_store(qkv, cos, sin, cache, packed, heads, kv_heads, bias, x, eps)


@rope_store.register_fake
def _(qkv, cos, sin, cache, packed, heads, kv_heads, bias=None, x=None, eps=0.0):
    return qkv.new_empty(qkv.shape[0], heads, cache.shape[-1])


def reference_rope_store(qkv, cos, sin, cache, packed, heads: int, kv_heads: int, bias=None, x=None,
                         eps: float = 0.0) -> torch.Tensor:
    """The same in PyTorch (the CPU kernels' reference), cos and sin rounded as the decoder's eager rotary."""
    if x is not None or bias is not None:
        y = qkv.float() if x is None else qkv.float() * rstd(x, eps)
        qkv = (y if bias is None else y + bias.float()).to(qkv.dtype)
    cos, sin = (t[packed[:, 1]].to(qkv.dtype) for t in (cos, sin))
    return cpu_fused.reference_rope_store(qkv, cos, sin, cache, packed[:, 2], heads, kv_heads)


def rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's per-row scale [T, 1] in float32."""
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


@torch.library.custom_op("mvllm::table_attention", mutates_args=())
def table_attention(q: torch.Tensor, cache: torch.Tensor, packed: torch.Tensor, tables: torch.Tensor,
                    block_size: int, scale: float) -> torch.Tensor:
    """q [T, H, D], cache [2, slots, Hkv, D] (the new tokens' K/V already in it), packed as rope_store's,
    tables [sequences, W]: token t attends to the first packed[t, 3] keys of the block table
    tables[packed[t, 4]]; returns [T, H * D]."""
    if q.is_cuda and triton is not None:
        return _triton(q, cache, packed, tables, block_size, scale)
    return reference(q, cache, packed, tables, block_size, scale)


@table_attention.register_fake
def _(q, cache, packed, tables, block_size, scale):
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


def work_list(counts: list[int], t_pad: int) -> tuple[list[int], list[int]]:
    """The step's work, for column 5 of its input: (tiles, rows). The tiled kernel's tiles go from the front as
    first row * TILE + rows - 1: each sequence of TILED_MIN new tokens or more (`counts`: each sequence's rows,
    in order) cut every TILE rows, then the padding rows up to t_pad likewise. The rows left to the per-token
    kernel go from the back, the first last, as -2 - row; entries between are -1."""
    tiles, rows, row = [], [], 0
    for n in counts:
        if n >= TILED_MIN:
            tiles += [a * TILE + min(TILE, row + n - a) - 1 for a in range(row, row + n, TILE)]
        elif n == 1:  # a decode: the common case, kept cheap (the host packs every step)
            rows.append(-2 - row)
        else:
            rows += range(-2 - row, -2 - row - n, -1)
        row += n
    if row < t_pad:
        tiles += [a * TILE + min(TILE, t_pad - a) - 1 for a in range(row, t_pad, TILE)]
    rows.reverse()
    return tiles, rows


def work_column(counts: list[int], t_pad: int) -> list[int]:
    """Column 5 of a step's input, whole (see work_list)."""
    tiles, rows = work_list(counts, t_pad)
    return tiles + [-1] * (t_pad - len(tiles) - len(rows)) + rows


def pack_rows(positions: torch.Tensor, slots: torch.Tensor, key_len: torch.Tensor, token_seq: torch.Tensor,
              counts: list[int]) -> torch.Tensor:
    """The packed [T, 6] input from per-token columns (token ids left 0); token_seq: each token's row of the
    step's tables, counts: each sequence's tokens."""
    work = torch.tensor(work_column(counts, len(positions)), dtype=positions.dtype, device=positions.device)
    return torch.stack([torch.zeros_like(positions), positions, slots, key_len, token_seq, work], dim=1)


def reference(q, cache, packed, tables, block_size: int, scale: float) -> torch.Tensor:
    """The same attention in PyTorch: each token's keys gathered slot by slot, masked past its key length."""
    t, h, d = q.shape
    tables, key_len = tables[packed[:, 4]], packed[:, 3]
    width = tables.shape[1] * block_size
    slots = (tables.unsqueeze(-1) * block_size + torch.arange(block_size, device=q.device)).view(t, width)
    keys, values = cache[:, slots].transpose(2, 3).unbind(0)  # [T, Hkv, width, D]
    hkv = keys.shape[1]
    mask = (torch.arange(width, device=q.device) < key_len.unsqueeze(1)).view(t, 1, 1, width)
    out = F.scaled_dot_product_attention(q.view(t, hkv, h // hkv, d), keys, values, attn_mask=mask, scale=scale)
    return out.reshape(t, h * d)


def runs_tiles(t: int, sequences: int) -> bool:
    """Whether a step of t tokens over at most `sequences` runs the tiled kernel: when one of its sequences surely
    has TILED_MIN new tokens (more tokens than sequences, for 2). Otherwise every row runs per token."""
    return -(-t // sequences) >= TILED_MIN


def _triton(q, cache, packed, tables, block_size: int, scale: float, splits: int | None = None,
            tiled: bool | None = None) -> torch.Tensor:
    """tiled (default: runs_tiles) and splits (default: _splits) can be forced by tests."""
    t, h, d = q.shape
    hkv = cache.shape[2]
    group = h // hkv
    out = q.new_empty(t, h, d)
    sequences = tables.shape[0]
    tiled = runs_tiles(t, sequences) if tiled is None else tiled
    strides = (q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2), packed.stride(0),
               packed.stride(1), tables.stride(0), tables.stride(1), out.stride(0), out.stride(1))
    ieee = q.dtype == torch.float32
    rows = t  # rows the per-token kernel takes: every row, or (after the tiled kernel) what is left of them
    if tiled:
        gdiv = triton.next_power_of_2(group)  # each token's rows: its KV head's query heads, padded
        block_rows = TILE * gdiv
        programs = min(t, t // TILE + sequences + 1)  # at least as many as the tiles
        launch = {k: TILED[k] for k in ("num_warps", "num_stages") if TILED[k]}
        launch.setdefault("num_warps", 8 if block_rows >= 128 else 4)
        _tiles_kernel[(programs, hkv)](
            q, cache, out, packed, tables, scale * LOG2E, programs, *strides, GROUP=group, GDIV=gdiv, ROWS=block_rows,
            TILE=TILE, D=d, BLOCK=block_size, BLOCK_N=max(TILED["block_n"], block_size), IEEE=ieee, **launch)
        rows = min(t, sequences * (TILED_MIN - 1))
        if rows == 0:
            return out.view(t, h * d)
    splits = splits or _splits(rows * hkv, q.device)
    part = dict(acc=out, m=out, l=out)  # unused when one split writes the output itself
    if splits > 1:
        part = dict(acc=q.new_empty(rows, splits, h, d, dtype=torch.float32),
                    m=q.new_empty(rows, splits, h, dtype=torch.float32),
                    l=q.new_empty(rows, splits, h, dtype=torch.float32))
    _rows_kernel[(rows, hkv, splits)](
        q, cache, out, part["acc"], part["m"], part["l"], packed, tables, scale, t, *strides,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, BLOCK=block_size,
        BLOCK_N=max(64, block_size), SPLITS=splits, IEEE=ieee, LISTED=tiled)
    if splits > 1:
        _combine_kernel[(rows, h)](part["acc"], part["m"], part["l"], out, packed, t, packed.stride(0),
                                   packed.stride(1), out.stride(0), out.stride(1), H=h, D=d, SPLITS=splits,
                                   LISTED=tiled)
    return out.view(t, h * d)


def _triton_rope_store(qkv, cos, sin, cache, packed, heads: int, kv_heads: int, bias=None, x=None,
                       eps: float = 0.0) -> torch.Tensor:
    t, d = qkv.shape[0], cache.shape[-1]
    q = qkv.new_empty(t, heads, d)
    hidden = 1 if x is None else x.shape[1]
    _rope_store_kernel[(t,)](
        qkv, cos, sin, cache, packed, q, qkv if bias is None else bias, qkv if x is None else x, eps, hidden,
        qkv.stride(0), cos.stride(0), sin.stride(0), packed.stride(0), packed.stride(1), cache.stride(0),
        cache.stride(1), cache.stride(2), q.stride(0), q.stride(1), 0 if x is None else x.stride(0), HEADS=heads,
        KV_HEADS=kv_heads, HALF=d // 2, BIAS=bias is not None, NORM=x is not None,
        BLOCK_H=min(1024, triton.next_power_of_2(hidden)), ALL_HEADS=triton.next_power_of_2(heads + kv_heads))
    return q


MAX_SPLITS = 16  # a split reads at least BLOCK_N (64) keys: at 580 keys only 10 splits have work


def _splits(programs: int, device: torch.device) -> int:
    """Split each token's keys over this many programs when few tokens would leave the GPU idle (decode):
    about two programs per multiprocessor, a power of two, at most MAX_SPLITS."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = 2 * sms // programs
    return 1 if want < 2 else min(MAX_SPLITS, 1 << (want.bit_length() - 1))


if triton is not None:
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
                      GROUP: tl.constexpr, GDIV: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr,
                      D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
        """Program (p, KV head): a tile of column 5 (read from the PROGRAMS-th entry down, so the later tiles of
        a sequence, with more keys, start first): up to TILE consecutive rows of one sequence times the KV
        head's group of query heads, as one block of queries over the sequence's keys up to the tile's longest
        key length. Blocks every row sees run unmasked; in the rest each row is masked past its own key length
        (causal within the chunk, after whatever context is cached). Entries that are not tiles do nothing.
        The block's ROWS query rows are row i = (token i // GDIV, head i % GDIV), GDIV the group padded to a
        power of two."""
        e = tl.load(packed_ptr + (PROGRAMS - 1 - tl.program_id(0)) * s_row + 5 * s_col)
        kvh = tl.program_id(1)
        if e >= 0:
            r0 = e // TILE
            n = e % TILE + 1
            i = tl.arange(0, ROWS)
            m = i // GDIV
            g = i % GDIV
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
            mx = tl.full([ROWS], float("-inf"), tl.float32)
            total = tl.zeros([ROWS], tl.float32)
            acc = tl.zeros([ROWS, D], tl.float32)
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
