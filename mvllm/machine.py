"""What this machine and its torch build can run: platform, cores to compute on, oneDNN, OpenMP.

Every check here is a plain query that cannot raise, whatever the build: PyTorch's macOS arm64 wheel has no
oneDNN (so no `torch.ops.mkldnn._is_mkldnn_bf16_supported`). The rest of mvllm asks here instead of probing
torch itself, so the tests can stand in for a Mac by patching this module.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
from pathlib import Path


def system() -> str:
    """'linux', 'darwin' or 'windows'."""
    return platform.system().lower()


def arch() -> str:
    """'x86_64', 'arm64' (Apple), 'aarch64' (Linux ARM)..."""
    return platform.machine().lower()


def apple_silicon() -> bool:
    return system() == "darwin" and arch() == "arm64"


def x86() -> bool:
    return arch() in ("x86_64", "amd64")


def sysctl(name: str) -> int | None:
    """A macOS integer sysctl (e.g. hw.perflevel0.physicalcpu), None where there is none."""
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
        return int(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def logical_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def compute_cores() -> tuple[int, str]:
    """(cores a CPU backend should spread over, why). Apple silicon: its performance cores (an M2 has 4 of
    its 8), as llama.cpp counts them; its efficiency cores would make every step wait for the slowest thread.
    Elsewhere: the logical CPUs this process may run on."""
    if apple_silicon():
        perf = sysctl("hw.perflevel0.physicalcpu")
        if perf:
            return perf, f"{perf} performance cores (hw.perflevel0.physicalcpu)"
    n = logical_cpus()
    return n, f"{n} logical CPUs"


def probe(ask, default):
    """ask(torch), or `default` where this build lacks what it asks about (AttributeError, RuntimeError)."""
    import torch

    try:
        return ask(torch)
    except (AttributeError, RuntimeError):
        return default


def onednn() -> bool:
    return probe(lambda t: bool(t.backends.mkldnn.is_available()), False)


def onednn_bf16() -> bool:
    """oneDNN is in this build and this CPU computes bf16 natively (AVX-512 BF16 or AMX); the macOS wheel has
    no `_is_mkldnn_bf16_supported` op at all. On x86 oneDNN's own probe also answers yes on plain AVX-512, where
    it emulates bf16 (a 516-token prefill through it took 6.2 s on such a Xeon, 0.8 s through the int8 kernel:
    results/profile/dev2core-no-native-bf16.txt), so the CPU's own flags decide there."""
    if not (onednn() and probe(lambda t: bool(t.ops.mkldnn._is_mkldnn_bf16_supported()), False)):
        return False
    return not x86() or native_bf16()


def native_bf16() -> bool:
    """This x86 CPU has bf16 instructions: AVX-512 BF16, or AMX tiles (torch.cpu's probes; where this torch
    lacks them, oneDNN's word is taken)."""
    return probe(lambda t: bool(t.cpu._is_avx512_bf16_supported() or t.cpu._is_amx_tile_supported()), True)


def openmp() -> bool:
    """torch's own parallel backend is OpenMP (at::parallel_for spreads over threads in our kernels)."""
    return probe(lambda t: "ATen parallel backend: OpenMP" in t.__config__.parallel_info(), False)


def cpu_capability() -> str:
    """torch's kernel dispatch level: AVX512, AVX2, DEFAULT (ARM: NEON/SVE builds report their own)."""
    return probe(lambda t: t.backends.cpu.get_cpu_capability(), "unknown")


def avx512() -> bool:
    return x86() and "AVX512" in cpu_capability()


def mps() -> bool:
    return probe(lambda t: bool(t.backends.mps.is_available()), False)


def build_facts() -> dict:
    """The torch build, as vLLM's collect-env reports it."""
    import torch

    return {"torch": torch.__version__, "system": system(), "arch": arch(), "onednn": onednn(),
            "onednn_bf16": onednn_bf16(), "openmp": openmp(), "cpu_capability": cpu_capability(),
            "cuda": torch.version.cuda, "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "mps": mps(), "compute_cores": compute_cores()[0], "logical_cpus": logical_cpus()}


def cache_dir() -> Path:
    """Where mvllm keeps what it makes once per machine: converted GGUF models, built kernels, compile caches."""
    return Path(os.environ.get("MVLLM_CACHE", Path.home() / ".cache" / "mvllm"))


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for the next allocation instead of handing it back to the system: blocks up
    to 32 MB (glibc's ceiling for the setting) from the heap, trimmed only past 1 GB free at its top. A CPU step
    allocates its activations afresh each op (a 516-token prefill's gate/up output is 20 MB); when glibc unmaps
    those pages and maps them again, every first touch is a page fault: about 94,000 a 516-token prefill at 8
    threads on the H200 machine's Xeon without this, 0 with it (results/profile/README.md, memory and threads); ggml
    plans one buffer for the whole graph for the same reason. Called once the model is loaded, so the load's
    temporaries are still handed back.
    Linux with glibc only (else False); MVLLM_KEEP_FREED=0 leaves malloc as it is."""
    if system() != "linux" or os.environ.get("MVLLM_KEEP_FREED", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):  # musl and other C libraries without mallopt
        return False
