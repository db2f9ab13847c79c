"""Runs the decoder over a scheduled batch: gathers inputs, owns the KV cache, samples.

On CUDA, steps of few new tokens (decode, warm-prefix prefill, mixed) replay CUDA graphs, with the LM head
and greedy argmax inside for steps of up to 64 tokens (max_active, if more); with Triton (`compile`, the
default) every step runs torch.compile'd code whose attention reads the paged cache through the block table,
graphs or not (engine/cuda_graphs.py). Without it larger steps, and every step on CPU and MPS, run eagerly.
On x86 CPUs the float32 and bfloat16 Linear layers run through oneDNN with pre-packed weights (`quant.pack`);
in float32 (and int8w) the rest of each layer runs through mvllm's fused CPU kernels where they build
(`kernels/cpu_fused.py`; `fused=False` turns them off)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mvllm.engine.cuda_graphs import GraphRunner
from mvllm.engine.quant import pack, packable
from mvllm.engine.sampler import sample_rows
from mvllm.engine.scheduler import Batch
from mvllm.engine.sequence import PENDING
from mvllm.kernels import cpu_fused, triton_attention
from mvllm.model.attention import build_meta
from mvllm.model.decoder import Decoder

Fill = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class Launched:
    """A step whose sampled ids are still on their way to the host (overlap): the requests that sample (the
    batch's `sampled`), their ids on the device, the row of each one's id, where in its token_ids each goes, the
    host copy under way, and the requests whose sampling failed (their ids are 0)."""
    batch: Batch
    seqs: list
    ids: torch.Tensor
    rows: dict[str, int]
    index: list[int]
    host: torch.Tensor
    ready: object  # a CUDA event, or None where the copy is already done
    failed: dict[str, Exception] = field(default_factory=dict)

    def tokens(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


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
        self.compiled = compiled and triton_attention.available(device)
        self.captured = graphs and device.type == "cuda"
        self.layout = "fused" if self.fused else "table" if self.compiled else ""
        self.graphs = None
        self.failed: dict[str, Exception] = {}  # the last run's requests whose sampling raised
        if self.captured or self.compiled:
            self.graphs = GraphRunner(model, self.caches, block_size, max_active, max_model_len, scratch,
                                      capture=self.captured, compiled=self.compiled)

    def launch(self, batch: Batch, prev: Launched | None = None) -> Launched:
        """Run the batch's step and start copying its ids to the host without waiting for them (overlap)."""
        ids = self.run(batch, prev)
        if ids.is_cuda:
            host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host.copy_(ids, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = ids, None
        sampled = batch.sampled
        return Launched(batch, sampled, ids, {s.request_id: i for i, s in enumerate(sampled)},
                        [len(s) for s in sampled], host, ready, self.failed)

    @staticmethod
    def kv_bytes_per_token(model_cfg, dtype: torch.dtype) -> int:
        return 2 * model_cfg.num_layers * model_cfg.num_kv_heads * model_cfg.head_dim * dtype.itemsize

    @torch.inference_mode()
    def run(self, batch: Batch, prev: Launched | None = None) -> torch.Tensor:
        """The sampled token ids [len(batch.sampled)] of the batch's step, on the device. A prompt's chunk that is
        not its last computes its KV only. `prev`: the step launched before this one, whose ids have not reached
        the host (overlap): tokens still PENDING are taken from its ids on the device. A request whose sampling
        raised gets id 0 and its exception in `self.failed` (until the next run); a failing forward raises."""
        seqs, spans, sampled = batch.seqs, batch.spans, batch.sampled
        last, n, rows = [], 0, []
        for seq, (a, b) in zip(seqs, spans):
            n += b - a
            last.append(n - 1)
            if b == len(seq):
                rows.append(n - 1)
        fill = None
        if prev is not None:
            late = [(row, prev.rows[s.request_id]) for row, s in zip(last, seqs) if s.token_ids[-1] == PENDING]
            if late:
                dst, src = (torch.tensor(x).to(self.device, non_blocking=True) for x in zip(*late))
                fill = dst, prev.ids[src]
        self.failed = {}
        if not sampled:  # chunks of prompts only, none the last: their KV, no logits
            key = self.graphs.bucket(spans) if self.graphs else None
            if key is None:
                self.forward(seqs, spans, fill, torch.tensor(last[-1:], device=self.device))
            else:
                self.graphs.run(seqs, spans, key, fill)
            return torch.empty(0, dtype=torch.long, device=self.device)
        pick = None if n == len(sampled) else torch.tensor(rows, device=self.device)
        logits, tokens = self.logits(seqs, spans, pick, fill)
        ids, failed = sample_rows(logits, sampled, tokens)
        if failed:
            self.failed = {sampled[i].request_id: e for i, e in failed.items()}
        return ids

    def logits(self, seqs, spans: list[tuple[int, int]], rows: torch.Tensor | None = None,
               fill: Fill | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [T, vocab] of the new tokens (only those at `rows`, if given) by the path a served step
        takes: a CUDA graph (or the compiled step) where one fits, else eagerly. Steps of up to head_rows
        tokens ran the LM head and the argmax in their graph: their logits are in the model's dtype, with the
        argmax; elsewhere the LM head runs here, on those rows only (a prefill's other tokens need none), in
        float32, with an argmax only on the fused CPU path (cpu_fused.argmax). `fill`: (rows, ids) on the
        device, written over the token ids of those rows (the PENDING ones) before the step runs."""
        key = self.graphs.bucket(spans) if self.graphs else None
        if key is None:
            hidden = self.forward(seqs, spans, fill, rows)
            rows = None if self.fused else rows  # the fused path returned those rows only
        else:
            hidden = self.graphs.run(seqs, spans, key, fill)
            if key[0] <= self.graphs.head_rows:
                g, n = self.graphs, len(hidden)
                return (g.logits[:n], g.tokens[:n]) if rows is None else (g.logits[rows], g.tokens[rows])
        logits = self.model.logits(hidden if rows is None else hidden[rows])
        return logits, (cpu_fused.argmax(logits) if self.fused else None)  # torch's CPU argmax is scalar code

    def forward(self, seqs, spans: list[tuple[int, int]], fill: Fill | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states of the new tokens; on the fused CPU path only those at `rows`, if given (the last
        layer computes only them past its KV-cache write)."""
        ids = [t for s, (a, b) in zip(seqs, spans) for t in s.token_ids[a:b]]
        positions = [p for a, b in spans for p in range(a, b)]
        meta = build_meta(spans, [s.block_table for s in seqs], self.block_size, self.device, self.layout)
        if self.fused:
            meta.out_rows = rows
        as_long = dict(dtype=torch.long, device=self.device)
        ids = torch.tensor(ids, **as_long)
        if fill is not None:
            ids.index_copy_(0, *fill)
        return self.model(ids, torch.tensor(positions, **as_long), self.caches, meta)
