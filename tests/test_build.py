"""Building the C++ CPU kernels (mvllm/engine/build.py): the flag sets per platform, torch's own OpenMP on
macOS, the compiler's first error, failures printed once and cached for every later process, no int8 build on
a machine without AVX-512, and the sources compiling for aarch64.

A fake Apple clang (a shell script in $CXX, which cpp_extension honours) rejects -fopenmp and -march=native as
Apple clang does and passes everything else to the real g++; it logs each call, so a test can tell whether a
later process compiled anything. Real builds use a tiny source (about 12 s each on 2 cores)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import libomp_standin

from mvllm import machine
from mvllm.engine import quant
from mvllm.kernels import build, cpu_fused, cpu_int8

REPO = Path(__file__).resolve().parents[1]
MARCH = "clang: error: the clang compiler does not support '-march=native'"
FOPENMP = "clang: error: unsupported option '-fopenmp'"


# threads_used: how many threads at::parallel_for ran on (1 where the build has no OpenMP)
TINY = """#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
namespace {
int64_t threads_used(int64_t n) {
  std::atomic<int64_t> mask{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { mask |= int64_t(1) << std::min(at::get_thread_num(), 62); });
  return __builtin_popcountll(mask.load());
}
int64_t openmp() {
#ifdef _OPENMP
  return _OPENMP;
#else
  return 0;
#endif
}
}  // namespace
TORCH_LIBRARY(NAMESPACE, m) {
  m.def("threads_used(int n) -> int", &threads_used);
  m.def("openmp() -> int", &openmp);
}
"""

needs_gcc = pytest.mark.skipif(sys.platform != "linux" or shutil.which("g++") is None,
                               reason="the fake Apple clang runs the real g++ (Linux)")


def tiny_source(tmp_path: Path, namespace: str) -> Path:
    path = tmp_path / f"{namespace}.cpp"
    path.write_text(TINY.replace("NAMESPACE", namespace))
    return path


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines()


def compiles(lines: list[str]) -> list[str]:
    """The calls that compile or link (not --version, -v, -dumpversion)."""
    return [line for line in lines if " -c " in f" {line} " or " -shared" in line]


def threads_used(namespace: str) -> int:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        return getattr(torch.ops, namespace).threads_used(64)
    finally:
        torch.set_num_threads(threads)


def in_fresh_process(env: dict, name: str, source: Path) -> tuple[dict, str]:
    """build.build in a new Python process: (its Build as a dict, its stderr)."""
    code = ("import json, sys\nfrom mvllm.kernels import build\n"
            f"try:\n    b = build.build({name!r}, {str(source)!r})\n"
            "except build.BuildError as e:\n    b = e.build\n"
            "print(json.dumps(b.as_dict()))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


# ---- flag sets per platform (no compiler) ----

def pretend(monkeypatch, system: str, arch: str, libomp: Path | None = None):
    monkeypatch.setattr(machine, "system", lambda: system.lower())
    monkeypatch.setattr(machine, "arch", lambda: arch)
    monkeypatch.setattr(build, "torch_libomp", lambda: libomp)


def test_linux_flag_sets_start_with_native_openmp(monkeypatch):
    pretend(monkeypatch, "Linux", "x86_64")
    sets = build.flag_sets()
    assert [s.cflags for s in sets] == [("-O3", "-march=native", "-fopenmp"), ("-O3", "-fopenmp"),
                                        ("-O3", "-march=native"), ("-O3",)]
    assert [s.openmp for s in sets] == [True, True, False, False]
    assert sets[0].ldflags == ("-fopenmp",) and sets[-1].ldflags == ()


def test_mac_flag_sets_use_torchs_own_libomp(monkeypatch):
    lib = Path("/wheel/torch/lib")
    pretend(monkeypatch, "Darwin", "arm64", lib)
    sets = build.flag_sets()
    assert sets[0].cflags[:3] == ("-O3", "-Xpreprocessor", "-fopenmp") and sets[0].openmp
    assert sets[0].ldflags == ("-L/wheel/torch/lib", "-lomp", "-Wl,-rpath,/wheel/torch/lib")
    assert sets[-1] == build.FlagSet(("-O3",))
    assert not any("-march=native" in s.cflags or "-fopenmp" in s.ldflags for s in sets)
    # no torch libomp (an older wheel): no OpenMP set at all, rather than a second OpenMP runtime
    pretend(monkeypatch, "Darwin", "arm64", None)
    assert build.flag_sets() == [build.FlagSet(("-O3",))]
    pretend(monkeypatch, "Darwin", "x86_64", lib)
    assert [s.cflags[:2] for s in build.flag_sets()] == [("-O3", "-march=native"), ("-O3", "-Xpreprocessor"),
                                                              ("-O3", "-march=native"), ("-O3",)]


def test_torch_libomp_only_where_the_wheel_ships_it():
    lib = Path(torch.__file__).parent / "lib"
    assert build.torch_libomp() == (lib if (lib / "libomp.dylib").exists() else None)


def test_first_error_is_the_compilers_line():
    cmd = "/tmp/test_error0/bin/clang++"
    log = (f"Error building extension 'mvllm_fused_1234': [1/2] {cmd} -MMD -MF fused.o.d -DX -c "
           "/src/csrc/fused.cpp -o fused.o\nFAILED: fused.o\n"
           f"{cmd} -MMD -MF fused.o.d -DX -c /src/csrc/fused.cpp -o fused.o\n"
           "In file included from /src/csrc/fused.cpp:9:\n"
           "/src/csrc/fused.cpp:12:5: error: 'foo' was not declared in this scope\n"
           "   12 |     foo();\nninja: build stopped: subcommand failed.\n")
    assert build.first_error(log, cmd, "/src/csrc") == "fused.cpp:12:5: error: 'foo' was not declared in this scope"
    assert build.first_error(f"Error building extension 'x': [1/2] c++ -MMD a\nFAILED: a.o\n{FOPENMP}\n"
                                 "ninja: build stopped: subcommand failed.", "c++") == FOPENMP
    # no line says error (a missing compiler): the first line that is not ninja's
    assert build.first_error("Error building extension 'x': [1/2] nope -MMD a\nFAILED: a.o\n"
                                 "/bin/sh: 1: nope: not found\n", "nope") == "/bin/sh: 1: nope: not found"


def test_status_before_any_build():
    s = build.status("mvllm_never_built")
    assert s["ok"] is False and s["summary"].startswith("not built yet") and s["error"] == ""
    assert set(s) >= {"name", "ok", "flags", "ldflags", "openmp", "error", "compiler", "cached", "tried", "summary"}


# ---- real builds through the fake Apple clang ----

@needs_gcc
def test_apple_clang_falls_back_to_a_build_without_openmp_and_says_so(fake_clang, tmp_path, capsys):
    """Linux's flag sets through a compiler that takes neither -fopenmp nor -march=native: the build falls back
    to -O3 and reports it truthfully (no OpenMP: at::parallel_for on one thread), says so once, and a fresh
    process loads the cached build without compiling anything, also from a copy of the source at another path
    (another checkout)."""
    log, env = fake_clang
    source = tiny_source(tmp_path, "mvllm_test_fallback")
    b = build.build("mvllm_test_fallback", source)
    assert b.ok and b.flags == ["-O3"] and b.openmp is False and b.error == "" and not b.cached
    assert [(t["flags"], t["error"]) for t in b.tried] == [
        (["-O3", "-march=native", "-fopenmp"], MARCH), (["-O3", "-fopenmp"], FOPENMP), (["-O3", "-march=native"], MARCH)]
    assert b.compiler.startswith(f"{env['CXX']}: ") and b.summary == "built with -O3 (no OpenMP: one thread)"
    assert build.status("mvllm_test_fallback") == b.as_dict()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mvllm: the CPU kernel mvllm_test_fallback built without OpenMP ({FOPENMP}): one thread only, "
                   "whatever threads= says"]
    assert torch.ops.mvllm_test_fallback.openmp() == 0 and threads_used("mvllm_test_fallback") == 1
    assert len(compiles(calls(log))) == 4 + 1  # four compiles, one link

    before = len(calls(log))
    again, stderr = in_fresh_process(env, "mvllm_test_fallback", source)
    assert again["ok"] and again["flags"] == ["-O3"] and again["cached"] and not again["openmp"]
    assert all(t["cached"] for t in again["tried"]) and len(again["tried"]) == 3
    assert compiles(calls(log)[before:]) == [] and "mvllm:" not in stderr

    elsewhere = tmp_path / "checkout2" / source.name
    elsewhere.parent.mkdir()
    shutil.copy(source, elsewhere)
    ninja = sorted((tmp_path / "cache" / "ext").glob("*/build.ninja"))
    written = [f.stat().st_mtime_ns for f in ninja]
    again, stderr = in_fresh_process(env, "mvllm_test_fallback", elsewhere)
    assert again["ok"] and again["flags"] == ["-O3"] and again["cached"]
    assert compiles(calls(log)[before:]) == [] and "mvllm:" not in stderr
    assert [f.stat().st_mtime_ns for f in ninja] == written  # ninja not run: its build file names the old path


@needs_gcc
def test_mac_builds_with_torchs_openmp(fake_clang, tmp_path, monkeypatch):
    """darwin/arm64 with torch's libomp (emulated: a libomp.so that is libgomp, since g++ links that): the
    first set, -Xpreprocessor -fopenmp linked to torch's lib folder, builds, and the kernel runs on 2 threads."""
    log, _ = fake_clang
    lib = libomp_standin(tmp_path)
    if lib is None:
        pytest.skip("no libgomp to stand in for torch's libomp")
    pretend(monkeypatch, "Darwin", "arm64", lib)
    b = build.build("mvllm_test_mac", tiny_source(tmp_path, "mvllm_test_mac"))
    assert b.ok and b.openmp and b.flags[:3] == ["-O3", "-Xpreprocessor", "-fopenmp"] and b.tried == []
    assert b.ldflags == [f"-L{lib}", "-lomp", f"-Wl,-rpath,{lib}"]
    assert b.summary.startswith("built with -O3 -Xpreprocessor -fopenmp") and b.summary.endswith("(OpenMP)")
    assert torch.ops.mvllm_test_mac.openmp() > 0 and threads_used("mvllm_test_mac") == 2
    made = compiles(calls(log))
    assert len(made) == 2 and "-Xpreprocessor -fopenmp" in made[0] and "-lomp" in made[1]
    assert not any("-march=native" in line for line in calls(log))


