"""Every step runs under a token budget (max_step_tokens): running decodes first, then the next chunks of prompts
partly prefilled, then waiting prompts FCFS while the budget lasts. A long prompt runs in chunks over several
steps; only its last chunk samples; each chunk's full blocks join the prefix cache as it runs; a request that
ends mid-prefill (abort, failure) returns its blocks; greedy tokens are those of the unbudgeted engine."""

from __future__ import annotations

import time

import pytest
from conftest import hf_greedy, make_tiny, prompts

from mvllm import SamplingParams
from mvllm.backends.spec import parse_backends
from mvllm.engine.engine import Engine, EngineConfig
from mvllm.errors import InvalidRequestError


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen(tiny):
    return tiny("qwen2")


def engine(path, **kw) -> Engine:
    kw.setdefault("num_blocks", 128)
    return Engine(EngineConfig(str(path), dtype="float32", **kw))


def drain(eng: Engine, record: list | None = None) -> None:
    schedule = eng.scheduler.schedule

    def logged():
        batch = schedule()
        if record is not None and batch:
            record.append(batch)
        return batch

    eng.scheduler.schedule = logged
    for _ in range(2000):
        if not eng.has_unfinished():
            del eng.scheduler.schedule
            return
        eng.step()
    raise AssertionError("the engine stopped making progress")


def test_a_long_prompt_runs_in_chunks_beside_running_decodes(qwen):
    """Budget 10 with three requests decoding: each step gives the three a token and the long prompt the 7 tokens
    left; only its last chunk samples, and the next prompt waits until a step has budget left."""
    eng = engine(qwen[0], max_active=5, max_step_tokens=10)
    short = [eng.add_request(p, greedy(30)) for p in prompts(1, [3, 3, 3])]
    steps: list = []
    for _ in range(2):
        eng.step()
    assert all(s.num_output_tokens == 2 for s in short)
    long = eng.add_request(prompts(2, [40])[0], greedy(4))
    late = eng.add_request(prompts(3, [5])[0], greedy(4))
    drain(eng, steps)
    first = steps[0]
    assert [s.request_id for s in first.decode] == [s.request_id for s in short]
    assert first.chunks == [(0, 7)] and first.sampled == first.decode and first.num_tokens == 10
    chunks = [c for b in steps for s, c in zip(b.prefill, b.chunks) if s is long]
    assert chunks == [(0, 7), (7, 14), (14, 21), (21, 28), (28, 35), (35, 40)]
    assert all(b.num_tokens <= 10 for b in steps)
    admitted = next(i for i, b in enumerate(steps) if late in b.admitted)
    assert admitted == 5 and steps[5].chunks == [(35, 40), (0, 2)]  # the budget's last 2 tokens: late's chunk
    assert long.num_output_tokens == 4 and long.output_ids == hf_greedy(qwen[1], long.token_ids[:40], 4)
    assert eng.blocks.num_free == eng.blocks.num_blocks


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("budget", [1, 5, 16, 33])
def test_greedy_tokens_do_not_depend_on_the_budget(qwen, budget, overlap):
    path, ref = qwen
    max_active = min(3, budget)
    eng = engine(path, max_active=max_active, max_step_tokens=budget, overlap=overlap, block_size=4)
    lengths, outs = [5, 47, 17, 2, 60, 9], [12, 4, 20, 7, 9, 15]
    ps = prompts(4, lengths)
    reqs = [eng.add_request(p, greedy(n)) for p, n in zip(ps, outs)]
    drain(eng)
    for seq, p, n in zip(reqs, ps, outs):
        assert seq.output_ids == hf_greedy(ref, p, n)
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_each_chunk_publishes_its_full_blocks(qwen):
    """A later request hits the blocks of a prompt still being prefilled, and its tokens are the cold ones."""
    path, ref = qwen
    eng = engine(path, max_active=2, max_step_tokens=20, block_size=8)
    base = prompts(5, [60])[0]
    first = eng.add_request(base, greedy(3))
    eng.step()  # tokens [0, 20): two full blocks of 8
    assert first.num_computed_tokens == 20 and first.num_output_tokens == 0
    assert eng.cached_prefix_len(base[:30] + [1, 2, 3]) == 16
    second = eng.add_request(base[:30] + [1, 2, 3], greedy(5))
    drain(eng)
    assert second.num_cached_tokens >= 16
    assert second.output_ids == hf_greedy(ref, base[:30] + [1, 2, 3], 5)
    assert first.output_ids == hf_greedy(ref, base, 3)


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_mid_prefill_returns_its_blocks(qwen, overlap):
    eng = engine(qwen[0], max_active=2, max_step_tokens=8, overlap=overlap)
    other = eng.add_request(prompts(6, [4])[0], greedy(20))
    long = eng.add_request(prompts(7, [50])[0], greedy(5))
    for _ in range(3):
        eng.step()
    assert 0 < long.num_computed_tokens < 50
    eng.abort(long.request_id)
    drain(eng)
    assert long.finish_reason == "abort" and other.num_output_tokens == 20
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_a_failed_chunk_ends_its_request_and_returns_its_blocks(qwen):
    eng = engine(qwen[0], max_active=2, max_step_tokens=8)
    long = eng.add_request(prompts(8, [40])[0], greedy(5))
    eng.step()
    forward = eng.runner.forward

    def broken(*args, **kw):
        raise RuntimeError("device lost")

    eng.runner.forward = broken
    outs = eng.step()
    eng.runner.forward = forward
    assert [o.seq for o in outs] == [long] and outs[0].error is not None
    assert long.finish_reason == "error" and eng.blocks.num_free == eng.blocks.num_blocks


