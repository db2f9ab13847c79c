"""Builds mvllm's C++ CPU kernels (engine/csrc/) on first use with torch.utils.cpp_extension, and caches them.

A build needs ninja (installed with mvllm) and a C++ compiler: $CXX, else `c++` (cpp_extension's choice).

Flag sets, tried in order until one builds (`flag_sets()`; the platform is read through mvllm.machine at each call,
so tests can stand in for a Mac):
- Linux: -O3 -march=native -fopenmp, then -O3 -fopenmp, -O3 -march=native, -O3.
- macOS: Apple clang rejects -fopenmp, and the macOS wheel's at::parallel_for is OpenMP, so a build without
  OpenMP runs every kernel on one thread. The wheel ships its own OpenMP runtime (torch/lib/libomp.dylib, with
  omp.h in torch/include), so where that file is (`torch_libomp()`) the first set is
  -O3 -Xpreprocessor -fopenmp, linked with -L<torch/lib> -lomp -Wl,-rpath,<torch/lib>: the same runtime torch
  itself runs on, never a second one. Then -O3. (-march=native is tried on x86 Macs only: Apple clang on
  arm64 may not take it, and NEON is the arm64 baseline anyway.)

Each attempt lands in $MVLLM_CACHE/ext/<torch version>-<key>/, the key hashing the compiler (the CXX string and
the first line of its --version), the flags, the source and the headers beside it (csrc/*.h: the kernels that
fused.cpp, int8_linear.cpp and layers.cpp share) and this CPU's features (a -march=native build runs
only on CPUs like the one that built it). A directory that already holds the built library is loaded from
without running ninja, so checkouts at different paths share one build (cpp_extension's build file names the
source by its path, and ninja would rebuild for each checkout in turn).

A flag set that fails leaves `failed.json` in its directory: the compiler's first error line, the flags, the
compiler and the build log's tail. Every later process (the server, each worker, the next run) reads that
marker instead of compiling again, and prints nothing: the failure is printed once, as one line on stderr,
by the process that found it ("mvllm: the fused CPU kernels did not build (<first error>); using plain
PyTorch ops ..."). A change of compiler, flags, source or torch version changes the key, so it is tried
again; deleting the marker (the line names it) retries too. A build that succeeds only without OpenMP is
printed once the same way (it runs on one thread). The attempts of one kernel are serialised between
processes by a lock file (cache/ext/<name>.lock), so workers starting together build once.

Build status, queryable (for `mvllm env` and profiles):
- `status(name) -> dict` with name "fused" or "int8" (or the extension names "mvllm_fused",
  "mvllm_int8_linear"): `Build.as_dict()` of this process's outcome, never building anything; before the
  first use it says "not built yet". cpu_fused.build_info() and cpu_kernels.build_info() return the same.
- The dict: {"name": str, "ok": bool, "flags": [str] (the cflags of the build that loaded, or of the last
  set tried), "ldflags": [str], "openmp": bool (built with OpenMP: at::parallel_for spreads over threads),
  "error": str (the compiler's first error line; "" when ok), "compiler": str ("c++: c++ (Debian 12.2.0)
  12.2.0"), "cached": bool (the outcome came from the cache: a failure marker, or an up-to-date build),
  "tried": [{"flags": [str], "error": str, "cached": bool}] (the flag sets that failed before it),
  "marker": str (the failure marker of a kernel that did not build, "" otherwise), "summary": str
  ("built with -O3 -march=native -fopenmp (OpenMP)", "not built: <error>", "not built yet ...")}.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from mvllm import machine
from mvllm.machine import cache_dir

CSRC = Path(__file__).parent / "csrc"
FAILED = "failed.json"
LOG_TAIL = 8000  # characters of the build log kept in a failure marker


@dataclasses.dataclass(frozen=True)
class Kernel:
    short: str
    label: str
    fallback: str


# extension name -> how the messages and status() call it
KERNELS = {
    "mvllm_fused": Kernel("fused", "the fused CPU kernels", "using plain PyTorch ops"),
    "mvllm_int8_linear": Kernel("int8", "the int8 CPU kernel", "quant=int8w does not run here"),
    "mvllm_layers": Kernel("layers", "the CPU layer loop", "the layers run from Python"),
}


@dataclasses.dataclass(frozen=True)
class FlagSet:
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...] = ()
    openmp: bool = False


@dataclasses.dataclass
class Build:
    """What building one kernel came to in this process."""

    name: str
    ok: bool = False
    flags: list[str] = dataclasses.field(default_factory=list)
    ldflags: list[str] = dataclasses.field(default_factory=list)
    openmp: bool = False
    error: str = ""
    compiler: str = ""
    cached: bool = False
    tried: list[dict] = dataclasses.field(default_factory=list)
    marker: str = ""  # the failure marker of a build that did not load
    attempted: bool = True

    @property
    def summary(self) -> str:
        if not self.attempted:
            return "not built yet (built on first use)"
        if self.ok:
            return f"built with {' '.join(self.flags)} ({'OpenMP' if self.openmp else 'no OpenMP: one thread'})"
        return f"not built: {self.error}"

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("attempted")
        d["summary"] = self.summary
        return d


class BuildError(RuntimeError):
    """No flag set built; str() is one line, `build` has the rest."""

    def __init__(self, build: Build, source: str):
        super().__init__(f"{source} did not build: {build.error}")
        self.build = build


_results: dict[str, Build] = {}


def _kernel(name: str) -> tuple[str, Kernel]:
    for ext, k in KERNELS.items():
        if name in (ext, k.short):
            return ext, k
    return name, Kernel(name, f"the CPU kernel {name}", "using plain PyTorch ops")


def status(name: str) -> dict:
    """This process's build outcome of kernel `name` ("fused", "int8" or an extension name) as a dict (see the
    module's docstring); builds nothing."""
    ext, _ = _kernel(name)
    result = _results.get(ext)
    if result is None:
        result = Build(ext, compiler=compiler(), attempted=False)
    return result.as_dict()


