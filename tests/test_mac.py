"""An Apple M2 user's first commands, emulated: PyTorch's macOS arm64 wheel (no oneDNN, no bf16 probe, darwin/arm64,
4 performance cores of 8; tests/mac/sitecustomize.py, loaded into every process: the server's workers too) and
Apple clang (tests/mac/clang++: no bare -fopenmp, no -march=native). `mvllm env`, `generate`, `profile` and
`serve` with default settings run, pick float32, build the fused kernels with OpenMP through torch's own runtime,
and the whole session prints a kernel-build line at most once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import MAC, http_client, libomp_standin

from mvllm.bench.process import ServerProcess
from mvllm.machine import cache_dir

TINY = "synthetic:tiny-qwen2"

pytestmark = pytest.mark.skipif(sys.platform != "linux" or shutil.which("g++") is None,
                                reason="the emulated Apple clang runs the real g++ (Linux)")


@pytest.fixture(scope="module")
def mac(tmp_path_factory):
    """The environment of a process on the emulated M2, with a kernel cache of its own (the model cache shared)."""
    root = tmp_path_factory.mktemp("mac")
    cache = root / "cache"
    cache.mkdir()
    models = cache_dir() / "gguf"
    models.mkdir(parents=True, exist_ok=True)
    (cache / "gguf").symlink_to(models)
    lib = libomp_standin(root)
    if lib is None:
        pytest.skip("no libgomp to stand in for torch's libomp")
    log = root / "cxx.log"
    log.touch()
    env = {**os.environ, "MVLLM_EMULATE": "mac", "MVLLM_EMULATE_LIBOMP": str(lib), "MVLLM_CACHE": str(cache),
           "CXX": str(MAC / "clang++"), "FAKE_CXX_LOG": str(log), "FAKE_CXX_REAL": shutil.which("g++"),
           "PYTHONPATH": os.pathsep.join([str(MAC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    env.pop("MVLLM_GIT_COMMIT", None)
    stderr: list[str] = []
    return env, stderr, root


def mvllm(mac, *args, timeout=600) -> subprocess.CompletedProcess:
    env, stderr, _ = mac
    out = subprocess.run([sys.executable, "-m", "mvllm.cli", *args], env=env, capture_output=True, text=True,
                         timeout=timeout)
    stderr.append(out.stderr)
    return out


def test_env_says_what_the_mac_runs(mac):
    out = mvllm(mac, "env", "--json")
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout)
    build = facts["build"]
    assert (build["system"], build["arch"], build["onednn"], build["onednn_bf16"]) == ("darwin", "arm64", False, False)
    assert build["compute_cores"] == 4 and "performance cores" in facts["compute_cores"]
    for name in ("gpu", "cpu"):  # no MPS in the emulation: two CPU backends, sharing the 4 performance cores
        b = facts["backends"][name]
        assert (b["dtype"], b["quant"], b["threads"]) == ("float32", "int8w", 2)
        assert "portable" in b["picked"]
        for kernel in ("fused", "int8"):  # no AVX-512: the int8 kernel's portable path
            k = b["kernels"][kernel]
            assert k["used"] and k["openmp"] and k["flags"][:3] == ["-O3", "-Xpreprocessor", "-fopenmp"]
            assert "-lomp" in k["ldflags"]
    text = mvllm(mac, "env")
    assert text.returncode == 0 and "oneDNN no" in text.stdout and "built with -O3 -Xpreprocessor -fopenmp" in text.stdout


def test_generate_runs_on_the_default_model(mac):
    out = mvllm(mac, "generate", "What is the capital of France?", "--max-tokens", "12")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout
    assert "(smollm2-135m, cpu, float32 int8w)" in out.stderr


def test_profile_records_the_mode_and_the_build(mac):
    _, _, root = mac
    path = root / "profile.json"
    out = mvllm(mac, "profile", "--model", TINY, "--lengths", "16", "--repeats", "1", "--steps", "2",
                "--no-accuracy", "--out", str(path))
    assert out.returncode == 0, out.stderr[-2000:]
    profile = json.loads(path.read_text())
    assert profile["environment"]["build"]["onednn"] is False
    for b in profile["backends"].values():
        assert (b["dtype"], b["quant"], b["threads"], b["fused"]) == ("float32", "int8w", 2, True)
        assert b["env"]["kernels"]["fused"]["openmp"]


def test_serve_answers_sampled_and_greedy_requests(mac):
    env, stderr, root = mac
    server = ServerProcess(["--model", TINY], root / "server.log", env=env).start()
    try:
        server.wait_ready(300)
        for body in ({}, {"temperature": 0}, {"temperature": 1.0, "top_p": 0.9, "seed": 7}):
            r = http_client.post(f"{server.url}/v1/completions", timeout=120,
                           json={"model": TINY, "prompt": [1, 2, 3], "max_tokens": 5, "ignore_eos": True, **body})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 5
    finally:
        server.stop()
    stderr.append((root / "server.log").read_text(errors="replace"))
    assert "Traceback" not in stderr[-1]


def test_no_kernel_line_is_printed(mac):
    """Every process of this module (env twice, generate, profile, the server and its two workers) shared one
    kernel cache, and the fused kernels built with torch's OpenMP: no process printed a build failure or a
    build without OpenMP (tests/test_build.py holds such a line to one print across processes)."""
    _, stderr, _ = mac
    assert [line for text in stderr for line in text.splitlines() if line.startswith("mvllm: the ")] == []
