"""CUDA graphs for small steps: decode batches, warm-prefix prefills and mixed steps of up to 64 new tokens.

Every new token is one query row ("rows" attention) that reads its own sequence's blocks, so a step is
keyed only by its token count T and its longest context; both are padded up to a bucket. Inputs live
in one static int64 buffer [T, 4 + W] (token, position, slot, context length, block table padded to W
blocks), filled by one host-to-device copy per step. Padding rows write their K/V to a scratch slot and
attend to slot 0 only; their outputs are ignored. Steps beyond the buckets run eagerly.
"""

from __future__ import annotations

import numpy as np
import torch

from mvllm.engine.sequence import Sequence
from mvllm.model.attention import AttnMeta
from mvllm.model.decoder import Decoder

TOKEN_BUCKETS = (8, 16, 32, 64)
CONTEXT_BUCKETS = (256, 512, 768, 1024, 1536, 2048, 3072, 4096)  # every row gathers its bucket's width


class GraphRunner:
    def __init__(self, model: Decoder, caches: list[torch.Tensor], block_size: int, max_active: int,
                 max_model_len: int, scratch_slot: int, capture: bool = True):
        self.model, self.caches, self.block_size, self.scratch = model, caches, block_size, scratch_slot
        self.token_buckets = sorted(set(range(1, max_active + 1)) | set(TOKEN_BUCKETS))
        self.context_buckets = [c for c in CONTEXT_BUCKETS if c < max_model_len]
        self.context_buckets += [c for c in CONTEXT_BUCKETS if c >= max_model_len][:1]
        self.width = -(-self.context_buckets[-1] // block_size)
        device = caches[0].device
        t_max = self.token_buckets[-1]
        self.inputs = torch.zeros(t_max, 4 + self.width, dtype=torch.long, device=device)
        self.hidden = torch.zeros(t_max, model.cfg.hidden_size, dtype=caches[0].dtype, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.steps = self.replays = 0
        if capture:
            self.capture()

    def _forward(self, t: int, lk: int) -> None:
        x = self.inputs[:t]
        w = -(-lk // self.block_size)
        tables = x[:, 4:4 + w]
        gather = (tables.unsqueeze(-1) * self.block_size + torch.arange(self.block_size, device=x.device))
        gather = gather.view(t, w * self.block_size)[:, :lk]
        mask = (torch.arange(lk, device=x.device) < x[:, 3:4]).view(t, 1, 1, lk)
        meta = AttnMeta(x[:, 2], gather, mask=mask, layout="rows")
        self.hidden[:t] = self.model(x[:, 0], x[:, 1], self.caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        self.inputs.zero_()
        self.inputs[:, 2] = self.scratch
        self.inputs[:, 3] = 1
        pool = None
        for lk in reversed(self.context_buckets):
            for t in reversed(self.token_buckets):
                self._forward(t, lk)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool):
                    self._forward(t, lk)
                pool = graph.pool()
                self.graphs[(t, lk)] = graph
        torch.cuda.synchronize()

    def bucket(self, spans: list[tuple[int, int]]) -> tuple[int, int] | None:
        t = sum(b - a for a, b in spans)
        lk = max(b for _, b in spans)
        tb = next((x for x in self.token_buckets if x >= t), None)
        cb = next((x for x in self.context_buckets if x >= lk), None)
        return None if tb is None or cb is None else (tb, cb)

    def run(self, seqs: list[Sequence], spans: list[tuple[int, int]], key: tuple[int, int]) -> torch.Tensor:
        """Replay the graph for `key`; returns the hidden states [T, hidden] of the real tokens."""
        t_pad, _ = key
        bs = self.block_size
        buf = np.zeros((t_pad, 4 + self.width), dtype=np.int64)
        buf[:, 2], buf[:, 3] = self.scratch, 1
        row = 0
        for seq, (a, b) in zip(seqs, spans):
            n = b - a
            pos = np.arange(a, b)
            table = np.asarray(seq.block_table, dtype=np.int64)
            buf[row:row + n, 0] = seq.token_ids[a:b]
            buf[row:row + n, 1] = pos
            buf[row:row + n, 2] = table[pos // bs] * bs + pos % bs
            buf[row:row + n, 3] = pos + 1
            buf[row:row + n, 4:4 + len(table)] = table[:self.width]
            row += n
        self.inputs[:t_pad].copy_(torch.from_numpy(buf))
        graph = self.graphs.get(key)
        self.steps += 1
        if graph is None:  # not captured (tests on CPU run the same layout eagerly)
            self._forward(*key)
        else:
            graph.replay()
            self.replays += 1
        return self.hidden[:row]
