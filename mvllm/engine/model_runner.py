"""Runs the decoder over a scheduled batch: gathers inputs, owns the KV cache, samples."""

from __future__ import annotations

import torch

from mvllm.engine.sampler import sample
from mvllm.engine.scheduler import Batch
from mvllm.model.attention import build_meta
from mvllm.model.decoder import Decoder


class ModelRunner:
    def __init__(self, model: Decoder, device: torch.device, dtype: torch.dtype, num_blocks: int,
                 block_size: int):
        cfg = model.cfg
        self.model, self.device, self.dtype, self.block_size = model, device, dtype, block_size
        shape = (2, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]

    @staticmethod
    def kv_bytes_per_token(model_cfg, dtype: torch.dtype) -> int:
        return 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * dtype.itemsize

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int]:
        seqs = batch.seqs
        spans = [(s.num_computed_tokens, len(s)) for s in seqs]
        ids = [t for s, (a, b) in zip(seqs, spans) for t in s.token_ids[a:b]]
        positions = [p for a, b in spans for p in range(a, b)]
        last, n = [], 0
        for a, b in spans:
            n += b - a
            last.append(n - 1)
        meta = build_meta(spans, [s.block_table for s in seqs], self.block_size, self.device)
        as_long = dict(dtype=torch.long, device=self.device)
        hidden = self.model(torch.tensor(ids, **as_long), torch.tensor(positions, **as_long), self.caches, meta)
        logits = self.model.logits(hidden[torch.tensor(last, **as_long)])
        return sample(logits, seqs)
