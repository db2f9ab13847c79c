"""Weight-only int8 linear for CPU decode: int8 weights [out, in] with one scale per `group` inputs (a float16
value, held as float32, or as float16 in the lanes layouts), float32 activations in and out. The kernel
(csrc/int8_linear.cpp) reads each weight byte once per call for all activation rows, so decode (up to 32 rows in
the lanes8 layout, 16 in lanes) runs near memory bandwidth on 27-28% of float32's bytes.

It is built on first use by kernels/build.py and cached. `available()` never raises: when the
build fails it returns False and `why_unavailable` says why (one line: the compiler's first error);
`int8_linear` then computes the same result with plain torch ops (slowly, de-quantizing the whole weight).
`build_info()`: build.status("int8"), the flags it built with and whether with OpenMP, or its error.

The kernel's path decides how activations are rounded and how Int8Linear packs its weights at load (`layout`):
- lanes8, the default with AVX-512 VNNI: each row rounded to int8 per group of 32 inputs (one scale each, as
  llama.cpp's Q8_0 activations), the weights packed in tiles of 16 outputs with each group's inputs in fours,
  plus 128, as uint8; one vpdpbusd a row applies 64 weights. Less accurate than lanes, inside int8w's bound
  (results/profile/dev2core-lanes8-accuracy.json);
- lanes, the default with AVX2 (or AVX-512 without VNNI): each row rounded to int16 (one scale a row), the
  weights in tiles of 16 outputs with each input pair's 16 weights together, float16 scales in an array of
  the same order;
- int16 elsewhere (NEON, plain loops): the weights stay [out, in] and one row streams at a time.
Every path sums each group exactly in int32. It builds on any CPU, and quant.cpu_mode picks int8w wherever it
builds. MVLLM_INT8_PATH=lanes8|lanes|int16|float forces a path, for tests and same-run comparisons
(csrc/int8_kernels.h; any other value: one line on stderr, and the default).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import sys

import torch

from mvllm.kernels import build

GROUP = 32

why_unavailable = ""
_op = None


def quantize_weight(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q int8 [out, in], scales float32 [out, in // group]), symmetric: q = round(w / s)
    with s = absmax(group) / 127 rounded up to a float16 value (as Q8_0's scales are float16): the lanes layout
    stores them in half the bytes, exactly, and no |w / s| exceeds 127."""
    out, inputs = w.shape
    if inputs % group:
        raise ValueError(f"in_features {inputs} is not a multiple of the group size {group}")
    groups = w.detach().float().reshape(out, inputs // group, group)
    scales = half_up(groups.abs().amax(-1) / 127)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(groups / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(out, inputs), scales


def half_up(s: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> the nearest float16 value at or above it, as float32."""
    h = s.half()
    below = h.float() < s
    h[below] = (h[below].view(torch.int16) + 1).view(torch.float16)  # the next float16 up (positive values)
    return h.float()


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out, inputs = q.shape
    groups = scales.shape[1]
    return (q.float().reshape(out, groups, inputs // groups) * scales[..., None]).reshape(out, inputs)


PATHS = ("int16", "float", "lanes", "lanes8")
LANE_OUTS = 16  # outputs a tile of the lanes layout


def packs() -> bool:
    """Whether Int8Linear packs its weights in a lanes layout (the kernel's path here takes one): builds the
    kernel on first use; False where it is unavailable."""
    return bool(layout())


def layout() -> str:
    """The layout the kernel's path here packs weights in: "lanes8" (int8 activations, AVX-512 VNNI), "lanes"
    (int16 activations, AVX2 or AVX-512BW) or "" (they stay [out, in]; or the kernel is unavailable)."""
    return torch.ops.mvllm_int8.layout(GROUP) if available() else ""


def has_lanes() -> bool:
    """Whether this build has the lanes kernel (AVX2 or AVX-512BW), whichever path MVLLM_INT8_PATH picks."""
    return available() and torch.ops.mvllm_int8.has_lanes()


def has_lanes8() -> bool:
    """Whether this build has the lanes8 kernel (AVX-512 VNNI), whichever path MVLLM_INT8_PATH picks."""
    return available() and torch.ops.mvllm_int8.has_lanes8()


def amx() -> bool:
    """Whether lanes8 calls of more than 8 rows (csrc/int8_kernels.h's kAmxAbove) take AMX tiles here: built with
    AMX (-march=native on a Sapphire Rapids or later Xeon), the tile state granted by Linux, MVLLM_INT8_AMX not 0."""
    return has_lanes8() and torch.ops.mvllm_int8.amx(GROUP)


HUGE = 2 << 20  # a transparent huge page on x86-64 and aarch64 Linux with 4 KB pages


def huge_pages() -> bool:
    """Whether pack() asks Linux for transparent huge pages (MVLLM_HUGE_PAGES=0 turns it off)."""
    return sys.platform.startswith("linux") and os.environ.get("MVLLM_HUGE_PAGES", "1") != "0"


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in a private anonymous mapping of its own, advised MADV_HUGEPAGE before it is
    first touched and starting on a 2 MB boundary, so that (where transparent_hugepage is "madvise" or "always")
    it is backed by 2 MB pages: a decode step streams every weight once, and 4 KB pages cost a TLB miss each. Not
    torch.empty: once larger blocks were freed (as quantizing a model does) glibc serves a few MB from its heap,
    memory already touched, which the advice no longer turns into huge pages (a shared mapping would follow
    shmem_enabled instead). Under one page, or where the platform has no MADV_HUGEPAGE, a plain tensor."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # freed with the tensor
    region.madvise(mmap.MADV_HUGEPAGE)
    buf = torch.frombuffer(region, dtype=torch.uint8)
    start = -buf.data_ptr() % HUGE
    return buf[start:start + nbytes].view(dtype).view(shape)


def pack(q: torch.Tensor, scales: torch.Tensor, kind: str | None = None,
         huge: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in], scales [out, groups]) -> a lanes layout (csrc/int8_linear.cpp), `kind` "lanes" or "lanes8"
    (default: layout(), else "lanes"). lanes: q int8 [out / 16, groups, 16 * group], each group's inputs in
    pairs for 16 outputs; lanes8: q uint8 of that shape, each group's inputs in fours for 16 outputs, every
    weight plus 128. Both: scales float16 [out / 16, groups, 16]. int8_linear takes any layout. q goes in
    huge_empty() memory where `huge` (default: huge_pages())."""
    kind = kind or layout() or "lanes"
    if kind not in ("lanes", "lanes8"):
        raise ValueError(f"pack: the layouts are lanes and lanes8, got {kind!r}")
    step = 4 if kind == "lanes8" else 2
    out, inputs = q.shape
    groups = scales.shape[1]
    group = inputs // groups
    if out % LANE_OUTS or group % (4 * step):
        raise ValueError(f"the {kind} layout needs out_features a multiple of {LANE_OUTS} and groups of a multiple "
                         f"of {4 * step} inputs, got {out} and {group}")
    tiles = out // LANE_OUTS
    if kind == "lanes8":
        q = (q.to(torch.int16) + 128).to(torch.uint8)
    qp = q.view(tiles, LANE_OUTS, groups, group // step, step).permute(0, 2, 3, 1, 4).reshape(tiles, groups, -1)
    half = scales.half()
    if not torch.equal(half.float(), scales):
        raise ValueError("the lanes layouts store scales in float16: quantize_weight's scales are")
    huge = huge_pages() if huge is None else huge
    qp = huge_empty(tuple(qp.shape), qp.dtype).copy_(qp) if huge else qp.contiguous()
    return qp, half.view(tiles, LANE_OUTS, groups).transpose(1, 2).contiguous()


def unpack(qp: torch.Tensor, sp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """pack's inverse (either layout: lanes8's q is uint8)."""
    tiles, groups, width = qp.shape
    group = width // LANE_OUTS
    step = 4 if qp.dtype == torch.uint8 else 2
    q = qp.view(tiles, groups, group // step, LANE_OUTS, step).permute(0, 3, 1, 2, 4).reshape(tiles * LANE_OUTS, -1)
    if qp.dtype == torch.uint8:
        q = (q.to(torch.int16) - 128).to(torch.int8)
    return q.contiguous(), sp.float().transpose(1, 2).reshape(tiles * LANE_OUTS, groups).contiguous()


def _load():
    asked = os.environ.get("MVLLM_INT8_PATH")
    if asked and asked not in PATHS:
        print(f"mvllm: MVLLM_INT8_PATH={asked!r} is not one of {', '.join(PATHS)}; the int8 kernel takes its "
              "default path", file=sys.stderr, flush=True)
    build.build("mvllm_int8_linear", "int8_linear.cpp")
    return torch.ops.mvllm_int8.int8_linear


def _try_load():
    return build.attempt(_load)


@functools.cache
def available() -> bool:
    global _op, why_unavailable
    _op, why_unavailable = _try_load()
    return _op is not None


def build_info() -> dict:
    """How the kernel built in this process (build.status): builds nothing; call available() first. Built, it
    also names the path a call takes at GROUP (`path`: int16 or float activations and their instructions)."""
    info = build.status("int8")
    if _op is not None:
        info["path"] = torch.ops.mvllm_int8.path(GROUP)
    return info


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """x float32 [..., in] -> float32 [..., out] = x @ dequantize(q, scales).T (+ bias).
    Bad inputs raise ValueError here, before the C++ op (whose own checks crashed the process instead of
    raising on one machine: torch 2.11 with the extension built by g++ 13). check=False: the caller's
    inputs are valid by construction (quant.Int8Linear, on the decode path)."""
    lanes = q.dim() == 3  # pack's layout
    inputs, out = (q.shape[1] * q.shape[2] // LANE_OUTS, q.shape[0] * LANE_OUTS) if lanes else (q.shape[1], q.shape[0])
    if check and (x.dtype != torch.float32 or x.shape[-1] != inputs):
        raise ValueError(f"int8_linear takes float32 inputs of {inputs} features, got {x.dtype} "
                         f"with {x.shape[-1]} inputs")
    if check and scales.dtype != (torch.float16 if lanes else torch.float32):
        raise ValueError(f"int8_linear's scales are float16 in the lanes layouts (pack), else float32; got "
                         f"{scales.dtype}")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if available():
        y = _op(rows, q, scales, bias)
    else:
        y = torch.nn.functional.linear(rows, dequantize(*(unpack(q, scales) if lanes else (q, scales))), bias)
    return y.view(*x.shape[:-1], out)
