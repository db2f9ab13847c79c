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

from mvllm.engine.cuda_graphs import GraphRunner, fill_span

BLOCK, SCRATCH = 16, 99_999


def numpy_slices(seqs, spans, t_pad: int, width: int) -> np.ndarray:
    """The earlier pack: numpy slices for every sequence, one new token or many."""
    buf = np.zeros((t_pad, 4 + width), dtype=np.int64)
    buf[:, 2], buf[:, 3] = SCRATCH, 1
    row = 0
    for seq, (a, b) in zip(seqs, spans):
        fill_span(buf, row, seq, a, b, width, BLOCK)
        row += b - a
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
        width = max(len(s.block_table) for s in seqs)
        assert np.array_equal(GraphRunner.pack(runner, seqs, spans, t_pad, width),
                              numpy_slices(seqs, spans, t_pad, width)), name
        old = best_us(numpy_slices, seqs, spans, t_pad, width)
        new = best_us(GraphRunner.pack, runner, seqs, spans, t_pad, width)
        print(f"{name:22s} numpy slices {old:7.1f} µs   pack {new:7.1f} µs   {old / new:5.2f}x", flush=True)
    # a long prompt beside long decodes: every token's row carries the widest block table of the step
    rng = random.Random(0)
    lens = [21_793] + [rng.randrange(2_000, 30_000) for _ in range(8)]
    seqs, spans = batch(rng, [(0, lens[0])] + [(n - 1, n) for n in lens[1:]])
    t_pad, width = sum(b - a for a, b in spans), max(len(s.block_table) for s in seqs)
    took = best_us(GraphRunner.pack, runner, seqs, spans, t_pad, width, repeats=3)
    size = GraphRunner.pack(runner, seqs, spans, t_pad, width).nbytes
    print(f"21,793-token prompt + 8 decodes (width {width}): {size / 1e6:.0f} MB in {took / 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
