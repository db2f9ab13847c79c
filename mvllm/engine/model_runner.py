"""Runs the decoder over a scheduled batch: gathers inputs, owns the KV cache, samples.

On CUDA, steps of few new tokens (decode, warm-prefix prefill, mixed) replay CUDA graphs, with the LM head
and greedy argmax inside for steps of up to 64 tokens; with Triton (`compile`, the default) every step runs
torch.compile'd code whose attention reads the paged cache through the block table, graphs or not
(engine/cuda_graphs.py). Without it larger steps, and every step on CPU and
MPS, run eagerly. On x86 CPUs the float32 and bfloat16 Linear layers run
through oneDNN with pre-packed weights (`quant.pack`); in float32 (and int8w) the rest of each layer runs
through mvllm's fused CPU kernels where they build (`model/fused.py`; `fused=False` turns them off)."""

from __future__ import annotations

import torch

from mvllm.engine import cpu_fused
from mvllm.engine.quant import pack, packable
from mvllm.engine.sampler import sample
from mvllm.engine.scheduler import Batch
from mvllm.model import table_attention
from mvllm.model.attention import build_meta
from mvllm.model.decoder import Decoder


class ModelRunner:
    def __init__(self, model: Decoder, device: torch.device, dtype: torch.dtype, num_blocks: int,
                 block_size: int, graphs: bool = False, max_active: int = 4, max_model_len: int = 4096,
                 fused: bool = True, compiled: bool = True):
        cfg = model.cfg
        if packable(device, dtype):
            pack(model)
        self.model, self.device, self.dtype, self.block_size = model, device, dtype, block_size
        self.fused = fused and device.type == "cpu" and dtype == torch.float32 and cpu_fused.available()
        scratch = num_blocks * block_size  # one extra slot: where padded graph rows write their K/V
        shape = (2, scratch + 1, cfg.num_kv_heads, cfg.head_dim)
        self.caches = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        self.compiled = compiled and table_attention.available(device)
        self.captured = graphs and device.type == "cuda"
        self.layout = "fused" if self.fused else "table" if self.compiled else ""
        self.graphs = None
        if self.captured or self.compiled:
            from mvllm.engine.cuda_graphs import GraphRunner

            self.graphs = GraphRunner(model, self.caches, block_size, max_active, max_model_len, scratch,
                                      capture=self.captured, compiled=self.compiled)

    @staticmethod
    def kv_bytes_per_token(model_cfg, dtype: torch.dtype) -> int:
        return 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * dtype.itemsize

    @torch.inference_mode()
    def run(self, batch: Batch) -> list[int]:
        seqs = batch.seqs
        spans = [(s.num_computed_tokens, len(s)) for s in seqs]
        last, n = [], 0
        for a, b in spans:
            n += b - a
            last.append(n - 1)
        pick = None if n == len(seqs) else torch.tensor(last, device=self.device)
        logits, tokens = self.logits(seqs, spans, pick)
        return sample(logits, seqs, tokens)

    def logits(self, seqs, spans: list[tuple[int, int]],
               rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [T, vocab] of the new tokens (only those at `rows`, if given) by the served path, and their
        argmax where the step's graph computed it (then the logits are in the model's dtype, else float32).
        Outside a graph the LM head runs on those rows only: a prefill's other tokens need none."""
        hidden = self.hidden(seqs, spans)
        g = self.graphs
        if g is not None and g.head_ran:
            logits, tokens = g.logits[:len(hidden)], g.tokens[:len(hidden)]
            return (logits, tokens) if rows is None else (logits[rows], tokens[rows])
        return self.model.logits(hidden if rows is None else hidden[rows]), None

    def hidden(self, seqs, spans: list[tuple[int, int]]) -> torch.Tensor:
        """Hidden states [T, hidden] of the new tokens, by the path a served step takes: a CUDA graph (or the
        compiled step) where one fits, else eagerly."""
        key = self.graphs.bucket(spans) if self.graphs else None
        if key is None:
            if self.graphs:
                self.graphs.head_ran = False
            return self.forward(seqs, spans)
        return self.graphs.run(seqs, spans, key)

    def forward(self, seqs, spans: list[tuple[int, int]]) -> torch.Tensor:
        ids = [t for s, (a, b) in zip(seqs, spans) for t in s.token_ids[a:b]]
        positions = [p for a, b in spans for p in range(a, b)]
        meta = build_meta(spans, [s.block_table for s in seqs], self.block_size, self.device, self.layout)
        as_long = dict(dtype=torch.long, device=self.device)
        return self.model(torch.tensor(ids, **as_long), torch.tensor(positions, **as_long), self.caches, meta)