# ---- the platform, the compiler, the flags ----

def cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def darwin() -> bool:
    return machine.system() == "darwin"


def torch_libomp() -> Path | None:
    """The folder of torch's own OpenMP runtime where the wheel ships one (macOS: torch/lib/libomp.dylib)."""
    lib = Path(torch.__file__).parent / "lib"
    return lib if (lib / "libomp.dylib").exists() else None


def omp_include() -> list[str]:
    """-I for torch's omp.h where it is not in torch/include itself (already on cpp_extension's include path)."""
    include = Path(torch.__file__).parent / "include"
    if (include / "omp.h").exists():
        return []
    found = next(include.glob("*/omp.h"), None)
    return [f"-I{found.parent}"] if found else []


def flag_sets() -> list[FlagSet]:
    """The flag sets to try here, best first (see the module's docstring)."""
    x86 = machine.x86()
    if darwin():
        native = ["-march=native"] if x86 else []
        lib = torch_libomp()
        omp = None
        if lib is not None:
            omp = (("-Xpreprocessor", "-fopenmp", *omp_include()), ("-L" + str(lib), "-lomp", f"-Wl,-rpath,{lib}"))
    else:
        native = ["-march=native"]
        omp = (("-fopenmp",), ("-fopenmp",))
    sets = []
    for with_omp in ((True, False) if omp else (False,)):
        for n in ((native, []) if native else ([],)):
            cflags = ("-O3", *n, *(omp[0] if with_omp else ()))
            sets.append(FlagSet(cflags, omp[1] if with_omp else (), with_omp))
    return sets


def cxx() -> str:
    """The compiler cpp_extension runs (torch.utils.cpp_extension.get_cxx_compiler on POSIX)."""
    return os.environ.get("CXX", "c++")


def compiler() -> str:
    """'<CXX>: <first line of its --version>', which keys the cache."""
    return f"{cxx()}: {_version(cxx())}"


@functools.cache
def _version(command: str) -> str:
    try:
        out = subprocess.run([*shlex.split(command), "--version"], capture_output=True, text=True, timeout=60)
        lines = (out.stdout or out.stderr).strip().splitlines()
        return lines[0].strip() if lines else f"exit status {out.returncode}"
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return f"not runnable ({type(e).__name__})"


