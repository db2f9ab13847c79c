"""Builds mvllm's C++ CPU kernels (engine/csrc/) on first use with torch.utils.cpp_extension, and caches them.

A build needs ninja (installed with mvllm) and a C++ compiler. It lands in
$MVLLM_CACHE/ext/<torch version>-<hash of the source, the flags and this CPU's features>/, since a
-march=native build runs only on CPUs like the one that built it. Flag sets are tried in order, so that a
compiler without OpenMP (Apple clang) or without -march=native still gets a working, slower build.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
from pathlib import Path

import torch

from mvllm.model.loader import cache_dir

CSRC = Path(__file__).parent / "csrc"
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3"])


def cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def build_dir(source: Path, flags: list[str]) -> str:
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode() + cpu_features().encode()).hexdigest()
    path = cache_dir() / "ext" / f"{torch.__version__}-{key[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def ninja_on_path() -> None:
    """A pip-installed ninja sits next to the venv's python, which is not on PATH unless activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build(name: str, source: str) -> None:
    """Build (or reuse the cached build of) csrc/`source` and load its ops into torch.ops; raises on failure."""
    from torch.utils import cpp_extension

    ninja_on_path()
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja not found (pip install ninja)")
    errors = []
    for flags in FLAG_SETS:
        try:
            cpp_extension.load(name=name, sources=[str(CSRC / source)], extra_cflags=flags,
                               extra_ldflags=[f for f in flags if f == "-fopenmp"],
                               build_directory=build_dir(CSRC / source, flags), is_python_module=False,
                               verbose=False)
            return
        except Exception as e:
            errors.append(f"{' '.join(flags)}: {e}")
    raise RuntimeError(f"could not build {source}\n" + "\n".join(errors))


def attempt(load) -> tuple[object, str]:
    """(what load() returns, "") or (None, the reason it failed): never raises."""
    try:
        return load(), ""
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
