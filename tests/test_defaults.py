"""max_active where none is set: 4 on the CPU and MPS; on CUDA what the KV pool holds, 1 to 256 (engine/sizes.py).
CUDA graphs cover decode batches up to max_active, and `mvllm env` says which default a backend gets and why."""

from __future__ import annotations

import pytest
from conftest import prompts
from typer.testing import CliRunner

from mvllm import LLM, SamplingParams
from mvllm.backends.spec import parse_backends
from mvllm.cli import app
from mvllm.engine.cuda_graphs import GraphRunner, token_buckets
from mvllm.engine.engine import Engine, EngineConfig, served_pool
from mvllm.engine.sizes import MAX_ACTIVE, MOST_ACTIVE, default_max_active
from mvllm.env import max_active, render
from mvllm.model.config import ModelConfig
from mvllm.model.presets import PRESETS
from mvllm.profile.run import decode_batches

QWEN = ModelConfig.from_dict(PRESETS["qwen2.5-0.5b"])
SMOL = ModelConfig.from_dict(PRESETS["smollm2-135m"])


def test_cuda_runs_what_its_pool_holds_from_1_to_256():
    assert default_max_active("cuda", 640, 16, 32768) == (10, "KV holds 10 sequences of 1,024 tokens")
    assert default_max_active("cuda", 100, 16, 512) == (3, "KV holds 3 sequences of 512 tokens")  # short model
    n, why = default_max_active("cuda", 29_280, 16, 32768)
    assert (n, why) == (256, "KV holds 457 sequences of 1,024 tokens; capped at 256")
    assert default_max_active("cuda", 10, 16, 32768) == (1, "KV holds 0 sequences of 1,024 tokens; at least 1")
    assert default_max_active("cuda", 64, 16, 32768) == (1, "KV holds 1 sequence of 1,024 tokens")
    assert default_max_active("cuda", 64, 16, 32768)[0] == 1 and default_max_active("cuda", 16_448, 16, 32768)[0] == 256


def test_cpu_and_mps_keep_4():
    assert MAX_ACTIVE == 4 and MOST_ACTIVE == 256
    assert default_max_active("cpu", 10**6, 16, 4096) == (4, "measured default")
    assert default_max_active("mps", 10**6, 16, 4096)[0] == 4
    assert [s.max_active for s in parse_backends("gpu=cpu,cpu=cpu")] == [4, 4]
    engine = Engine(EngineConfig(model="synthetic:tiny-qwen2", device="cpu", dtype="float32", quant="none"))
    assert engine.scheduler.max_active == engine.config.max_active == 4
    assert engine.max_active_why == "measured default"
    assert LLM("synthetic:tiny-qwen2", dtype="float32", quant="none").engine.scheduler.max_active == 4


