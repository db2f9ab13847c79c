"""The package as pip gives it out: the wheel and the sdist carry every file a CPU kernel build reads (csrc/*.cpp and
the headers they include), a wheel installed into a folder outside the checkout builds every CPU kernel from
there, and the declared dependencies are the ones mvllm imports.

The wheel and the sdist are built offline from the working tree (pip wheel --no-build-isolation and setuptools'
build_meta, as `python -m build` would), their build folders kept out of the checkout (DIST_EXTRA_CONFIG). The
kernels build into a fresh MVLLM_CACHE, in two processes at once (fused then layers, and int8): 30 to 45 s on 2
cores."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mvllm.kernels import build

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "mvllm" / "kernels" / "csrc"
CSRC_IN_PACKAGE = "mvllm/kernels/csrc"

needs_compiler = pytest.mark.skipif(shutil.which(shlex.split(build.cxx())[0]) is None,
                                    reason=f"no C++ compiler ({build.cxx()}) to build the CPU kernels with")

# Declared without mvllm importing them, each for a reason
NOT_IMPORTED = {
    "gguf": "transformers' GGUF loader imports it: the default model is a .gguf",
    "accelerate": "transformers refuses to load a GGUF file without it (the default model)",
    "httptools": "uvicorn's http='auto' serves with it where it is installed",
}
# Imported by mvllm without being declared, each for a reason
UNDECLARED = {"triton": "GPU only, comes with CUDA torch; imported only where installed"}
# distribution name -> module name where they differ
MODULE = {"prometheus-client": "prometheus_client", "huggingface-hub": "huggingface_hub"}

# the sources a kernel build starts from (build.build's callers): kernels/cpu_fused.py, cpu_int8.py, cpu_layers.py
BUILDS = """
import json, sys
import mvllm
from mvllm.kernels import build

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from mvllm.kernels import {modules}
ok = {{name: module.available() for name, module in [{pairs}]}}
print(json.dumps({{"file": mvllm.__file__, "ok": ok,
                  "status": {{name: build.status(name) for name in ("fused", "int8", "layers")}},
                  "why": {{name: module.why_unavailable for name, module in [{pairs}]}}}}))
"""


def kernel_files() -> list[str]:
    """Every file in csrc/ (sources and headers), and every file they include by quotes is among them."""
    names = sorted(p.name for p in CSRC.iterdir() if p.is_file())
    for name in names:
        for included in re.findall(r'^\s*#\s*include\s+"([^"]+)"', (CSRC / name).read_text(), re.MULTILINE):
            assert included in names, f"{name} includes {included}, which is not in csrc/"
    assert {"fused.cpp", "int8_linear.cpp", "layers.cpp"} <= set(names)
    return names


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert out.returncode == 0, f"{shlex.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """A wheel and an sdist of the working tree, built offline; nothing written into the checkout."""
    tmp = tmp_path_factory.mktemp("dist")
    config = tmp / "setup.cfg"
    config.write_text(f"[build]\nbuild_base = {tmp / 'build'}\n[egg_info]\negg_base = {tmp}\n")
    env = {**os.environ, "DIST_EXTRA_CONFIG": str(config)}
    out = tmp / "out"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
         str(REPO)], env=env, cwd=tmp)
    run([sys.executable, "-c", "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
         str(out)], env=env, cwd=REPO)
    return out


def wheel(dist: Path) -> Path:
    (found,) = dist.glob("mvllm-*.whl")
    return found


def test_the_wheel_and_the_sdist_carry_every_file_a_kernel_build_reads(dist):
    names = kernel_files()
    data = sorted(str(p.relative_to(REPO)) for p in (REPO / "mvllm" / "data").iterdir() if p.is_file())
    in_wheel = set(zipfile.ZipFile(wheel(dist)).namelist())
    (sdist,) = dist.glob("mvllm-*.tar.gz")
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        in_sdist = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    for files, what in ((in_wheel, "wheel"), (in_sdist, "sdist")):
        missing = [n for n in names if f"{CSRC_IN_PACKAGE}/{n}" not in files] + [d for d in data if d not in files]
        assert not missing, f"the {what} lacks {missing}"
    assert top.startswith("mvllm-") and "pyproject.toml" in in_sdist


@needs_compiler
def test_an_installed_wheel_builds_every_cpu_kernel_outside_the_checkout(dist, tmp_path):
    site = tmp_path / "site"
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q", "--target", str(site),
         str(wheel(dist))])
    assert (site / CSRC_IN_PACKAGE / "int8_kernels.h").is_file()
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(site), "MVLLM_CACHE": str(cache)}
    work = tmp_path / "elsewhere"
    work.mkdir()
    # two processes build at once: fused then layers (which waits on int8's build lock and loads its build),
    # and int8; every build compiles the installed sources (build.ninja names them)
    scripts = [BUILDS.format(modules="cpu_fused, cpu_layers",
                             pairs='("fused", cpu_fused), ("layers", cpu_layers)'),
               BUILDS.format(modules="cpu_int8", pairs='("int8", cpu_int8)')]
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda s: run([sys.executable, "-c", s], env=env, cwd=work, timeout=1200), scripts))
    results = [json.loads(out.stdout.strip().splitlines()[-1]) for out in outs]
    for result, out in zip(results, outs):
        assert Path(result["file"]).resolve().is_relative_to(site.resolve()), result["file"]
        assert all(result["ok"].values()), f"{result['why']}\n{out.stderr[-3000:]}"
    # every kernel compiled here, not taken from a cache (int8 by whichever process took its build lock first,
    # the other loading that build)
    status = results[0]["status"]
    assert all(status[name]["ok"] for name in ("fused", "int8", "layers")), status
    assert not status["fused"]["cached"] and not status["layers"]["cached"], status
    assert any(not r["status"]["int8"]["cached"] for r in results), [r["status"]["int8"] for r in results]
    ninja = sorted((cache / "ext").glob("*/build.ninja"))
    sources = {m for n in ninja for m in re.findall(r"\S+\.cpp", n.read_text())}
    assert {Path(s).name for s in sources} == {"fused.cpp", "int8_linear.cpp", "layers.cpp"}, sources
    assert all(Path(s).resolve().is_relative_to(site.resolve()) for s in sources), sources


def imported_modules() -> set[str]:
    found = set()
    for path in (REPO / "mvllm").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"mvllm"}


def test_the_declared_dependencies_are_what_mvllm_imports():
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[\s;<>=!~\[]", d, maxsplit=1)[0].lower() for d in declared}
    modules = {MODULE.get(n, n.replace("-", "_")) for n in names}
    imported = imported_modules()
    assert sorted(modules - imported) == sorted(NOT_IMPORTED), "declared, never imported"
    assert sorted(imported - modules) == sorted(UNDECLARED), "imported, not declared"