@needs_gcc
def test_failed_build_is_printed_once_and_not_retried(fake_clang, tmp_path, capsys):
    """No flag set builds: one line naming the compiler's first error, a failure marker per flag set, and a fresh
    process reads the markers without compiling or printing; another compiler tries again."""
    log, env = fake_clang
    source = tmp_path / "broken.cpp"
    source.write_text("int broken = ;\n")
    op, why = build.attempt(lambda: build.build("mvllm_test_broken", source))
    assert op is None
    b = build._results["mvllm_test_broken"]
    assert not b.ok and not b.cached and b.flags == ["-O3"]
    assert b.error.startswith("broken.cpp:1:") and "error" in b.error and "\n" not in b.error
    assert why == f"broken.cpp did not build: {b.error}"
    assert [t["error"] for t in b.tried] == [MARCH, FOPENMP, MARCH]
    assert b.summary == f"not built: {b.error}"
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith(f"mvllm: the CPU kernel mvllm_test_broken did not build ({b.error}); ")
    markers = sorted((tmp_path / "cache" / "ext").glob(f"*/{build.FAILED}"))
    assert len(markers) == 4 and str(markers[0].parent) in "".join(map(str, markers))
    assert {json.loads(m.read_text())["error"] for m in markers} == {MARCH, FOPENMP, b.error}

    before = len(calls(log))
    again, stderr = in_fresh_process(env, "mvllm_test_broken", source)
    assert not again["ok"] and again["cached"] and again["error"] == b.error
    assert calls(log)[before:] == ["--version"]  # the cache key's compiler version: nothing compiled
    assert "mvllm:" not in stderr

    other = tmp_path / "bin2" / "clang++"
    other.parent.mkdir()
    shutil.copy(env["CXX"], other)
    env2 = {**env, "CXX": str(other)}
    retried, stderr = in_fresh_process(env2, "mvllm_test_broken", source)
    assert not retried["ok"] and not retried["cached"] and retried["error"] == b.error
    assert f"did not build ({b.error})" in stderr
    assert len(compiles(calls(log)[before + 1:])) == 4