def build_dir(source: Path, flags: FlagSet, compiler_id: str | None = None) -> Path:
    compiler_id = compiler() if compiler_id is None else compiler_id
    headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # what the source may include
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *headers, " ".join(flags.cflags).encode(),
                                     " ".join(flags.ldflags).encode(), compiler_id.encode(),
                                     cpu_features().encode()])).hexdigest()
    path = cache_dir() / "ext" / f"{torch.__version__}-{key[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def ninja_on_path() -> None:
    """A pip-installed ninja sits next to the venv's python, which is not on PATH unless activated."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


# ---- the first error of a build log ----

_PREFIX = re.compile(r"^Error building extension '[^']*'(: )?")
_ERROR = re.compile(r"\berror\b", re.IGNORECASE)


def first_error(log: str, compiler_command: str = "", source_dir: str = "") -> str:
    """The first line of a failed build's output that is the compiler's error: not ninja's progress lines nor
    the echoed commands. Paths under source_dir are shortened to file names."""
    log = _PREFIX.sub("", log.strip())
    first = shlex.split(compiler_command)[0] if compiler_command.strip() else ""

    def command(line: str) -> bool:
        return (line.startswith(("[", "FAILED:", "ninja:")) or " -MMD " in line
                or bool(first) and line.split(" ", 1)[0] in (first, os.path.basename(first)))

    lines = [line.strip() for line in log.splitlines() if line.strip()]
    output = [line for line in lines if not command(line)]
    line = next((x for x in output if _ERROR.search(x)), output[0] if output else (lines[0] if lines else ""))
    if source_dir:
        line = line.replace(source_dir.rstrip("/") + "/", "")
    return line[:300] or "unknown error"


# ---- building ----

@contextlib.contextmanager
def _lock(path: Path):
    """An exclusive lock between processes (flock) for the build of one kernel."""
    try:
        import fcntl
    except ImportError:  # Windows: cpp_extension's own lock only
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_marker(path: Path) -> str | None:
    """The error line of a failure marker, None where there is none (or it is unreadable)."""
    try:
        return str(json.loads(path.read_text())["error"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build(name: str, source: str | os.PathLike) -> Build:
    """Build (or reuse the cached build of) `source` (a file in csrc/, or a path) and load its ops into torch.ops.
    Returns the Build; raises BuildError (no flag set built) or RuntimeError (no ninja)."""
    from torch.utils import cpp_extension

    src = Path(source) if Path(source).is_absolute() else CSRC / source
    ninja_on_path()
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja not found (pip install ninja)")
    _, kernel = _kernel(name)
    compiler_id = compiler()
    tried: list[dict] = []
    result = None
    last_marker = ""
    with _lock(cache_dir() / "ext" / f"{name}.lock"):
        for flags in flag_sets():
            directory = build_dir(src, flags, compiler_id)
            marker = directory / FAILED
            last_marker = str(marker)
            error = read_marker(marker)
            if error is not None:
                tried.append({"flags": list(flags.cflags), "error": error, "cached": True})
                continue
            stale = directory / "lock"  # cpp_extension's own lock, left by a process killed mid-build
            stale.unlink(missing_ok=True)  # nobody else builds here: we hold the kernel's lock
            ext = f"{name}_{directory.name[-8:]}"
            library = directory / f"{ext}{getattr(cpp_extension, 'LIB_EXT', '.so')}"
            if library.exists() and _load_built(library):
                result = Build(name, True, list(flags.cflags), list(flags.ldflags), flags.openmp, "", compiler_id,
                               True, tried)
                break
            try:
                cpp_extension.load(name=ext, sources=[str(src)],
                                   extra_cflags=list(flags.cflags), extra_ldflags=list(flags.ldflags),
                                   build_directory=str(directory), is_python_module=False, verbose=False)
            except Exception as e:
                error = first_error(str(e), cxx(), str(src.parent))
                _write_marker(marker, error, flags, compiler_id, src, str(e))
                tried.append({"flags": list(flags.cflags), "error": error, "cached": False})
                continue
            result = Build(name, True, list(flags.cflags), list(flags.ldflags), flags.openmp, "", compiler_id,
                           False, tried)
            break
    if result is not None:
        _results[name] = result
        fresh = [t for t in tried if not t["cached"]]
        omp_errors = [t["error"] for t in fresh if "-fopenmp" in t["flags"]]
        if not result.openmp and omp_errors:  # the last OpenMP set tried has the fewest other flags to blame
            _say(f"mvllm: {kernel.label} built without OpenMP ({omp_errors[-1]}): one thread only, whatever "
                 "threads= says")
        return result
    last = tried[-1] if tried else {"flags": [], "error": "no flag set to try"}
    result = Build(name, False, last["flags"], [], False, last["error"], compiler_id,
                   all(t["cached"] for t in tried), tried[:-1], last_marker)
    _results[name] = result
    if not result.cached:
        _say(f"mvllm: {kernel.label} did not build ({result.error}); {kernel.fallback}. Not retried until the "
             f"compiler, flags, source or torch change (the log: {last_marker}; delete it to retry)")
    raise BuildError(result, src.name)


def _load_built(library: Path) -> bool:
    """Load a library already built in its keyed directory, without ninja: the key covers everything the
    build reads, so it is this build whichever checkout compiled it (ninja would rebuild it for each checkout,
    its build file naming the source by path). False where it does not load (then it is built again)."""
    try:
        torch.ops.load_library(str(library))
        return True
    except OSError:
        library.unlink(missing_ok=True)
        return False


def _write_marker(path: Path, error: str, flags: FlagSet, compiler_id: str, source: Path, log: str) -> None:
    record = {"error": error, "flags": list(flags.cflags), "ldflags": list(flags.ldflags), "compiler": compiler_id,
              "torch": torch.__version__, "source": str(source), "log": log[-LOG_TAIL:]}
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)
    except OSError:
        pass


def attempt(load) -> tuple[object, str]:
    """(what load() returns, "") or (None, the reason it failed, one line for a build error): never raises."""
    try:
        return load(), ""
    except BuildError as e:
        return None, str(e)
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"
