"""The CPU kernels' attention metadata (model/attention.py, layout "fused") against a reading of its definition."""

from __future__ import annotations

import random

import pytest
import torch

from mvllm.model.attention import build_meta


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_fused_metadata_is_each_tokens_slot_sequence_and_key_count(block_size):
    rng = random.Random(block_size)
    for _ in range(50):
        spans, tables = [], []
        for _ in range(rng.randint(1, 5)):
            end = rng.randint(1, 90)
            start = rng.choice([0, end - 1, rng.randint(0, end - 1)])  # cold, decode, warm
            spans.append((start, end))
            tables.append(rng.sample(range(400), -(-end // block_size) + rng.randint(0, 2)))
        meta = build_meta(spans, tables, block_size, torch.device("cpu"), "fused")
        slots = [tables[b][p // block_size] * block_size + p % block_size for b, (s, e) in enumerate(spans)
                 for p in range(s, e)]
        assert meta.layout == "fused" and meta.block_size == block_size
        assert meta.slot_mapping.tolist() == slots
        assert meta.token_seq.tolist() == [b for b, (s, e) in enumerate(spans) for _ in range(s, e)]
        assert meta.key_len.tolist() == [p + 1 for s, e in spans for p in range(s, e)]
        width = max(map(len, tables))
        assert meta.block_index.tolist() == [t + [0] * (width - len(t)) for t in tables]
        for t in (meta.slot_mapping, meta.token_seq, meta.key_len, meta.block_index):  # what the kernels take
            assert t.dtype == torch.long and t.is_contiguous()