def test_build_info_of_the_real_kernels():
    """The fused kernels as built here: the flags they used and whether with OpenMP, or the first error."""
    ok = cpu_fused.available()
    info = cpu_fused.build_info()
    assert info["ok"] is ok and info["name"] == "mvllm_fused"
    if ok:
        assert info["flags"][0] == "-O3" and info["openmp"] == ("-fopenmp" in info["flags"])
        assert info["summary"] == f"built with {' '.join(info['flags'])} " + (
            "(OpenMP)" if info["openmp"] else "(no OpenMP: one thread)")
    else:
        assert cpu_fused.why_unavailable.endswith(info["error"]) and "\n" not in cpu_fused.why_unavailable


def test_without_avx512_the_int8_kernel_is_built_and_picked_or_its_error_said(monkeypatch):
    """Without AVX-512 the default is int8w through the kernel's portable path; where that build fails, the
    mode falls back and its reason carries the compiler's first error line."""
    built = []
    monkeypatch.setattr(quant, "avx512", lambda: False)
    monkeypatch.setattr(cpu_int8, "available", lambda: built.append(1) or True)
    dtype, mode, why = quant.cpu_mode(None, None)
    assert (dtype, mode) == ("float32", "int8w") and "portable" in why and built
    monkeypatch.setattr(cpu_int8, "available", lambda: False)
    monkeypatch.setattr(cpu_int8, "why_unavailable", "c++: error: unrecognized option\nmore")
    monkeypatch.setattr(quant, "packable", lambda d, t: False)
    dtype, mode, why = quant.cpu_mode(None, None)
    assert (dtype, mode) == ("float32", "none") and "c++: error: unrecognized option" in why and "\n" not in why


