"""CUDA graphs for GPU steps: decode batches of up to max_active, warm-prefix prefills and mixed steps of up to 64
new tokens, and (compiled) cold prefills of up to 2048.

Every new token is one query row that reads its own sequence's blocks, so a step is keyed by its token
count T, padded up to a bucket (token_buckets: a ladder, so a large max_active adds a few graphs, not one per
size). Steps of up to max(64, max_active) tokens run the LM head and the greedy argmax in their graph too, so
a greedy decode step is one replay and one copy of the token ids back. Inputs live in two static int64
buffers, filled by a host-to-device copy each per step: the tokens' [T, 6] (token, position, slot, context
length, its sequence's row of the tables, and the attention's work list: the tiled kernel's tiles, the rows
left to the per-token kernel) and the sequences' block tables [max_active, W]. Padding rows
write their K/V to a scratch slot and attend to one key; their outputs are ignored.

Two ways to run a step:
- compiled (the default where Triton exists): rotary with the cache write, and attention reading K/V
  through the block table, are Triton kernels that take the packed input whole (kernels/triton_attention.py);
  torch.compile fuses the rest of each layer (norms, SiLU) before the graphs are captured. One compile with a
  dynamic token count serves every bucket, including prefill buckets (a cold prefill is launch-bound without
  a graph: ~12 ms of host work against ~2.4 ms of GPU work for 516 tokens of Qwen2.5-0.5B on the H200);
  steps beyond them run the same code ungraphed.
- plain (`compile=off`): eager PyTorch ops; each row gathers its context padded to a context bucket, so a
  step is keyed by (T, context bucket), and steps beyond the buckets run the model's own layouts.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from mvllm.engine.sequence import Sequence
from mvllm.kernels import triton_attention
from mvllm.kernels.triton_ops import argmax, fold_norms
from mvllm.model.attention import AttnMeta
from mvllm.model.decoder import Decoder

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
HEAD_ROWS = 64  # steps up to this many tokens (or max_active, if more) run the LM head (and argmax) in their graph
PREFILL_BUCKETS = (128, 256, 384, 512, 640, 768, 1024, 1536, 2048)  # compiled only
CONTEXT_BUCKETS = (256, 512, 768, 1024, 1536, 2048, 3072, 4096)  # plain: every row gathers its bucket's width


def use_compile_cache() -> None:
    """Keep inductor's and Triton's caches under MVLLM_CACHE, so a second start skips code generation."""
    from mvllm.machine import cache_dir

    root = cache_dir()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))


def token_buckets(max_active: int, first: int = 1) -> list[int]:
    """TOKEN_BUCKETS from `first` up to max(HEAD_ROWS, max_active), and max_active itself."""
    top = max(HEAD_ROWS, max_active)
    return sorted({t for t in TOKEN_BUCKETS if first <= t <= top} | {max(max_active, first)})


def fill_span(buf: np.ndarray, row: int, seq: Sequence, a: int, b: int, seq_row: int, block_size: int) -> None:
    """Rows row.. of the step's input for tokens a..b of seq (the tables' row seq_row), with numpy slices."""
    n, pos = b - a, np.arange(a, b)
    table = np.asarray(seq.block_table, dtype=np.int64)
    buf[row:row + n, 0] = seq.token_ids[a:b]
    buf[row:row + n, 1] = pos
    buf[row:row + n, 2] = table[pos // block_size] * block_size + pos % block_size
    buf[row:row + n, 3] = pos + 1
    buf[row:row + n, 4] = seq_row


def block_tables(seqs: list[Sequence], width: int, rows: int = 2) -> np.ndarray:
    """The sequences' block tables [max(rows, sequences), width], zero-padded (at least two rows and columns: a
    dynamic size of 1 would make torch.compile specialize)."""
    out = np.zeros((max(rows, len(seqs)), width), dtype=np.int64)
    for i, seq in enumerate(seqs):
        table = seq.block_table[:width]
        out[i, :len(table)] = table
    return out


class GraphRunner:
    def __init__(self, model: Decoder, caches: list[torch.Tensor], block_size: int, max_active: int,
                 max_model_len: int, scratch_slot: int, capture: bool = True, compiled: bool = False):
        self.model, self.caches, self.block_size, self.scratch = model, caches, block_size, scratch_slot
        self.compiled = compiled
        first = 2 if compiled else 1  # compiled: one dynamic token count (sizes of 1 would specialize)
        self.token_buckets = sorted(set(token_buckets(max_active, first)) | set(PREFILL_BUCKETS if compiled else ()))
        self.head_rows = max(HEAD_ROWS, max_active)
        if compiled:
            self.context_buckets = [max_model_len]
        else:
            self.context_buckets = [c for c in CONTEXT_BUCKETS if c < max_model_len]
            self.context_buckets += [c for c in CONTEXT_BUCKETS if c >= max_model_len][:1]
        self.width = max(2, -(-self.context_buckets[-1] // block_size))
        device = caches[0].device
        t_max = self.token_buckets[-1]
        # one static input per token bucket: the compiled step is never handed a view (a view of a larger
        # buffer is guarded on its base's size, and would compile again)
        with torch.inference_mode():  # as the steps' own tensors: one kind of input for the compiled step
            self.inputs = {t: torch.zeros(t, 6, dtype=torch.long, device=device) for t in self.token_buckets}
            self.tables = torch.zeros(max(2, max_active), self.width, dtype=torch.long, device=device)
            self.hidden = torch.zeros(t_max, model.cfg.hidden_size, dtype=caches[0].dtype, device=device)
            # steps of up to head_rows tokens also run the LM head and the argmax inside their graph
            self.logits = torch.zeros(self.head_rows, model.cfg.vocab_size, dtype=caches[0].dtype, device=device)
            self.tokens = torch.zeros(self.head_rows, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.steps = self.replays = 0
        self.step = None
        if compiled:
            fold_norms(model)
            use_compile_cache()
            # one compile for every size: no "duck" equality between sizes that happen to match when it traces
            # (the 2,048-token bucket and a 2,048-block table width would otherwise compile again later)
            torch.fx.experimental._config.use_duck_shape = False
            self.step = torch.compile(self._table_step, dynamic=True, fullgraph=True)
        if capture:
            self.capture()

    def _table_step(self, x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        meta = AttnMeta(x[:, 2], layout="table", block_size=self.block_size, packed=x, tables=tables)
        return self.model(x[:, 0], x[:, 1], self.caches, meta)

    def _forward(self, t: int, lk: int) -> None:
        self._body(t, lk)
        if t <= self.head_rows:
            head, logits = self.model.lm_head, self.logits[:t]
            if type(head) is torch.nn.Linear and head.bias is None:  # straight into the buffer: no copy
                torch.mm(self.hidden[:t], head.weight.t(), out=logits)
            else:
                logits.copy_(head(self.hidden[:t]))
            argmax(logits, self.tokens[:t])

    def _body(self, t: int, lk: int) -> None:
        x = self.inputs[t]
        if self.compiled:
            self.hidden[:t] = self.step(x, self.tables)
            return
        w = -(-lk // self.block_size)
        tables = self.tables[x[:, 4], :w]
        gather = (tables.unsqueeze(-1) * self.block_size + torch.arange(self.block_size, device=x.device))
        gather = gather.view(t, w * self.block_size)[:, :lk]
        mask = (torch.arange(lk, device=x.device) < x[:, 3:4]).view(t, 1, 1, lk)
        meta = AttnMeta(x[:, 2], gather, mask=mask, layout="rows")
        self.hidden[:t] = self.model(x[:, 0], x[:, 1], self.caches, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        for t, x in self.inputs.items():
            x[:, 2], x[:, 3] = self.scratch, 1
            x[:, 5] = torch.tensor(triton_attention.work_column([], t))
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
        if len(spans) > len(self.tables):  # more sequences than the static tables hold: run it eagerly
            return None
        t = sum(b - a for a, b in spans)
        lk = max(b for _, b in spans)
        tb = next((x for x in self.token_buckets if x >= t), None)
        cb = next((x for x in self.context_buckets if x >= lk), None)
        if cb is None or (tb is None and not self.compiled):
            return None
        return (tb, cb) if tb is not None else (max(t, 2), cb)  # compiled: beyond the buckets, ungraphed

    def pack(self, seqs: list[Sequence], spans: list[tuple[int, int]], t_pad: int) -> np.ndarray:
        """The step's token rows [t_pad, 6]: a decode row (one new token) is built as a Python list, as numpy
        costs microseconds per call and a batch of them would pay it several times a row; a longer span is
        filled with numpy slices. Rows past the step's tokens are padding (scratch slot, one key)."""
        bs = self.block_size
        buf = np.zeros((t_pad, 6), dtype=np.int64)
        buf[:, 2], buf[:, 3], buf[:, 5] = self.scratch, 1, -1
        row, singles, at = 0, [], []
        for i, (seq, (a, b)) in enumerate(zip(seqs, spans)):
            n = b - a
            if n == 1:
                table = seq.block_table
                singles.append([seq.token_ids[a], a, table[a // bs] * bs + a % bs, a + 1, i])
                at.append(row)
            else:
                fill_span(buf, row, seq, a, b, i, bs)
            row += n
        if singles:
            buf[at, :5] = singles
        tiles, per_token = triton_attention.work_list([b - a for a, b in spans], t_pad)  # the attention's work
        if tiles:
            buf[:len(tiles), 5] = tiles
        if per_token:
            buf[t_pad - len(per_token):, 5] = per_token
        return buf

    def run(self, seqs: list[Sequence], spans: list[tuple[int, int]], key: tuple[int, int],
            fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Replay the graph for `key` (or run the compiled step without one); returns the hidden states
        [T, hidden] of the real tokens. Steps of up to head_rows tokens also leave every row's logits (in the
        model's dtype) in self.logits and their argmax in self.tokens."""
        t_pad, _ = key
        rows = sum(b - a for a, b in spans)
        self.steps += 1
        used = max(2, max(len(s.block_table) for s in seqs))  # table columns past a row's context are never read
        device = self.hidden.device
        if t_pad > self.token_buckets[-1]:  # compiled, beyond the buckets: no graph, only the columns used
            x = torch.from_numpy(self.pack(seqs, spans, t_pad)).to(device, non_blocking=True)
            tables = torch.from_numpy(block_tables(seqs, used)).to(device, non_blocking=True)
            if fill is not None:
                x[:, 0].index_copy_(0, *fill)
            return self.step(x, tables)[:rows]
        width = min(self.width, used) if self.compiled else self.width  # plain: every column of the table
        # not blocking: the host goes on while an earlier step still runs (a pageable source is staged at once)
        x = self.inputs[t_pad]
        x.copy_(torch.from_numpy(self.pack(seqs, spans, t_pad)), non_blocking=True)
        self.tables[:len(seqs), :width].copy_(torch.from_numpy(block_tables(seqs, width, 0)), non_blocking=True)
        if fill is not None:
            x[:, 0].index_copy_(0, *fill)
        graph = self.graphs.get(key)
        if graph is None:  # not captured (tests on CPU run the same layout eagerly)
            self._forward(*key)
        else:
            graph.replay()
            self.replays += 1
        return self.hidden[:rows]
