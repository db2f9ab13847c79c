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

import functools
import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F

from mvllm.kernels import cpu_fused

TILE = 16  # tokens a program of the tiled kernel takes
TILED_MIN = 2  # a sequence with this many new tokens in a step or more runs through the tiled kernel
# the tiled kernel's launch: keys a loop step (block_n), warps and pipeline stages, the best of
# experiments/probes/tiled_sweep.py on an H100 within its noise (results/serving-engine)
TILED = {"block_n": 128, "num_warps": 4, "num_stages": 2}
LOG2E = 1.4426950408889634

HAS_TRITON = importlib.util.find_spec("triton") is not None  # CPU builds of torch ship without Triton


@functools.cache
def jit():
    """The kernels (mvllm/kernels/triton_attention_jit.py), imported at a GPU step's first launch."""
    from mvllm.kernels import triton_attention_jit

    return triton_attention_jit


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def set_tiled(setting: dict, group: int) -> None:
    """Launch the tiled kernel with `setting` (rows a tile holds, block_n, num_warps, num_stages) for a model
    whose KV heads each serve `group` query heads: TILE becomes the tokens that many rows hold."""
    global TILE
    TILE = setting["rows"] // next_pow2(group)
    TILED.update({k: setting[k] for k in ("block_n", "num_warps", "num_stages")})


def available(device: torch.device) -> bool:
    """Triton is installed and the GPU has bf16 tensor cores (compute capability 8.0, Ampere, or newer);
    elsewhere the GPU backend runs its plain path."""
    return HAS_TRITON and device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


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
    if qkv.is_cuda and HAS_TRITON:
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
    if q.is_cuda and HAS_TRITON:
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
        programs = min(t, t // TILE + sequences + 1)  # at least as many as the tiles
        jit()._tiles_kernel[(programs, hkv)](
            q, cache, out, packed, tables, scale * LOG2E, programs, *strides, GROUP=group,
            GROUP_PAD=next_pow2(group), TILE=TILE, D=d, BLOCK=block_size, BLOCK_N=max(TILED["block_n"], block_size),
            IEEE=ieee, num_warps=TILED["num_warps"], num_stages=TILED["num_stages"])
        rows = min(t, sequences * (TILED_MIN - 1))
        if rows == 0:
            return out.view(t, h * d)
    splits = splits or _splits(rows * hkv, q.device)
    part = dict(acc=out, m=out, l=out)  # unused when one split writes the output itself
    if splits > 1:
        part = dict(acc=q.new_empty(rows, splits, h, d, dtype=torch.float32),
                    m=q.new_empty(rows, splits, h, dtype=torch.float32),
                    l=q.new_empty(rows, splits, h, dtype=torch.float32))
    jit()._rows_kernel[(rows, hkv, splits)](
        q, cache, out, part["acc"], part["m"], part["l"], packed, tables, scale, t, *strides,
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), D=d, BLOCK=block_size,
        BLOCK_N=max(64, block_size), SPLITS=splits, IEEE=ieee, LISTED=tiled)
    if splits > 1:
        jit()._combine_kernel[(rows, h)](part["acc"], part["m"], part["l"], out, packed, t, packed.stride(0),
                                   packed.stride(1), out.stride(0), out.stride(1), H=h, D=d, SPLITS=splits,
                                   LISTED=tiled)
    return out.view(t, h * d)


def _triton_rope_store(qkv, cos, sin, cache, packed, heads: int, kv_heads: int, bias=None, x=None,
                       eps: float = 0.0) -> torch.Tensor:
    t, d = qkv.shape[0], cache.shape[-1]
    q = qkv.new_empty(t, heads, d)
    hidden = 1 if x is None else x.shape[1]
    jit()._rope_store_kernel[(t,)](
        qkv, cos, sin, cache, packed, q, qkv if bias is None else bias, qkv if x is None else x, eps, hidden,
        qkv.stride(0), cos.stride(0), sin.stride(0), packed.stride(0), packed.stride(1), cache.stride(0),
        cache.stride(1), cache.stride(2), q.stride(0), q.stride(1), 0 if x is None else x.stride(0), HEADS=heads,
        KV_HEADS=kv_heads, HALF=d // 2, BIAS=bias is not None, NORM=x is not None,
        BLOCK_H=min(1024, next_pow2(hidden)), ALL_HEADS=next_pow2(heads + kv_heads))
    return q


MAX_SPLITS = 16  # a split reads at least BLOCK_N (64) keys: at 580 keys only 10 splits have work


def _splits(programs: int, device: torch.device) -> int:
    """Split each token's keys over this many programs when few tokens would leave the GPU idle (decode):
    about two programs per multiprocessor, a power of two, at most MAX_SPLITS."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    want = 2 * sms // programs
    return 1 if want < 2 else min(MAX_SPLITS, 1 << (want.bit_length() - 1))