def test_the_pool_is_sized_first_and_an_explicit_max_active_wins():
    auto = EngineConfig(model="-", device="cuda")  # counted, not validated: no GPU needed
    blocks, n, why = served_pool(auto, QWEN)
    assert blocks == 4 * 2**30 // (12288 * 16) and (n, why) == (256, "KV holds 341 sequences of 1,024 tokens; "
                                                                  "capped at 256")
    assert served_pool(EngineConfig(model="-", device="cuda"), SMOL)[1:] == (182, "KV holds 182 sequences of "
                                                                             "1,024 tokens")
    assert served_pool(EngineConfig(model="-", device="cuda", num_blocks=640), QWEN)[:2] == (640, 10)
    assert served_pool(EngineConfig(model="-", device="cuda", max_active=8), QWEN)[1:] == (8, "set")
    # the CPU's pool is what it was: twice what 4 sequences of the model's full length need, within 1 GB
    cpu = EngineConfig(model="-", device="cpu", dtype="float32")
    assert served_pool(cpu, QWEN)[:2] == (min(2**30 // (24576 * 16), 4 * 2048 * 2), 4)


def test_an_explicit_max_active_wins_in_every_spec():
    [gpu, cpu, remote] = parse_backends("gpu=cuda,cpu=cpu,far=http://10.0.0.2:8000", check_devices=False)
    assert (gpu.max_active, cpu.max_active, remote.max_active) == (None, 4, 4)  # None: the engine decides
    assert gpu.engine_config("-").max_active is None
    assert [s.max_active for s in parse_backends("gpu=cuda:1/max_active=8,cpu=cpu", check_devices=False)] == [8, 4]
    assert [s.max_active for s in parse_backends("gpu=cuda,cpu=cpu", 16, check_devices=False)] == [16, 16]
    assert [s.max_active for s in parse_backends("gpu=cuda/max_active=2", 16, check_devices=False)] == [2]


@pytest.mark.parametrize("most", [1, 3, 4, 16, 64, 100, 128, 200, 256])
def test_graph_buckets_cover_decode_up_to_max_active(most):
    buckets = token_buckets(most)
    assert most in buckets and buckets[-1] == max(64, most)
    assert {1, 2, 4, 8, 16, 32, 64} <= set(buckets)  # warm-prefix and mixed steps of up to 64 tokens
    assert all(a < b for a, b in zip(buckets, buckets[1:]))
    assert min(token_buckets(most, first=2)) == 2
    assert len(buckets) <= 16  # capture time: a ladder, not every size


def test_graphs_of_more_than_64_rows_run_the_head_and_match_the_eager_path(tiny):
    """A decode batch of 70 replays the 96-row bucket, LM head and argmax inside (the graphs' layout run
    eagerly on the CPU)."""
    path = str(tiny("llama")[0])
    plain = LLM(path, dtype="float32", num_blocks=2048, max_active=100)
    rows = LLM(path, dtype="float32", num_blocks=2048, max_active=100)
    r = rows.engine.runner
    r.graphs = GraphRunner(r.model, r.caches, r.block_size, 100, rows.engine.max_model_len,
                           r.caches[0].shape[1] - 1, capture=False)
    assert r.graphs.head_rows == 100 and r.graphs.logits.shape[0] == 100
    assert r.graphs.token_buckets[-3:] == [64, 96, 100]
    asked = prompts(21, [3 + i % 9 for i in range(70)], vocab=200)
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in rows.generate(asked, greedy)]
    assert got == [o.token_ids for o in plain.generate(asked, greedy)]


def test_profile_measures_a_ladder_not_every_batch_size():
    assert decode_batches(4) == [1, 2, 3, 4] and decode_batches(16) == list(range(1, 17))
    assert decode_batches(256) == list(range(1, 65)) + [96, 128, 160, 192, 224, 256]
    assert decode_batches(100)[-2:] == [96, 100]


def test_env_names_each_backends_default_and_why():
    res = CliRunner().invoke(app, ["env", "--backends", "gpu=cpu/dtype=float32/quant=none/fused=off,"
                                   "cpu=cpu/dtype=float32/quant=none/fused=off/max_active=8"])
    assert res.exit_code == 0, res.output
    assert "max_active 4 (measured default)" in res.output and "max_active 8 (set)" in res.output
    assert "api servers   1 (the default: more pay only where one API process is the bottleneck; serve" in res.output
    [gpu] = parse_backends("gpu=cuda", check_devices=False)  # what a CUDA machine shows, for the default model
    most, why = max_active(gpu, gpu.engine_config("-"), "smollm2-135m", SMOL)
    assert (most, why) == (182, "smollm2-135m: KV holds 182 sequences of 1,024 tokens")
    facts = {"platform": "p", "python": "3", "compute_cores": "16", "devices": {"cuda:0": "H100"},
             "backends_spec": "gpu=cuda", "build": {"torch": "2", "onednn": True, "onednn_bf16": True,
                                                    "openmp": True, "cpu_capability": "AVX512", "cuda": "12",
                                                    "mps": False},
             "backends": {"gpu": {"device": "cuda", "dtype": "bfloat16", "quant": "none", "threads": 1,
                                  "max_active": most, "max_active_why": why, "overlap": True, "graphs": True,
                                  "compiled": True, "sampling": "float64 CDF", "max_step_tokens": 8192,
                                  "max_step_tokens_why": "a GPU of 79 GiB (vLLM's default from 70 GiB)"}}}
    assert "max_active 182 (smollm2-135m: KV holds 182 sequences of 1,024 tokens)" in render(facts)
    assert "max_step_tokens 8192 (a GPU of 79 GiB (vLLM's default from 70 GiB))" in render(facts)
    assert "max_step_tokens 256 (measured default)" in res.output
