"""The int8w layer loop in C++ (kernels/cpu_layers.py) against the Python loop of model/cpu_forward.py: the same
ops in the same order, so the hidden states are bitwise equal, and the KV caches they write too."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from mvllm.engine import quant
from mvllm.engine.engine import Engine, EngineConfig
from mvllm.engine.params import SamplingParams
from mvllm.kernels import cpu_int8, cpu_layers
from tests.test_batch_invariant import hidden_rows

pytestmark = pytest.mark.skipif(not cpu_layers.available(), reason=f"no C++ layer loop here: "
                                f"{cpu_layers.why_unavailable}")


def engine(model: str, invariant: bool = False) -> Engine:
    return Engine(EngineConfig(model=model, quant="int8w", batch_invariant=invariant, threads=2, num_blocks=64))


def python_loop(fn):
    cpu_layers.ENABLED = False
    try:
        return fn()
    finally:
        cpu_layers.ENABLED = True


@pytest.mark.parametrize("model", ["synthetic:tiny-qwen2", "synthetic:tiny-llama"])  # QKV bias and none
def test_hidden_states_and_cache_match_the_python_loop(model):
    e = engine(model)
    assert e.model.cpu_layers is not None and e.model.cpu_layers.serves(8)
    a = [(5 * k) % 400 + 1 for k in range(21)]
    b = [(3 * k) % 400 + 2 for k in range(9)]
    batch = [(a, 20), (b, 5)]  # 1 + 4 rows: decode-sized, through the kernel
    for cache in e.runner.caches:
        cache.zero_()
    fast = hidden_rows(e, batch)
    fast_cache = [c.clone() for c in e.runner.caches]
    for cache in e.runner.caches:
        cache.zero_()
    slow = python_loop(lambda: hidden_rows(e, batch))
    for f, s in zip(fast, slow):
        assert torch.equal(f, s)
    for f, s in zip(fast_cache, e.runner.caches):
        assert torch.equal(f, s)


def test_prefill_above_the_kernel_rows_takes_the_python_loop():
    """Without batch_invariant, more than PACKED_MAX_ROWS tokens (LANES_MAX_ROWS where every linear is in the
    lanes layout, LANES8_MAX_ROWS in lanes8) go to the GEMM (in Python); invariant, or lanes8 with AMX or without
    native bf16, every batch size takes the C++ loop and no linear keeps a de-quantized copy."""
    model = engine("synthetic:tiny-qwen2").model
    linears = [m for m in model.modules() if isinstance(m, quant.Int8Linear)]
    rows = min(quant.max_rows(m.q) for m in linears)
    if all(m.q.dim() == 3 for m in linears):  # every linear packed in this machine's layout
        lanes8 = quant.EVERY_ROW if quant.lanes8_every_row() else quant.LANES8_MAX_ROWS
        assert rows == {"lanes8": lanes8, "lanes": quant.LANES_MAX_ROWS}[cpu_int8.layout()]
    assert all((m.gemm is None) == (m.kernel_rows == math.inf) for m in linears)
    if rows < math.inf:
        assert model.cpu_layers.serves(rows) and not model.cpu_layers.serves(rows + 1)
    else:
        assert model.cpu_layers.serves(500)
    assert engine("synthetic:tiny-qwen2", invariant=True).model.cpu_layers.serves(500)


def greedy(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    e = engine(model)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = [e.add_request(p, params) for p in prompts]
    while e.has_unfinished():
        e.step()
    return [s.output_ids for s in seqs]


def test_greedy_tokens_match_the_python_loop():
    def run():
        return greedy("synthetic:tiny-qwen2", [[(7 * r + 3 * k) % 500 + 1 for k in range(5 + 11 * r)]
                                               for r in range(3)], 24)

    assert run() == python_loop(run)


def per_op(fn):
    old = cpu_layers.knob("team", 0)
    try:
        return fn()
    finally:
        cpu_layers.knob("team", old)


@pytest.mark.parametrize("model", ["synthetic:tiny-qwen2", "synthetic:tiny-llama"])
@pytest.mark.parametrize("threads", [2, 3])
def test_decode_in_one_team_matches_a_region_an_op(model, threads):
    """Decode-sized steps run every layer in one team of threads (csrc/layers.cpp); the hidden states and the KV
    caches are bitwise those of the loop that opens a region an op, with the attention's keys split over items."""
    if threads > (os.cpu_count() or 1):
        pytest.skip(f"{threads} threads: more than this machine's cores")
    e = Engine(EngineConfig(model=model, quant="int8w", threads=threads, num_blocks=64))
    if os.environ.get("MVLLM_INT8_PATH") in PORTABLE:  # test_the_team_takes_the_portable_layout's processes
        assert e.model.layers[0].self_attn.qkv_proj.q.dim() == 2
    long = [(7 * k) % 500 + 1 for k in range(120)]  # 120 keys: split into items (tiny-llama's one kv head)
    short = [(3 * k) % 400 + 2 for k in range(9)]
    batch = [(long, 119), (short, 8), (short, 5)]  # 1 + 1 + 4 rows
    for cache in e.runner.caches:
        cache.zero_()
    hidden_rows(e, [(long[:119], 0)])  # the long prompt's keys into the cache first (a prefill: the ops)
    before = [c.clone() for c in e.runner.caches]
    calls = cpu_layers.team_calls()
    team = hidden_rows(e, batch)
    assert cpu_layers.team_calls() == calls + 1
    team_cache = [c.clone() for c in e.runner.caches]
    for cache, saved in zip(e.runner.caches, before):
        cache.copy_(saved)
    ops = per_op(lambda: hidden_rows(e, batch))
    assert cpu_layers.team_calls() == calls + 1
    for t, o in zip(team, ops):
        assert torch.equal(t, o)
    for t, o in zip(team_cache, e.runner.caches):
        assert torch.equal(t, o)


