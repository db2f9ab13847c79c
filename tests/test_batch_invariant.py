"""Batch invariance of the CPU's int8w path (issue 27, part 2): with batch_invariant=on, a row's result does not
depend on the rows beside it, so a request's greedy tokens are the tokens it gets alone (tests/soak.py checks
them under load). The int8 kernel sums each output in an order set by the input size only."""

from __future__ import annotations

import pytest
import torch

from mvllm.backends.spec import parse_backends
from mvllm.engine import quant
from mvllm.engine.engine import Engine, EngineConfig
from mvllm.engine.quant import Int8Linear
from mvllm.errors import InvalidRequestError
from mvllm.kernels import cpu_int8
from mvllm.model.attention import build_meta

pytestmark = pytest.mark.skipif(not cpu_int8.available(), reason="the int8 kernel did not build here")
SLICES = [(0, 1), (3, 4), (5, 9), (0, 8), (7, 30), (13, 41), (2, 5), (0, 41)]


@pytest.mark.parametrize("out,inputs,group", [(37, 64, 32), (130, 896, 32), (9, 4864, 32), (20, 96, 24)])
def test_kernel_rows_do_not_depend_on_their_batch(out, inputs, group):
    torch.manual_seed(out)
    q, scales = cpu_int8.quantize_weight(torch.randn(out, inputs) * 0.05, group)
    x = torch.randn(41, inputs)
    full = cpu_int8.int8_linear(x, q, scales)
    for a, b in SLICES:
        assert torch.equal(cpu_int8.int8_linear(x[a:b], q, scales), full[a:b]), (a, b)
    threads = torch.get_num_threads()
    try:  # the threads split the outputs, never one output's sum
        torch.set_num_threads(1)
        assert torch.equal(cpu_int8.int8_linear(x, q, scales), full)
    finally:
        torch.set_num_threads(threads)


def hidden_rows(engine: Engine, batch: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """One forward of several sequences (token ids, tokens already in their cache), through the fused CPU path
    the engine runs; each sequence's output rows. Sequence i owns blocks [8i, 8i + 8) of a fresh cache."""
    runner, bs = engine.runner, engine.config.block_size
    ids = [t for seq, start in batch for t in seq[start:]]
    positions = [p for seq, start in batch for p in range(start, len(seq))]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(batch))]
    meta = build_meta([(start, len(seq)) for seq, start in batch], tables, bs, torch.device("cpu"), runner.layout)
    as_long = dict(dtype=torch.long)
    with torch.inference_mode():
        out = engine.model(torch.tensor(ids, **as_long), torch.tensor(positions, **as_long), runner.caches, meta)
    rows, at = [], 0
    for seq, start in batch:
        rows.append(out[at:at + len(seq) - start].clone())
        at += len(seq) - start
    return rows


@pytest.mark.parametrize("invariant", [True, False])
def test_a_decode_row_beside_a_prefill_gets_what_it_gets_alone(invariant):
    engine = Engine(EngineConfig(model="synthetic:tiny-qwen2", quant="int8w", batch_invariant=invariant,
                                 threads=1, num_blocks=64))
    assert engine.runner.layout == "fused"
    a = [(5 * k) % 400 + 1 for k in range(13)]
    b = [(3 * k) % 400 + 2 for k in range(40)]
    hidden_rows(engine, [(a[:12], 0)])  # A's first 12 tokens into its cache
    alone = hidden_rows(engine, [(a, 12)])[0]  # A decodes its 13th token alone: one row
    beside = hidden_rows(engine, [(a, 12), (b, 0)])[0]  # the same, beside B's 40-token prefill
    kernel_rows = min(m.kernel_rows for m in engine.model.modules() if isinstance(m, Int8Linear))
    if kernel_rows >= 41:  # the 41-row step takes the kernel: invariant, or lanes8 with AMX or no native bf16
        assert torch.equal(alone, beside)
    else:  # off: the 41-row step runs the GEMM (what the test would catch)
        assert not torch.equal(alone, beside)
    lanes8_every_row = cpu_int8.layout() == "lanes8" and quant.lanes8_every_row()
    assert (kernel_rows >= 41) == (invariant or lanes8_every_row)


def test_a_prefill_does_not_depend_on_its_batch():
    engine = Engine(EngineConfig(model="synthetic:tiny-qwen2", quant="int8w", batch_invariant=True,
                                 threads=1, num_blocks=64))
    a = [(7 * k) % 400 + 1 for k in range(21)]
    others = [[(k * k) % 400 + 1 for k in range(n)] for n in (5, 40)]
    alone = hidden_rows(engine, [(a, 0)])[0]
    assert torch.equal(hidden_rows(engine, [(others[0], 0), (a, 0), (others[1], 0)])[1], alone)


def test_the_setting_is_parsed_and_checked():
    spec = parse_backends("cpu=cpu/quant=int8w/batch_invariant=on")[0]
    assert spec.batch_invariant is True and spec.engine_config("m").batch_invariant is True
    with pytest.raises(InvalidRequestError, match="bad value 'yes' for batch_invariant"):
        parse_backends("cpu=cpu/batch_invariant=yes")
    with pytest.raises(InvalidRequestError, match="batch_invariant=on is a setting of quant=int8w"):
        Engine(EngineConfig(model="synthetic:tiny-qwen2", dtype="float32", batch_invariant=True))


@pytest.mark.parametrize("loop", ["c++", "python"])
def test_out_rows_skip_the_last_layer_for_the_other_rows(monkeypatch, loop):
    """The fused path with meta.out_rows (the rows the LM head reads: each prefill's last) returns those rows only;
    its last layer computes only them past the KV-cache write, and they are the full forward's rows, bit for bit
    (batch-invariant linears; one thread keeps each token's keys whole in attention; a prefill's newest row takes
    the same attention path alone as beside its other rows), in the C++ layer loop and in Python's."""
    from mvllm.kernels import cpu_layers

    monkeypatch.setattr(cpu_layers, "ENABLED", loop == "c++")
    engine = Engine(EngineConfig(model="synthetic:tiny-qwen2", quant="int8w", batch_invariant=True, threads=1,
                                 num_blocks=64))
    assert engine.model.cpu_layers.serves(53) == (loop == "c++" and cpu_layers.available())
    a = [(5 * k) % 400 + 1 for k in range(13)]
    b = [(3 * k) % 400 + 2 for k in range(40)]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(2)]
    meta = build_meta([(0, 13), (0, 40)], tables, engine.config.block_size, torch.device("cpu"), "fused")
    ids, positions = torch.tensor(a + b), torch.tensor(list(range(13)) + list(range(40)))
    with torch.inference_mode():
        full = engine.model(ids, positions, engine.runner.caches, meta).clone()
        meta.out_rows = torch.tensor([12, 52])
        some = engine.model(ids, positions, engine.runner.caches, meta)
    assert some.shape == (2, full.shape[1])
    assert torch.equal(some, full[[12, 52]])
