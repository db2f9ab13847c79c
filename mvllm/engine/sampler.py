"""Greedy, temperature, top-k and top-p sampling with a per-request seeded generator."""

from __future__ import annotations

import os

import torch

from mvllm.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits [B, V] float32 -> one token id per sequence."""
    early = [(i, s.early_stop_ids) for i, s in enumerate(seqs)
             if s.early_stop_ids and s.num_output_tokens < s.params.min_tokens]
    if early:
        logits = logits.clone()
        for i, ids in early:
            logits[i, ids] = float("-inf")
    tokens = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if 0 < p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = row.sort(descending=True)
            probs = sorted_logits.softmax(-1)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest set whose mass reaches top_p
            row = row.scatter(0, order[drop], float("-inf"))
        if seq.generator is None:
            seed = p.seed if p.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            seq.generator = torch.Generator(device=logits.device).manual_seed(seed)
        tokens[i] = int(torch.multinomial(row.softmax(-1), 1, generator=seq.generator))
    return tokens