def test_greedy_tokens_in_one_team_match_a_region_an_op():
    def run():
        return greedy("synthetic:tiny-llama", [[(5 * r + 2 * k) % 500 + 1 for k in range(3 + 30 * r)]
                                               for r in range(4)], 40)

    calls = cpu_layers.team_calls()
    team = run()
    assert cpu_layers.team_calls() > calls
    assert team == per_op(run)


PORTABLE = ("int16", "float")


@pytest.mark.parametrize("path", PORTABLE)
def test_the_team_takes_the_portable_layout(path):
    """Weights [out, in] (MVLLM_INT8_PATH=int16, the default where the kernel has no lanes layout: an Apple M2's
    NEON; or float) run their decode steps in the team too, bitwise as a region an op (the path is read once a
    process: the tests above in a process of their own)."""
    tests = [f"{__file__}::{name}" for name in ("test_decode_in_one_team_matches_a_region_an_op",
                                                 "test_greedy_tokens_in_one_team_match_a_region_an_op")]
    env = {**os.environ, "MVLLM_INT8_PATH": path}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *tests], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]


def test_a_warm_prefill_in_one_team_matches_a_region_an_op():
    """A warm prefill (12 new tokens after 40 cached) beside a fresh 5-token prompt, the last layer computing only
    each one's last row: every layer runs in the team (the last on those 2 rows past its KV write), bitwise the
    per-op loop's, caches too."""
    from mvllm.model.attention import build_meta

    if cpu_int8.layout() not in ("lanes", "lanes8"):
        pytest.skip("a 17-token step takes the C++ loop in the lanes layouts only (weights [out, in] leave steps of "
                    f"more than {quant.PACKED_MAX_ROWS} tokens to the GEMM); here the kernel has {cpu_int8.layout()!r}")
    e = engine("synthetic:tiny-llama")
    rows = min(m.kernel_rows for m in e.model.modules() if isinstance(m, quant.Int8Linear))
    if rows < 17:  # the lanes layout of an AVX2 host: 16
        pytest.skip(f"a 17-token step takes the C++ loop where the int8 kernel takes 17 rows; here it takes {rows}")
    seq = [(11 * k) % 500 + 1 for k in range(52)]
    fresh = [(13 * k) % 400 + 3 for k in range(5)]
    for cache in e.runner.caches:
        cache.zero_()
    hidden_rows(e, [(seq[:40], 0)])
    before = [c.clone() for c in e.runner.caches]

    def warm():
        meta = build_meta([(40, 52), (0, 5)], [list(range(8)), list(range(8, 12))], e.config.block_size,
                          torch.device("cpu"), e.runner.layout)
        meta.out_rows = torch.tensor([11, 16])
        with torch.inference_mode():
            return e.model(torch.tensor(seq[40:] + fresh), torch.cat([torch.arange(40, 52), torch.arange(5)]),
                           e.runner.caches, meta).clone()

    calls = cpu_layers.team_calls()
    team = warm()
    assert cpu_layers.team_calls() == calls + 1 and team.shape[0] == 2
    team_cache = [c.clone() for c in e.runner.caches]
    for cache, saved in zip(e.runner.caches, before):
        cache.copy_(saved)
    assert torch.equal(team, per_op(warm))
    for t, o in zip(team_cache, e.runner.caches):
        assert torch.equal(t, o)


def test_the_team_times_its_phases_only_when_asked():
    """knob "times" 1 records each phase of a team step (every phase timed, the slowest thread's work at least the
    threads' mean); 0, the default, records nothing."""
    e = engine("synthetic:tiny-llama")
    prompt = [(5 * k) % 400 + 1 for k in range(9)]
    cpu_layers.team_times()
    hidden_rows(e, [(prompt, 0)])
    assert all(v == (0.0, 0.0, 0.0) for v in cpu_layers.team_times().values())
    with pytest.raises(RuntimeError, match="team and times"):  # the tuning values are constants
        cpu_layers.knob("even", 0)
    old = cpu_layers.knob("times", 1)
    try:
        calls = cpu_layers.team_calls()
        hidden_rows(e, [(prompt, 0)])
        assert cpu_layers.team_calls() == calls + 1
        times = cpu_layers.team_times()
    finally:
        cpu_layers.knob("times", old)
    assert list(times) == list(cpu_layers.PHASES)
    for name, (wall, work, slowest) in times.items():
        assert wall > 0 and slowest >= work / e.config.threads > 0, (name, wall, work, slowest)
    assert all(v == (0.0, 0.0, 0.0) for v in cpu_layers.team_times().values())  # read once, then cleared
