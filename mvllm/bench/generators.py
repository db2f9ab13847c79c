"""Generated workloads: the reference's single prefix, vLLM's `random` and SGLang's `generated-shared-prefix`.

- prefix (the reference): one seeded prefix of `prefix_tokens` shared by every request, `suffix_tokens` of
  its own each, `output_tokens` each.
- random (vLLM bench's random dataset): an optional shared prefix of `prefix_tokens`, then a prompt of
  uniform length in [L(1 - r), L(1 + r)] for L = `suffix_tokens`, r = `range_ratio`; outputs likewise around
  `output_tokens`.
- shared-prefix (SGLang bench_serving's generated-shared-prefix): `groups` system prompts of `prefix_tokens`,
  `prompts_per_group` questions of about `suffix_tokens` each, shuffled; with `turns` > 1 every question is
  followed by turns whose prompt is the turn before's prompt, its reply and a new question, sent
  `think_time` seconds after that reply ends.
Ids are given so that a parent's is below its turns'; first turns take the arrival process's times in id order.
prefix and random take `output_from` (a Mooncake trace): output lengths drawn from its `output_length`s (seeded,
divided by `scale`) instead of `output_tokens`.
"""

from __future__ import annotations

import random

from mvllm.bench.experiment import Workload
from mvllm.bench.request import Built, Request, arrivals, context_of, fit, token_range


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    lo, hi = token_range(vocab)
    return [rng.randrange(lo, hi) for _ in range(n)]


def _around(rng: random.Random, mean: int, ratio: float) -> int:
    """vLLM's random lengths: uniform integers in [mean (1 - ratio), mean (1 + ratio)], at least 1."""
    return max(1, rng.randint(int(mean * (1 - ratio)), int(mean * (1 + ratio)))) if ratio else max(1, mean)


def _outputs(w: Workload, n: int) -> list[int] | None:
    """Output lengths drawn from `output_from`'s distribution, or None where the workload names no trace."""
    if not w.output_from:
        return None
    from mvllm.bench.traces import output_lengths

    pool = output_lengths(w.output_from)
    rng = random.Random(f"outputs-{w.seed}")
    return [max(1, round(rng.choice(pool) / w.scale)) for _ in range(n)]


def prefix(w: Workload, vocab: int, model: str | None = None) -> Built:
    """Prompts depend only on the seed and the lengths, not on arrivals."""
    rng = random.Random(f"prompts-{w.seed}")
    shared = _tokens(rng, w.prefix_tokens, vocab)
    times = arrivals(w)
    outs = _outputs(w, len(times)) or [w.output_tokens] * len(times)
    reqs = [Request(i, shared + _tokens(rng, w.suffix_tokens, vocab), outs[i], t) for i, t in enumerate(times)]
    return Built(shared, reqs)


def random_lengths(w: Workload, vocab: int, model: str | None = None) -> Built:
    rng = random.Random(f"random-{w.seed}")
    shared = _tokens(rng, w.prefix_tokens, vocab)
    context = context_of(model) if model else None
    reqs, dropped = [], 0
    times = arrivals(w)
    drawn = _outputs(w, len(times))
    for i, t in enumerate(times):
        n, out = w.prefix_tokens + _around(rng, w.suffix_tokens, w.range_ratio), _around(rng, w.output_tokens,
                                                                                       w.range_ratio)
        out = drawn[i] if drawn else out
        prompt = shared + _tokens(rng, n - w.prefix_tokens, vocab)
        keep = fit(n, out, w, context)
        if keep is None:
            dropped += 1
            continue
        reqs.append(Request(len(reqs), prompt[:keep], out, t))
    return Built(shared, reqs, {"dropped": {"over_context": dropped}} if dropped else {})


def shared_prefix(w: Workload, vocab: int, model: str | None = None) -> Built:
    rng = random.Random(f"shared-prefix-{w.seed}")
    systems = [_tokens(rng, w.prefix_tokens, vocab) for _ in range(w.groups)]
    firsts = [(g, _tokens(rng, _around(rng, w.suffix_tokens, w.range_ratio), vocab))
              for g in range(w.groups) for _ in range(w.prompts_per_group)]
    rng.shuffle(firsts)
    times = arrivals(w, len(firsts))
    context = context_of(model) if model else None
    reqs: list[Request] = []
    dropped = 0
    for (g, question), t in zip(firsts, times, strict=True):
        total, parent = len(systems[g]) + len(question), None
        prompt = systems[g] + question
        for turn in range(w.turns):
            out = _around(rng, w.output_tokens, w.range_ratio)
            if fit(total, out, w, context) != total:  # a conversation ends at its first turn that does not fit
                dropped += w.turns - turn
                break
            reqs.append(Request(len(reqs), prompt, out, t if turn == 0 else w.think_time, parent=parent))
            parent = reqs[-1].id
            question = _tokens(rng, _around(rng, w.suffix_tokens, w.range_ratio), vocab)
            prompt, total = question, total + out + len(question)
    return Built([], reqs, {"dropped": {"over_context": dropped}} if dropped else {})
