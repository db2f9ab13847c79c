"""Greedy, temperature, top-k and top-p sampling, batched, with a per-request seeded generator.

One pass over the batch whatever its mix: greedy rows take the argmax; the others are scaled by their
temperature, cut to their top-k and top-p (within each row's highest CANDIDATES logits where those hold the
top-p mass, else over the whole row), and drawn by inverting their cumulative distribution at a uniform
number. The host waits for the device only where top-p is asked for (to find the rows whose candidates fall
short); the caller reads the ids. A request with a seed draws its numbers from its own generator: the same
seed gives the same tokens, alone or batched with others.

Where the device has float64 (CPU, CUDA) the distribution is one float64 cumulative sum over the row and one
float64 uniform. Where it has none (MPS, `supports_float64`), nothing is float64. One float32
cumulative sum over the whole row (accumulated in float32, as a GPU does) would round each token's share to
the last bit of the running sum (2^-24 near 1): tokens below ~3e-8 after the row's bulk would never be drawn
and the others' shares would be off by up to that much, which over Qwen's 151,936 tokens can misplace ~1% of
the mass; a float32 uniform resolves no finer. So there a row is drawn in two float32 stages of about sqrt(V)
entries each, with two uniforms: a block of the vocabulary by the blocks' masses, then a token by the masses
within that block. P(token) = P(block) x P(token | block) is the same distribution, and each stage rounds
relative to its own total (a token's share to ~2^-24 of its block's mass, not of the row's): at most ~1e-4
of the mass misplaced, and only tokens below ~3e-8 of their block's mass go undrawn. A seeded request's
uniforms there come from its own CPU generator (float32, copied to the device with the step's others), so
they depend on no device generator.

`sample_rows` is what a served step calls: when the batch's sampling raises, it samples each row alone to
find the rows that fail, and returns the others' tokens with them. A seeded row sampled again this way
reuses the numbers it drew in the failed pass, so it gets the token it gets alone.
"""

from __future__ import annotations

import math

import torch

from mvllm.engine.sequence import Sequence

CANDIDATES = 1024  # a partial top-k over the vocabulary is cheaper than sorting it (151,936 entries for Qwen)


def supports_float64(device: torch.device) -> bool:
    """Whether the sampler may compute in float64 on `device` (Apple's MPS has no float64)."""
    return device.type != "mps"


Drawn = dict[int, torch.Tensor]  # id(seq) -> the uniforms its generator gave in this step


def sample(logits: torch.Tensor, seqs: list[Sequence], argmax: torch.Tensor | None = None,
           drawn: Drawn | None = None) -> torch.Tensor:
    """logits [B, V] -> one token id per sequence ([B], on the logits' device), computed in float32. `argmax`:
    the logits' argmax, where the step computed it already (inside its CUDA graph): a greedy batch then reads
    only that, and nothing waits for the device. `drawn`: a seeded sequence's uniforms already drawn for
    this step are taken from it, and those drawn now are put in it."""
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
        picked = _draw(logits[rows] if len(rows) < len(seqs) else logits, [seqs[i] for i in rows], drawn)
        tokens = tokens.index_copy(0, torch.tensor(rows, device=logits.device), picked)
    return tokens


def sample_rows(logits: torch.Tensor, seqs: list[Sequence],
                argmax: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[int, Exception]]:
    """`sample`, with the rows whose sampling raised: (ids [B], {row: exception}). The batch is sampled in
    one pass; only if that raises is each row sampled alone, and the rows that raise again hold token 0 (a
    valid id: an overlapped step may feed it to the next one, whose token for that row is dropped)."""
    drawn: Drawn = {}
    try:
        return sample(logits, seqs, argmax, drawn), {}
    except Exception:  # which rows fail is found below
        pass
    parts, failed = [], {}
    for i, seq in enumerate(seqs):
        try:
            parts.append(sample(logits[i:i + 1], [seq], None if argmax is None else argmax[i:i + 1], drawn))
        except Exception as e:  # the caller ends this request with the error
            failed[i] = e
            parts.append(torch.zeros(1, dtype=torch.long, device=logits.device))
    return torch.cat(parts), failed


def _draw(logits: torch.Tensor, seqs: list[Sequence], drawn: Drawn | None) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[-1]
    params = [s.params for s in seqs]
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    cut = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if cut:
        logits[cut] = top_k_top_p(logits[cut], [params[i] for i in cut])
    probs = logits.softmax(dim=-1)
    if supports_float64(device):
        cdf = probs.to(torch.float64).cumsum_(dim=-1)
        u = _uniforms(seqs, device, torch.float64, 1, drawn, host=False)
        # 1 - u lies in (0, 1]: the first token whose cumulative mass reaches it has a mass above zero
        return torch.searchsorted(cdf, (1 - u) * cdf[:, -1:]).squeeze(1).clamp_(max=vocab - 1)
    return invert_two_stage(probs, _uniforms(seqs, device, torch.float32, 2, drawn, host=True))


def _uniforms(seqs: list[Sequence], device: torch.device, dtype: torch.dtype, k: int, drawn: Drawn | None,
              host: bool) -> torch.Tensor:
    """[len(seqs), k] uniforms in [0, 1) on `device`: a seeded request's from its own generator (those in
    `drawn` reused), the others' from torch's default generator. `host`: the seeded requests' generators are
    CPU ones, their numbers copied to the device in one go; else generators of the device, as today on
    CPU and CUDA."""
    u = torch.rand(len(seqs), k, device=device, dtype=dtype)
    rows, mine, on = [], [], torch.device("cpu") if host else device
    for i, seq in enumerate(seqs):
        if seq.params.seed is not None:
            x = None if drawn is None else drawn.get(id(seq))
            if x is None:
                if seq.generator is None:
                    seq.generator = torch.Generator(device=on).manual_seed(seq.params.seed)
                x = torch.rand(k, generator=seq.generator, device=on, dtype=dtype)
                if drawn is not None:
                    drawn[id(seq)] = x
            if host:
                rows.append(i)
                mine.append(x)
            else:
                u[i] = x
    if rows:
        u[rows] = torch.stack(mine).to(device)
    return u


def invert_two_stage(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [n, V] (float32, rows summing to about 1), u [n, 2] uniforms in [0, 1) -> [n] token ids, each
    drawn with probability probs / row sum: a block of about sqrt(V) tokens by u[:, 0] over the blocks'
    masses, then a token of that block by u[:, 1] over its masses. Only float32 arithmetic."""
    n, vocab = probs.shape
    width = math.isqrt(vocab - 1) + 1
    count = -(-vocab // width)
    if count * width > vocab:  # zeros after the last token: never drawn (each pick has a mass above zero)
        probs = torch.nn.functional.pad(probs, (0, count * width - vocab))
    blocks = probs.reshape(n, count, width)
    cdf = blocks.sum(dim=-1).cumsum_(dim=-1)
    # 1 - u lies in (0, 1]: the first block (then token) whose cumulative mass reaches it has a mass above
    # zero. Its index is the count of those below (a search over ~sqrt(V) entries, with ops every device has)
    block = (cdf < (1 - u[:, :1]) * cdf[:, -1:]).sum(dim=-1, keepdim=True).clamp_(max=count - 1)
    inner = blocks.gather(1, block.unsqueeze(-1).expand(n, 1, width)).squeeze(1).cumsum_(dim=-1)
    token = (inner < (1 - u[:, 1:]) * inner[:, -1:]).sum(dim=-1, keepdim=True).clamp_(max=width - 1)
    return (block * width + token).squeeze(1).clamp_(max=vocab - 1)


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
