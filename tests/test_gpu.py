"""The CUDA-graph path against the eager path. The row layout and input packing that the graphs replay are
checked on any machine (run eagerly); the graphs themselves only where CUDA exists."""

from __future__ import annotations

import pytest
import torch
from conftest import prompts

from mvllm import LLM, SamplingParams
from mvllm.engine.cuda_graphs import GraphRunner

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine; the graph "
                          "path is checked on the GPU machine through the device tool")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def workload(llm: LLM, vocab: int, prefix_len: int = 96, max_tokens: int = 12) -> list[list[int]]:
    """A warmed shared prefix, then batch 1 and batch 4 of prompts that hit it, admitted while others
    decode (mixed steps); returns every request's tokens."""
    prefix = prompts(7, [prefix_len], vocab=vocab)[0]
    tails = prompts(8, [20, 5, 33, 9, 14], vocab=vocab)
    llm.engine.warm(prefix)
    outs = llm.generate([prefix + tails[0]], greedy(max_tokens))
    outs += llm.generate([prefix + t for t in tails[1:]], greedy(max_tokens))
    assert all(o.num_cached_tokens == prefix_len for o in outs)
    return [o.token_ids for o in outs]


def test_row_layout_matches_standard_path(tiny):
    path = str(tiny("qwen2")[0])
    plain = LLM(path, dtype="float32", num_blocks=64)
    rows = LLM(path, dtype="float32", num_blocks=64)
    r = rows.engine.runner
    r.graphs = GraphRunner(r.model, r.caches, r.block_size, 4, rows.engine.max_model_len,
                           r.caches[0].shape[1] - 1, capture=False)
    assert workload(rows, 200, 64) == workload(plain, 200, 64)
    assert r.graphs.steps >= 12


@cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("model", ["synthetic:qwen2.5-0.5b", "synthetic:smollm2-135m"])
def test_graphs_match_eager(model, dtype):
    kw = dict(device="cuda", dtype=dtype, max_active=4, num_blocks=512)
    graphed = LLM(model, **kw)
    eager = LLM(model, graphs=False, **kw)
    assert graphed.engine.runner.graphs is not None and eager.engine.runner.graphs is None
    vocab = graphed.engine.source.config.vocab_size - 1
    got = workload(graphed, vocab, 496, 24)
    assert graphed.engine.runner.graphs.replays > 0
    assert got == workload(eager, vocab, 496, 24)