def test_warm_runs_in_budgeted_steps(qwen):
    path, ref = qwen
    eng = engine(path, max_active=2, max_step_tokens=16, block_size=8)
    steps = []
    run = eng.runner.run
    eng.runner.run = lambda batch, prev=None: (steps.append(batch.num_tokens), run(batch, prev))[1]
    shared = prompts(9, [50])[0]
    assert eng.warm(shared) == 48
    assert steps == [16, 16, 16, 2]
    del eng.runner.run
    assert eng.blocks.num_free == eng.blocks.num_blocks
    out = eng.add_request(shared + [5, 6], greedy(4))
    drain(eng)
    assert out.num_cached_tokens == 48 and out.output_ids == hf_greedy(ref, shared + [5, 6], 4)


@pytest.mark.serial  # timed: alone, not beside another test worker
def test_decodes_keep_making_tokens_while_a_long_prompt_prefills(tmp_path):
    """On the CPU backend: four requests decode while a 1,536-token prompt is prefilled under a 64-token budget.
    Each step gives each of them a token, and their worst gap is one budgeted step: under a third of the time
    the same prompt takes whole (it is 26 chunks)."""
    path = tmp_path / "long"
    make_tiny(path, "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
              max_position_embeddings=2048)
    whole = engine(path, max_active=5, num_blocks=512, max_step_tokens=2048)
    prompt = prompts(10, [1536])[0]
    t0 = time.perf_counter()
    whole.add_request(prompt, greedy(1))
    whole.step()
    whole_s = time.perf_counter() - t0
    eng = engine(path, max_active=5, num_blocks=512, max_step_tokens=64)
    decoding = [eng.add_request(p, greedy(200)) for p in prompts(11, [8, 8, 8, 8])]
    for _ in range(3):
        eng.step()
    long = eng.add_request(prompt, greedy(1))
    stamps = {s.request_id: [] for s in decoding}
    steps = 0
    while long.num_output_tokens == 0:
        for out in eng.step():
            if out.seq in decoding:
                stamps[out.seq.request_id].append(time.perf_counter())
        steps += 1
    assert steps == 1536 // 60 + 1  # 60 prompt tokens a step beside the 4 decodes
    assert all(len(s) == steps for s in stamps.values())
    gap = max(b - a for s in stamps.values() for a, b in zip(s, s[1:]))
    print(f"worst gap {gap * 1e3:.1f} ms, whole prompt {whole_s * 1e3:.1f} ms")
    assert gap < whole_s / 3, (gap, whole_s)


def test_a_budget_below_the_decodes_is_refused():
    with pytest.raises(InvalidRequestError, match="max_step_tokens=2 is below max_active=4"):
        EngineConfig("synthetic:tiny-llama", max_active=4, max_step_tokens=2).validate()
    with pytest.raises(InvalidRequestError, match="max_step_tokens must be at least 1"):
        EngineConfig("synthetic:tiny-llama", max_step_tokens=0).validate()
    with pytest.raises(InvalidRequestError, match="backend cpu: max_step_tokens=3 is below max_active=4"):
        parse_backends("cpu=cpu/max_step_tokens=3", check_devices=False)
    spec = parse_backends("cpu=cpu/max_step_tokens=128", check_devices=False)[0]
    assert spec.engine_config("m").max_step_tokens == 128


def test_the_default_budget_is_the_devices(tiny):
    eng = engine(tiny("llama")[0], max_active=2)
    from mvllm.engine.sizes import STEP_TOKENS_HOST, default_step_tokens

    assert eng.config.max_step_tokens == STEP_TOKENS_HOST == eng.scheduler.max_step_tokens
    assert default_step_tokens("cuda", 79.1)[0] == 8192 and default_step_tokens("cuda", 39.4)[0] == 2048
