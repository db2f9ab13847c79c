"""Greedy, temperature, top-k and top-p sampling, batched, with a per-request seeded generator.

One pass over the batch whatever its mix: greedy rows take the argmax; the others are scaled by their
temperature, cut to their top-k and top-p (within each row's highest CANDIDATES logits where those hold the
top-p mass, else over the whole row), and drawn by inverting their cumulative distribution at one uniform
number each. The host waits for the device only where top-p is asked for (to find the rows whose
candidates fall short); the caller reads the ids. A request with a seed draws its number from its own
generator: the same seed gives the same tokens, alone or batched with others.
"""

from __future__ import annotations

import torch

from mvllm.engine.sequence import Sequence

CANDIDATES = 1024  # a partial top-k over the vocabulary is cheaper than sorting it (151,936 entries for Qwen)


def sample(logits: torch.Tensor, seqs: list[Sequence], argmax: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> one token id per sequence ([B], on the logits' device), computed in float32. `argmax`:
    the logits' argmax, where the step computed it already (inside its CUDA graph): a greedy batch then reads
    only that, and nothing waits for the device."""
    early = [(i, s.early_stop_ids) for i, s in enumerate(seqs)
             if s.early_stop_ids and s.num_output_tokens < s.params.min_tokens]
    rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if early or rows or argmax is None:
        logits = logits.float()
    if early:
        logits = logits.clone()
        for i, ids in early:
            logits[i, ids] = float("-inf")
    tokens = logits.argmax(dim=-1) if early or argmax is None else argmax
    if rows:
        drawn = _draw(logits[rows] if len(rows) < len(seqs) else logits, [seqs[i] for i in rows])
        tokens = tokens.index_copy(0, torch.tensor(rows, device=logits.device), drawn)
    return tokens


def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[-1]
    params = [s.params for s in seqs]
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    cut = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if cut:
        logits[cut] = top_k_top_p(logits[cut], [params[i] for i in cut])
    cdf = logits.softmax(dim=-1).to(torch.float64).cumsum_(dim=-1)
    u = torch.rand(len(seqs), 1, device=device, dtype=torch.float64)
    for i, seq in enumerate(seqs):
        if seq.params.seed is not None:
            if seq.generator is None:
                seq.generator = torch.Generator(device=device).manual_seed(seq.params.seed)
            u[i] = torch.rand(1, generator=seq.generator, device=device, dtype=torch.float64)
    # 1 - u lies in (0, 1]: the first token whose cumulative mass reaches it has a mass above zero
    return torch.searchsorted(cdf, (1 - u) * cdf[:, -1:]).squeeze(1).clamp_(max=vocab - 1)


def top_k_top_p(logits: torch.Tensor, params, candidates: int = CANDIDATES) -> torch.Tensor:
    """Logits outside each row's top-k, then outside the smallest set whose mass reaches its top-p, set to
    -inf (top-k first, as vLLM and Hugging Face apply them). Each row is cut within its highest `candidates`
    logits (or its top-k, if larger) when those hold its top-p mass; the rest, on a sort of the whole row."""
    vocab, device = logits.shape[-1], logits.device
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=logits.dtype)
    width = min(vocab, max([candidates] + [p.top_k for p in params if 0 < p.top_k < vocab]))
    ordered, order = logits.topk(width, dim=-1)  # sorted, highest first
    ordered = ordered.masked_fill(torch.arange(width, device=device) >= k.unsqueeze(1), float("-inf"))
    # probabilities over the whole row after its top-k: within the candidates when top-k cut there
    total = torch.where(k < vocab, ordered.logsumexp(dim=-1), logits.logsumexp(dim=-1))
    probs = (ordered - total.unsqueeze(1)).exp()
    cum = probs.cumsum(dim=-1)
    drop = (cum - probs > top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    cut = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    if width < vocab:  # rows whose candidates miss the top-p mass (a flat distribution): the whole row
        short = ((cum[:, -1] < top_p) & (top_p < 1.0) & (k >= vocab)).nonzero().flatten().tolist()
        if short:
            cut[short] = top_k_top_p(logits[short], [params[i] for i in short], vocab)
    return cut
