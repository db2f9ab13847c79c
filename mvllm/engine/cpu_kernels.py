"""Weight-only int8 linear for CPU decode: int8 weights [out, in] with one float32 scale per `group`
inputs, float32 activations. The kernel (csrc/int8_linear.cpp) reads each weight byte once per call for
all activation rows, so decode (1-8 rows) runs near memory bandwidth on 28% of float32's bytes.

It is JIT-built with torch.utils.cpp_extension (needs ninja and a C++ compiler) on first use and cached
under $MVLLM_CACHE/ext/<torch version>-<hash of source and flags>/. `available()` never raises: when the
build fails it returns False and `why_unavailable` says why; `int8_linear` then computes the same result
with plain torch ops (slowly, de-quantizing the whole weight).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil

import torch

from mvllm.model.loader import cache_dir

GROUP = 32
SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "int8_linear.cpp")
# Tried in order: compilers without OpenMP (Apple clang) or -march=native still get a working build.
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])

why_unavailable = ""
_op = None


def quantize_weight(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q int8 [out, in], scales float32 [out, in // group]), symmetric: q = round(w / s)
    with s = absmax(group) / 127."""
    out, inputs = w.shape
    if inputs % group:
        raise ValueError(f"in_features {inputs} is not a multiple of the group size {group}")
    groups = w.detach().float().reshape(out, inputs // group, group)
    scales = groups.abs().amax(-1) / 127
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(groups / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(out, inputs), scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out, inputs = q.shape
    groups = scales.shape[1]
    return (q.float().reshape(out, groups, inputs // groups) * scales[..., None]).reshape(out, inputs)


def _cpu_features() -> str:
    """-march=native builds are per CPU: a cache shared between machines must not mix them up."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build_dir(flags: list[str]) -> str:
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + " ".join(flags).encode() + _cpu_features().encode()).hexdigest()[:16]
    path = cache_dir() / "ext" / f"{torch.__version__}-{key}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def _ninja_on_path() -> None:
    """A pip-installed ninja sits next to the venv's python, which is not on PATH unless activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _load():
    """Build (or reuse the cached build) and load the extension; returns the op. Raises on failure."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja not found (pip install ninja)")
    errors = []
    for flags in FLAG_SETS:
        ldflags = [f for f in flags if f == "-fopenmp"]
        try:
            cpp_extension.load(name="mvllm_int8_linear", sources=[SOURCE], extra_cflags=flags,
                               extra_ldflags=ldflags, build_directory=_build_dir(flags),
                               is_python_module=False, verbose=False)
            return torch.ops.mvllm_int8.int8_linear
        except Exception as e:
            errors.append(f"{' '.join(flags)}: {e}")
    raise RuntimeError("could not build the int8 kernel\n" + "\n".join(errors))


def _try_load():
    """(op, "") or (None, reason)."""
    try:
        return _load(), ""
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


@functools.cache
def available() -> bool:
    global _op, why_unavailable
    _op, why_unavailable = _try_load()
    return _op is not None


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x float32 [..., in] -> float32 [..., out] = x @ dequantize(q, scales).T (+ bias).
    Bad inputs raise ValueError here, before the C++ op (whose own checks crashed the process instead of
    raising on one machine: torch 2.11 with the extension built by g++ 13)."""
    if x.dtype != torch.float32 or x.shape[-1] != q.shape[1]:
        raise ValueError(f"int8_linear takes float32 inputs of {q.shape[1]} features, got {x.dtype} "
                         f"with {x.shape[-1]} inputs")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if available():
        y = _op(rows, q, scales, bias)
    else:
        y = torch.nn.functional.linear(rows, dequantize(q, scales), bias)
    return y.view(*x.shape[:-1], q.shape[0])
