"""Scheduler and engine behaviour: continuous batching, preemption, stopping, abort, sampling, timestamps."""

from __future__ import annotations

import os
import shutil

import pytest
from conftest import hf_greedy, prompts, set_eos

from mvllm import LLM, SamplingParams
from mvllm.engine.engine import Engine, EngineConfig


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def engine(path, **kw) -> Engine:
    kw.setdefault("num_blocks", 128)
    return Engine(EngineConfig(str(path), dtype="float32", **kw))


def drain(eng: Engine, max_steps: int = 2000) -> int:
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < max_steps, "the engine stopped making progress"
    return steps


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny("llama")


@pytest.fixture(params=["float64", "no-float64"])
def arithmetic(request, monkeypatch):
    """The sampler as on CPU and CUDA, and as on a device without float64 (MPS, emulated: see
    test_sampler_mps.py), where no float64 tensor may appear."""
    if request.param == "float64":
        yield
        return
    from test_sampler_mps import emulate_mps

    calls = emulate_mps(monkeypatch)
    yield
    assert calls, "the test never sampled"


def test_max_active_bounds_the_running_set(llama):
    eng = engine(llama[0], max_active=2)
    reqs = [eng.add_request(p, greedy(n)) for p, n in zip(prompts(10, [3, 9, 20, 4, 12, 6]), [5, 9, 3, 7, 4, 6])]
    waited = False
    while eng.has_unfinished():
        outs = eng.step()
        assert len(outs) <= 2 and len(eng.scheduler.running) <= 2
        waited |= len(eng.scheduler.running) == 2 and bool(eng.scheduler.waiting)
    assert waited
    assert [len(s.output_ids) for s in reqs] == [5, 9, 3, 7, 4, 6]
    assert all(s.finish_reason == "length" for s in reqs)


def test_tiny_pool_preempts_and_still_matches(llama):
    """12 blocks of 4 tokens for four requests that each grow to 30 tokens: requests get preempted and
    recomputed, and every one still finishes with the tokens of an unconstrained run."""
    path, ref = llama
    ps, n = prompts(11, [10, 7, 12, 9]), 20
    big = engine(path, block_size=4, num_blocks=256, max_active=4)
    small = engine(path, block_size=4, num_blocks=12, max_active=4)
    want = [big.add_request(p, greedy(n)) for p in ps]
    got = [small.add_request(p, greedy(n)) for p in ps]
    drain(big)
    drain(small)
    assert big.scheduler.num_preemptions == 0
    assert small.scheduler.num_preemptions > 0
    for w, g, p in zip(want, got, ps):
        assert g.output_ids == w.output_ids == hf_greedy(ref, p, n)
        assert g.finish_reason == "length"
        assert g.num_cached_tokens == w.num_cached_tokens == 0
        assert len(g.times.tokens) == n
    assert small.blocks.num_free == small.blocks.num_blocks


def test_seeded_sampling_survives_preemption(llama, arithmetic):
    path, _ = llama
    ps = prompts(22, [10, 7, 12, 9])
    runs = []
    for num_blocks in (256, 12):
        eng = engine(path, block_size=4, num_blocks=num_blocks)
        seqs = [eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.5, seed=i))
                for i, p in enumerate(ps)]
        drain(eng)
        runs.append([s.output_ids for s in seqs])
    assert eng.scheduler.num_preemptions > 0
    assert runs[0] == runs[1]


def test_pool_smaller_than_all_prompts_waits_instead_of_failing(llama):
    path, _ = llama
    eng = engine(path, block_size=4, num_blocks=8, max_active=4)
    reqs = [eng.add_request(p, greedy(6)) for p in prompts(12, [20, 20, 20])]
    drain(eng)
    assert all(len(s.output_ids) == 6 for s in reqs)
    assert eng.blocks.num_free == 8


@pytest.fixture(scope="module")
def eos_model(llama, tmp_path_factory):
    """The tiny Llama with its EOS set to the 4th token it generates for `eos_prompt`."""
    path, ref = llama
    prompt = prompts(13, [8])[0]
    plain = hf_greedy(ref, prompt, 16)
    eos = plain[3]
    copy = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(path, copy)
    set_eos(copy, eos)
    return LLM(str(copy), dtype="float32", num_blocks=64), prompt, plain, eos


def test_stops_on_eos_unless_ignored(eos_model):
    llm, prompt, plain, eos = eos_model
    first = plain.index(eos)
    out = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out.token_ids == plain[:first + 1] and out.finish_reason == "stop"
    out = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == plain and out.finish_reason == "length"
    out = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.0, min_tokens=first + 2))[0]
    assert len(out.token_ids) >= first + 2 and eos not in out.token_ids[:first + 2]


