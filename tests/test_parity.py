"""Greedy token ids equal transformers' generate (float32, CPU): tiny random Llama / Qwen2 / Llama-3-rope
models, and SmolLM2 from the embedded GGUF."""

from __future__ import annotations

import pytest
from conftest import hf_greedy, prompts

from mvllm import LLM, SamplingParams

KINDS = ["llama", "qwen2", "llama3"]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llms(tiny):
    made = {}

    def get(kind: str, **kw) -> LLM:
        kw.setdefault("num_blocks", 128)
        key = (kind, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = LLM(str(tiny(kind)[0]), dtype="float32", **kw)
        return made[key]

    return get


@pytest.mark.parametrize("budget", [None, 8])
@pytest.mark.parametrize("kind", KINDS + ["llama-bias", "mistral"])
def test_single_requests(kind, budget, tiny, llms):
    """budget 8: every prompt of more than 8 tokens runs in chunks of 8 (max_step_tokens)."""
    _, ref = tiny(kind)
    llm = llms(kind, max_step_tokens=budget)
    for prompt in prompts(1, [1, 7, 16, 45, 70]):  # 70 + 24 crosses the llama3 original context (32)
        out = llm.generate(prompt, greedy(24))[0]
        assert out.token_ids == hf_greedy(ref, prompt, 24)
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == prompt


@pytest.mark.parametrize("budget", [None, 11])
@pytest.mark.parametrize("kind", KINDS)
def test_continuous_batch_of_mixed_lengths(kind, budget, tiny, llms):
    """More prompts than max_active, finishing at different steps: new ones are admitted mid-flight and
    share batches (prefill beside decode) with running ones; with a budget of 11 tokens, in chunks."""
    _, ref = tiny(kind)
    llm = llms(kind, max_active=3, max_step_tokens=budget)
    sched = llm.engine.scheduler
    seen, schedule = [], sched.schedule

    def record():
        batch = schedule()
        seen.append((len(batch.prefill), len(batch.decode), len(sched.running)))
        return batch

    sched.schedule = record
    lengths, budgets = [5, 33, 17, 2, 50, 9, 24], [12, 4, 20, 7, 9, 15, 6]
    ps = prompts(2, lengths)
    reqs = [llm.engine.add_request(p, greedy(n)) for p, n in zip(ps, budgets)]
    steps = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        steps += 1
        assert steps < 500
    del sched.schedule
    for seq, p, n in zip(reqs, ps, budgets):
        assert seq.output_ids == hf_greedy(ref, p, n)
    assert max(running for _, _, running in seen) == 3
    assert any(pre and dec for pre, dec, _ in seen[1:])
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


@pytest.mark.parametrize("budget", [None, 7])
@pytest.mark.parametrize("kind", KINDS)
def test_prefix_cache_gives_same_tokens(kind, budget, tiny, llms):
    base = prompts(3, [40])[0]
    path, ref = tiny(kind)
    cached = llms(kind, num_blocks=64, max_step_tokens=budget)
    first = cached.generate(base, greedy(20))[0]
    assert first.num_cached_tokens == 0
    assert first.token_ids == hf_greedy(ref, base, 20)
    # The first run computed KV for 40 + 19 tokens: three full blocks of 16, the third ending inside the
    # generated tokens. A prompt never takes its last token from the cache.
    tail = prompts(4, [9])[0]
    cases = [
        (base, 32),                            # the same prompt again: (40 - 1) // 16 blocks
        (base[:35] + tail, 32),                # shares 35 tokens: two full blocks
        (base + first.token_ids[:10], 48),     # a follow-up turn: the third block holds generated tokens
        (base[:15] + tail, 0),                 # shares less than one block
    ]
    for prompt, expect in cases:
        assert cached.engine.cached_prefix_len(prompt) == expect
        hit = cached.generate(prompt, greedy(12))[0]
        assert hit.num_cached_tokens == expect
        miss = LLM(str(path), dtype="float32", num_blocks=64).generate(prompt, greedy(12))[0]
        assert miss.num_cached_tokens == 0
        assert hit.token_ids == miss.token_ids == hf_greedy(ref, prompt, 12)


def test_prefix_cache_inside_one_batch(tiny, llms):
    """Requests sharing a warmed prefix, batched together, each match transformers."""
    _, ref = tiny("qwen2")
    llm = llms("qwen2", num_blocks=96, max_active=4)
    shared = prompts(5, [48])[0]
    assert llm.engine.warm(shared) == 48
    ps = [shared + t for t in prompts(6, [1, 5, 16, 30])]
    outs = llm.generate(ps, greedy(10))
    for out, p in zip(outs, ps):
        assert out.num_cached_tokens == 48
        assert out.token_ids == hf_greedy(ref, p, 10)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_stop_tokens_and_min_tokens_match_transformers(kind, tiny, llms):
    """stop_token_ids behaves as transformers' eos_token_id, and min_tokens as min_new_tokens (the stop
    tokens cannot be produced before min_tokens outputs)."""
    _, ref = tiny(kind)
    llm = llms(kind)
    prompt = prompts(7, [11])[0]
    plain = hf_greedy(ref, prompt, 30)
    stop = plain[2]
    out = llm.generate(prompt, greedy(30, stop_token_ids=[stop]))[0]
    assert out.token_ids == hf_greedy(ref, prompt, 30, eos_token_id=stop)
    assert out.token_ids[-1] == stop and out.finish_reason == "stop"
    out = llm.generate(prompt, greedy(30, stop_token_ids=[stop], min_tokens=6))[0]
    want = hf_greedy(ref, prompt, 30, eos_token_id=stop, min_new_tokens=6)
    assert out.token_ids == want
    assert stop not in out.token_ids[:6]


def test_smollm2_matches_transformers(smollm2, smollm2_hf):
    tok = smollm2.tokenizer.hf
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village near the sea,"]
    outs = smollm2.generate(texts, greedy(16))
    for out, text in zip(outs, texts):
        assert out.prompt_token_ids == tok.encode(text)
        assert out.token_ids == hf_greedy(smollm2_hf, out.prompt_token_ids, 16)
    again = smollm2.generate(texts[2], greedy(16))[0]
    assert again.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16
    assert again.token_ids == outs[2].token_ids


def test_smollm2_knows_the_capital_of_france(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(max_tokens=32, temperature=0.0))
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
