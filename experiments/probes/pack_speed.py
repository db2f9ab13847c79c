"""The host's packing of a GPU step's input (GraphRunner.pack) against the way it was done before (numpy slices
for every sequence, up to 8f62774), on this machine, in the same run. A decode row costs the host a few
microseconds per numpy call, and in the default loop the GPU waits for it.
    python3 experiments/probes/pack_speed.py
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np

from mvllm.engine.cuda_graphs import GraphRunner, block_tables, fill_span
from mvllm.kernels.triton_attention import work_list

BLOCK, SCRATCH = 16, 99_999


def numpy_slices(seqs, spans, t_pad: int) -> np.ndarray:
    """The earlier pack: numpy slices for every sequence, one new token or many."""
    buf = np.zeros((t_pad, 6), dtype=np.int64)
    buf[:, 2], buf[:, 3], buf[:, 5] = SCRATCH, 1, -1
    row = 0
    for i, (seq, (a, b)) in enumerate(zip(seqs, spans)):
        fill_span(buf, row, seq, a, b, i, BLOCK)
        row += b - a
    tiles, per_token = work_list([b - a for a, b in spans], t_pad)
    buf[:len(tiles), 5] = tiles
    buf[t_pad - len(per_token):, 5] = per_token
    return buf


def batch(rng: random.Random, spans: list[tuple[int, int]]):
    seqs = [SimpleNamespace(token_ids=[rng.randrange(150_000) for _ in range(b)],
                            block_table=rng.sample(range(5_000), -(-b // BLOCK))) for _, b in spans]
    return seqs, spans


def best_us(fn, *args, repeats: int = 300) -> float:
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeats):
            fn(*args)
        times.append((time.perf_counter() - t) / repeats * 1e6)
    return min(times)


def main() -> None:
    rng = random.Random(0)
    runner = SimpleNamespace(block_size=BLOCK, scratch=SCRATCH)
    cases = {"decode, batch 1": ([(580, 581)], 2), "decode, batch 4": ([(580, 581)] * 4, 4),
             "decode, batch 16": ([(580, 581)] * 16, 16), "warm prefill, 20 new": ([(496, 516)], 32),
             "15 decoding + 20 new": ([(580, 581)] * 15 + [(496, 516)], 64), "cold prefill, 516": ([(0, 516)], 640)}
    for name, (spans, t_pad) in cases.items():
        seqs, spans = batch(rng, spans)
        assert np.array_equal(GraphRunner.pack(runner, seqs, spans, t_pad), numpy_slices(seqs, spans, t_pad)), name
        old = best_us(numpy_slices, seqs, spans, t_pad)
        new = best_us(GraphRunner.pack, runner, seqs, spans, t_pad)
        print(f"{name:22s} numpy slices {old:7.1f} µs   pack {new:7.1f} µs   {old / new:5.2f}x", flush=True)
    # a long prompt beside long decodes: the step's input with each sequence's table once, against a table per token
    rng = random.Random(0)
    lens = [21_793] + [rng.randrange(2_000, 30_000) for _ in range(8)]
    seqs, spans = batch(rng, [(0, lens[0])] + [(n - 1, n) for n in lens[1:]])
    t_pad, width = sum(b - a for a, b in spans), max(len(s.block_table) for s in seqs)
    took = best_us(lambda: (GraphRunner.pack(runner, seqs, spans, t_pad), block_tables(seqs, width)), repeats=3)
    rows, tables = GraphRunner.pack(runner, seqs, spans, t_pad), block_tables(seqs, width)
    print(f"21,793-token prompt + 8 decodes (width {width}): {(rows.nbytes + tables.nbytes) / 1e6:.2f} MB in "
          f"{took / 1e3:.1f} ms; a table per token would be {t_pad * (4 + width) * 8 / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
