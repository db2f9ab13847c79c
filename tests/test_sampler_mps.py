"""Sampling on a device without float64 (Apple's MPS), emulated on the CPU: the sampler is told the device
has no float64 (`supports_float64`) and runs under a mode that refuses any float64 tensor, so a float64 left
on that path fails the test. Under it sampling keeps its distribution (test_engine.py's sampler tests run
both ways through `emulate_mps`), its seeded reproducibility, and draws a row's long tail that one float32
cumulative sum (as a GPU accumulates it) would drop. A greedy batch whose argmax the step computed runs no
op at all."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mvllm import SamplingParams
from mvllm.engine import sampler
from mvllm.engine.sequence import Sequence


class NoFloat64(TorchDispatchMode):
    """Every op that makes a float64 tensor (a factory, a conversion, a cumsum's dtype=...) raises."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = (out,) if isinstance(out, torch.Tensor) else tree_leaves(out)
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in leaves):
            raise AssertionError(f"{func} made a float64 tensor on a device without float64")
        return out


class Ops(TorchDispatchMode):
    """Records the ops run under it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


class Float32Cumsum(TorchFunctionMode):
    """float32 cumulative sums accumulated in float32, one addition after another, as a GPU kernel does
    (torch's CPU kernel accumulates float32 in float64, which hides what float32 loses)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.cumsum, torch.Tensor.cumsum, torch.Tensor.cumsum_) and args[0].dtype == torch.float32:
            x, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
            out = torch.from_numpy(np.cumsum(x.numpy(), axis=dim, dtype=np.float32))
            return x.copy_(out) if func is torch.Tensor.cumsum_ else out
        return func(*args, **kwargs)


def emulate_mps(monkeypatch) -> list[int]:
    """Make the sampler take its path for devices without float64 and run every `sample` (the batch's and,
    after a failure, each row's) under NoFloat64; returns a list that counts those calls."""
    calls = []
    original = sampler.sample

    def guarded(*args, **kwargs):
        calls.append(1)
        with NoFloat64():
            return original(*args, **kwargs)

    monkeypatch.setattr(sampler, "supports_float64", lambda device: False)
    monkeypatch.setattr(sampler, "sample", guarded)
    return calls


def seqs(n: int, **kw) -> list[Sequence]:
    return [Sequence([1], SamplingParams(**kw)) for _ in range(n)]


def test_the_emulation_refuses_the_float64_path():
    logits = torch.randn(2, 50)
    with pytest.raises(AssertionError, match="float64"), NoFloat64():
        sampler.sample(logits, seqs(2, temperature=1.0))  # the sampler as it runs on CPU and CUDA
    for make in (lambda: torch.zeros(2, dtype=torch.float64), lambda: logits.double(),
                 lambda: logits.to(torch.float64), lambda: torch.tensor([0.5], dtype=torch.float64)):
        with pytest.raises(AssertionError, match="float64"), NoFloat64():
            make()
    assert sampler.supports_float64(torch.device("cpu")) and not sampler.supports_float64(torch.device("mps"))


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
                                dict(temperature=1.3, top_k=40), dict(temperature=1.0, top_k=50, top_p=0.8),
                                dict(temperature=1.0, min_tokens=2)], ids=["plain", "top-p", "top-k", "both",
                                                                           "min-tokens"])
def test_seeded_sampling_without_float64_is_reproducible_alone_and_batched(monkeypatch, kw):
    calls = emulate_mps(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 12, 3000, generator=gen) * 3  # 12 steps of a batch of 5
    stop = [int(logits[0, 0].argmax())]

    def run(rows: list[int], seed_of) -> dict[int, list[int]]:
        batch = {r: Sequence([1], SamplingParams(seed=seed_of(r), stop_token_ids=stop, max_tokens=20, **kw))
                 for r in rows}
        for s in batch.values():
            s.early_stop_ids = stop if s.params.min_tokens else []
        out = {r: [] for r in rows}
        for step in range(12):
            tokens = sampler.sample(logits[rows, step], list(batch.values()))
            for r, t in zip(rows, tokens.tolist()):
                out[r].append(t)
                batch[r].token_ids.append(t)
        return out

    together = run([0, 1, 2, 3, 4], lambda r: 100 + r)
    for r in range(5):
        assert run([r], lambda r: 100 + r)[r] == together[r]
    assert run([3, 1], lambda r: 100 + r) == {3: together[3], 1: together[1]}
    assert run([0, 1, 2, 3, 4], lambda r: 200 + r) != together  # the seed matters
    if kw.get("min_tokens"):
        assert all(stop[0] not in together[r][:2] for r in range(5))
    assert len(calls) > 60


