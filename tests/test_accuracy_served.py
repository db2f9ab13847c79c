"""Accuracy through the served path on real weights (SmolLM2-135M): apart from tests/test_accuracy.py, whose
passes take as long, so that `make test`'s two workers run both at once."""

from __future__ import annotations

import torch

from mvllm.engine.engine import Engine, EngineConfig
from mvllm.profile import accuracy
from mvllm.profile.accuracy import logits, served_logits

CPU = torch.device("cpu")


def test_served_path_matches_the_model_path(reference, monkeypatch):
    """The served pass runs the engine's ModelRunner (its dispatch to graphs, compiled or fused steps); on this
    CPU it must give the logits of the same kernels called directly, and fall back where the cache is small.
    The measures' decode pass goes 16 tokens a step (the profile's 4 took 18 s a measure here): which path runs
    is the question, test_accuracy.py holds each mode's accuracy at 4."""
    monkeypatch.setattr(accuracy, "DECODE_CHUNK", 16)
    engine = Engine(EngineConfig(model="smollm2-135m", device="cpu", dtype="float32", num_blocks=48))
    ids = reference.ids[:200]
    for chunk in (None, 4):
        served = served_logits(engine.runner, ids, chunk)
        direct = logits(engine.model, ids, CPU, torch.float32, chunk, layout=engine.runner.layout)
        assert torch.allclose(served, direct, atol=1e-4), (served - direct).abs().max()
    assert reference.measure(engine.model, CPU, torch.float32, runner=engine.runner)["path"] == "served"
    small = Engine(EngineConfig(model="smollm2-135m", device="cpu", dtype="float32", num_blocks=8))
    got = reference.measure(small.model, CPU, torch.float32, small.runner.layout, small.runner)
    assert got["path"] == "model" and got["within_bound"]