def test_stop_token_ids_and_max_tokens(eos_model):
    llm, prompt, plain, _ = eos_model
    stop = plain[1]
    out = llm.generate(prompt, greedy(16, stop_token_ids=[stop]))[0]
    assert out.token_ids == plain[:plain.index(stop) + 1] and out.finish_reason == "stop"
    for n in (1, 5):
        out = llm.generate(prompt, greedy(n))[0]
        assert out.token_ids == plain[:n] and out.finish_reason == "length"


def test_context_length_caps_generation(llama):
    path, ref = llama
    eng = engine(path, max_model_len=40)
    prompt = prompts(14, [34])[0]
    seq = eng.add_request(prompt, greedy(20))
    drain(eng)
    assert len(seq.token_ids) == 40 and seq.finish_reason == "length"
    assert seq.output_ids == hf_greedy(ref, prompt, 6)


def test_abort_frees_blocks(llama):
    eng = engine(llama[0], max_active=2)
    free0 = eng.blocks.num_free
    a, b, c = (eng.add_request(p, greedy(30)) for p in prompts(15, [40, 20, 10]))
    eng.step()
    eng.step()
    assert eng.blocks.num_free < free0
    assert eng.abort(c.request_id) is c and c.finish_reason == "abort"  # still waiting
    assert eng.abort(a.request_id) is a and a.finish_reason == "abort"  # running, holds blocks
    assert a.block_table == [] and a.times.finished is not None
    assert eng.abort(a.request_id) is None
    eng.abort(b.request_id)
    assert not eng.has_unfinished()
    assert eng.blocks.num_free == free0
    assert eng.step() == []
    again = eng.add_request(prompts(15, [40])[0], greedy(3))  # the engine serves on after aborts
    drain(eng)
    assert len(again.output_ids) == 3 and again.num_cached_tokens == 32


def sampled(llm: LLM, prompt, **kw) -> list[int]:
    return llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, **kw))[0].token_ids


def test_seeded_sampling_is_reproducible_and_seed_dependent(llama, arithmetic):
    llm = LLM(str(llama[0]), dtype="float32", num_blocks=128)
    prompt = prompts(16, [12])[0]
    a = sampled(llm, prompt, temperature=1.5, seed=1)
    assert sampled(llm, prompt, temperature=1.5, seed=1) == a
    others = [sampled(llm, prompt, temperature=1.5, seed=s) for s in (2, 3)]
    assert all(o != a for o in others)
    assert a != sampled(llm, prompt, temperature=0.0)
    # the same seed gives the same tokens when batched with other requests
    outs = llm.generate([prompts(17, [30])[0], prompt, prompts(18, [5])[0]],
                        SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.5, seed=1))
    assert outs[1].token_ids == a
    assert sampled(llm, prompt, temperature=1.5, seed=1, top_k=20, top_p=0.9) == \
        sampled(llm, prompt, temperature=1.5, seed=1, top_k=20, top_p=0.9)


def test_top_k_1_and_tiny_top_p_are_greedy(llama, arithmetic):
    llm = LLM(str(llama[0]), dtype="float32", num_blocks=128)
    for prompt in prompts(19, [5, 23]):
        want = sampled(llm, prompt, temperature=0.0)
        assert sampled(llm, prompt, temperature=1.0, top_k=1) == want
        assert sampled(llm, prompt, temperature=1.0, top_p=1e-6) == want


def test_timestamps_are_ordered(llama):
    eng = engine(llama[0], max_active=2)
    reqs = [eng.add_request(p, greedy(n)) for p, n in zip(prompts(20, [6, 30, 11]), [4, 8, 5])]
    drain(eng)
    for seq in reqs:
        t = seq.times
        assert t.arrival <= t.scheduled <= t.first_token == t.tokens[0] <= t.finished
        assert t.tokens == sorted(t.tokens) and t.tokens[-1] <= t.finished
        assert len(t.tokens) == seq.num_output_tokens
    assert reqs[2].times.scheduled >= reqs[0].times.first_token  # it waited for a slot


def test_warm_seeds_the_cache(llama):
    eng = engine(llama[0])
    prefix = prompts(21, [37])[0]
    assert eng.cached_prefix_len(prefix + [1]) == 0
    assert eng.warm(prefix) == 32
    assert eng.blocks.num_free == eng.blocks.num_blocks
    seq = eng.add_request(prefix + [1, 2, 3], greedy(2))
    drain(eng)
    assert seq.num_cached_tokens == 32