# ---- the sources compile for aarch64 (Apple silicon, Linux ARM) ----

CROSS = shutil.which("aarch64-linux-gnu-g++")
SOURCES = sorted(p.name for p in build.CSRC.glob("*.cpp"))


@pytest.fixture(scope="module")
def aarch64_objects(tmp_path_factory):
    """Every csrc/*.cpp compiled (-c) for aarch64 as cpp_extension compiles it, and checked again with -fopenmp
    (-fsyntax-only: the pragmas and omp.h parse; the code generated is the plain build's), all at once:
    {(source, openmp): (object path or None, exit status, compiler output)}."""
    if CROSS is None:
        pytest.skip("aarch64-linux-gnu-g++ is not installed (apt-get install g++-aarch64-linux-gnu)")
    from torch.utils import cpp_extension

    out = tmp_path_factory.mktemp("aarch64")
    includes = [*cpp_extension.include_paths(), sysconfig.get_path("include")]

    def compile_one(job):
        source, openmp = job
        obj = None if openmp else out / f"{source}.o"
        cmd = [CROSS, f"-DTORCH_EXTENSION_NAME=mvllm_{Path(source).stem}", "-DTORCH_API_INCLUDE_EXTENSION_H",
               *[a for inc in includes for a in ("-isystem", inc)], "-fPIC", "-std=c++17", "-O3",
               *(["-fopenmp", "-fsyntax-only"] if openmp else ["-o", str(obj)]), "-c", str(build.CSRC / source)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        return job, (obj, r.returncode, r.stderr)

    jobs = [(s, omp) for s in SOURCES for omp in (False, True)]
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        return dict(pool.map(compile_one, jobs))


@pytest.mark.parametrize("openmp", [False, True], ids=["plain", "openmp"])
@pytest.mark.parametrize("source", SOURCES)
def test_sources_compile_for_aarch64(aarch64_objects, source, openmp):
    obj, status, output = aarch64_objects[(source, openmp)]
    assert status == 0, build.first_error(output) + "\n" + output[-3000:]
    if obj is None:
        return
    header = obj.read_bytes()[:20]
    assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 183  # EM_AARCH64


def test_the_aarch64_int8_kernel_multiplies_in_int16(aarch64_objects):
    """On aarch64 (an M2) the int8 kernel's inner loop is NEON integer multiply-adds of int8 weights widened to
    int16 by int16 activations (smull/smlal), not float conversions."""
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump is None:
        pytest.skip("aarch64-linux-gnu-objdump is not installed")
    obj, status, _ = aarch64_objects[("int8_linear.cpp", False)]
    assert status == 0
    text = subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True, timeout=60).stdout
    ops = [line.split("\t")[2].split()[0] for line in text.splitlines() if line.count("\t") >= 2]
    assert sum(op in ("smull", "smull2") for op in ops) >= 4
    assert sum(op in ("smlal", "smlal2") for op in ops) >= 4
    assert "fmla" in ops