def test_two_stage_draw_keeps_the_distribution_over_a_large_vocabulary(monkeypatch):
    """151,936 tokens (Qwen's vocabulary): the frequencies of the likeliest tokens, and of the bulk of
    unlikely ones, within 5 standard errors of their probabilities."""
    emulate_mps(monkeypatch)
    vocab, n = 151936, 2000
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(vocab, generator=gen) * 2.0
    logits[:6] = torch.tensor([14.0, 13.5, 13.0, 12.0, 11.0, 10.0])
    probs = logits.double().softmax(-1)
    seq = Sequence([1], SamplingParams(temperature=1.0))
    drawn = torch.cat([sampler.sample(logits.expand(250, vocab), [seq] * 250) for _ in range(n // 250)])
    counts = torch.bincount(drawn, minlength=vocab).double()
    groups = [counts[i] for i in range(6)] + [counts[6:].sum()]
    want = [probs[i] for i in range(6)] + [probs[6:].sum()]
    for got, p in zip(groups, want):
        assert abs(got / n - p) < 5 * (p * (1 - p) / n) ** 0.5 + 1e-3, (got / n, p)
    assert 0.1 < want[-1] < 0.9  # the tail holds real mass


def test_two_stage_draw_keeps_a_tail_one_float32_cumsum_drops():
    """Token 0 holds 99.6% of the mass and 151,935 tokens of 2.5e-8 each the rest: each is below half a
    float32 step of the running sum near 1, so one float32 cumulative sum never draws them. The two-stage
    draw, under the same float32 accumulation, gives them their 0.38% (u swept over [0, 1) evenly)."""
    vocab, n = 151936, 4096
    probs = torch.full((vocab,), 2.5e-8)
    probs[0] = 1 - probs[1:].double().sum().item()
    tail = probs[1:].double().sum().item()
    u = torch.stack([(torch.arange(n) + 0.5) / n, torch.full((n,), 0.37)], dim=1)
    with Float32Cumsum(), NoFloat64():
        two = sum(int((sampler.invert_two_stage(probs.expand(len(rows), vocab), rows) != 0).sum())
                  for rows in u.split(256))
        cdf = probs.cumsum(dim=-1)
        one = int((torch.searchsorted(cdf, (1 - u[:, 0]) * cdf[-1]) != 0).sum())
    assert one == 0  # what a single float32 cdf does on the device
    assert abs(two / n - tail) < 2 / n


def test_two_stage_draw_never_picks_a_token_without_mass():
    """Edges of u (0 and the largest float32 below 1), a vocabulary that is no multiple of the block width
    (padding after the last token), and masked tokens among the blocks."""
    vocab = 1000  # blocks of 32: 32 blocks, the last one holding 8 tokens and 24 of padding
    probs = torch.zeros(4, vocab)
    probs[0, [3, 500, 999]] = torch.tensor([0.2, 0.5, 0.3])
    probs[1, 999] = 1.0
    probs[2, 0] = 1.0
    probs[3, 31:33] = 0.5  # the last token of block 0, the first of block 1
    edge = 1 - 2.0 ** -24
    for u in ([0.0, 0.0], [edge, edge], [0.0, edge], [edge, 0.0], [0.5, 0.5]):
        tokens = sampler.invert_two_stage(probs, torch.tensor([u] * 4))
        assert all(probs[i, t] > 0 for i, t in enumerate(tokens.tolist())), (u, tokens)


def test_a_greedy_batch_with_its_argmax_runs_no_op():
    """The common path on CUDA: the step's graph computed the argmax; sampling reads it and nothing else
    (no op, so no wait for the device), in the batch's retry wrapper too."""
    logits, argmax = torch.randn(3, 40), torch.tensor([1, 2, 3])
    batch = seqs(3, temperature=0.0)
    with Ops() as seen:
        assert sampler.sample(logits, batch, argmax) is argmax
        tokens, failed = sampler.sample_rows(logits, batch, argmax)
    assert tokens is argmax and not failed and seen.ops == []