@pytest.mark.parametrize("kw, support", [
    (dict(temperature=1.0), {0, 1, 2, 3}),
    (dict(temperature=1.0, top_p=0.75), {0, 1}),   # 0.5 + 0.3 reaches 0.75: the smallest such set
    (dict(temperature=1.0, top_p=0.85), {0, 1, 2}),
    (dict(temperature=1.0, top_k=3), {0, 1, 2}),
    (dict(temperature=1.0, top_k=3, top_p=0.4), {0}),
    (dict(temperature=0.0, top_k=3), {0}),
])
def test_sampler_support(kw, support, arithmetic):
    import torch

    from mvllm.engine.sampler import sample
    from mvllm.engine.sequence import Sequence

    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    seq = Sequence([1], SamplingParams(seed=0, **kw))
    counts = [0] * 4
    for _ in range(1500):
        counts[int(sample(logits, [seq])[0])] += 1
    assert {i for i, c in enumerate(counts) if c} == support
    if kw == dict(temperature=1.0):  # the plain distribution, within a few standard errors
        assert all(abs(c / 1500 - p) < 0.05 for c, p in zip(counts, [0.5, 0.3, 0.15, 0.05]))


@pytest.mark.parametrize("seed", [0, 1])
def test_random_churn_matches_transformers(llama, seed):
    """Requests arrive between steps, share prefixes, get aborted, and fight over a small pool: every
    request that finishes still has transformers' greedy tokens, and nothing leaks."""
    import random

    path, ref = llama
    rng = random.Random(seed)
    eng = engine(path, block_size=4, num_blocks=10, max_active=3)
    stems = prompts(50 + seed, [8, 13])
    todo = [(rng.choice(stems) + prompts(60 + i, [rng.randrange(1, 7)])[0], rng.randrange(4, 13))
            for i in range(16)]
    seqs, aborted, steps = [], set(), 0
    while todo or eng.has_unfinished():
        if todo and rng.random() < 0.6:
            prompt, n = todo.pop()
            seqs.append((eng.add_request(prompt, greedy(n)), prompt, n))
        live = [s for s, _, _ in seqs if s.finish_reason is None]
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            eng.abort(victim.request_id)
            aborted.add(victim.request_id)
        eng.step()
        steps += 1
        assert steps < 1000
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert any(s.num_cached_tokens for s, _, _ in seqs)
    assert eng.scheduler.num_preemptions > 0 and aborted
    for seq, prompt, n in seqs:
        if seq.request_id in aborted:
            assert seq.finish_reason == "abort" and seq.output_ids == hf_greedy(ref, prompt, n)[:len(seq.output_ids)]
        else:
            assert seq.output_ids == hf_greedy(ref, prompt, n), seq.request_id


@pytest.mark.parametrize("scale", [4.0, 0.05])  # peaked rows (cut among the candidates) and flat ones (fallback)
def test_top_k_top_p_on_candidates_keeps_what_the_whole_sort_keeps(scale):
    import torch

    from mvllm.engine.sampler import top_k_top_p

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 5000, generator=gen) * scale
    params = [SamplingParams(temperature=1.0, top_p=p, top_k=k)
              for p, k in ((0.9, -1), (0.5, -1), (0.99, 100), (1.0, 40), (0.95, 3000), (0.2, -1))]
    whole = top_k_top_p(logits, params, candidates=5000)
    cut = top_k_top_p(logits, params, candidates=64)
    assert torch.equal(whole.isinf(), cut.isinf())
    assert torch.equal(whole[~whole.isinf()], cut[~cut.isinf()])
    kept = (~whole.isinf()).sum(-1).tolist()
    assert kept[3] == 40 and kept[2] <= 100 and all(n >= 1 for n in kept)
    if scale < 1:  # flat: top-p 0.5 needs far more than 64 candidates, so the fallback ran
        assert kept[1] > 64


def test_freed_memory_is_kept_for_the_next_step():
    """machine.keep_freed_memory (a CPU engine calls it once loaded): 20 MB allocated, written and freed again and
    again touches fresh pages only the first time, where glibc by default hands the freed top of its heap back
    and faults it in again each round; in processes of their own."""
    import subprocess
    import sys

    from mvllm import machine

    if machine.system() != "linux":
        pytest.skip("glibc's mallopt: Linux only")
    code = """if True:
        import ctypes, resource
        from mvllm import machine
        kept = machine.keep_freed_memory()
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
        for i in range(6):
            if i == 2:
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [libc.malloc(100 << 10) for _ in range(200)]  # under the mmap threshold: the heap
            for b in blocks:
                ctypes.memset(b, 1, 100 << 10)
            for b in reversed(blocks):
                libc.free(b)
        print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """
    faults = {}
    for setting in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "MVLLM_KEEP_FREED": setting}).stdout.split()
        if setting == "1" and out[0] != "True":
            pytest.skip("this C library has no mallopt (not glibc)")
        assert out[0] == {"1": "True", "0": "False"}[setting]
        faults[setting] = int(out[1])
    assert faults["1"] < 500 < 10_000 < faults["0"], faults  # 4 rounds of 20 MB: about 20,000 faults of 4 KB
