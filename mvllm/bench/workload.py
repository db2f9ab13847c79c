"""Requests to replay: a seeded shared prefix plus a unique suffix each, and their arrival times."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from mvllm.bench.experiment import Workload


@dataclass(slots=True)
class Request:
    id: int
    prompt: list[int]
    output_tokens: int
    arrival: float


def arrivals(w: Workload) -> list[float]:
    """Send times in seconds from the start; the first request goes at 0 (as in vLLM's bench).
    fixed: every `interval`; poisson: exponential gaps at `rate`; gamma: gaps of shape `burstiness`
    and mean 1/rate (burstiness 1 is Poisson, below 1 burstier, above 1 more regular).
    `requests` of them, or with `duration` set, every one that falls inside that many seconds."""
    rng = random.Random(f"arrivals-{w.seed}")
    times, t = [], 0.0
    while (len(times) < w.requests) if w.duration is None else (t < w.duration):
        times.append(t)
        if w.arrival == "fixed":
            t = len(times) * w.interval
        else:
            shape = 1.0 if w.arrival == "poisson" else w.burstiness
            t += rng.gammavariate(shape, 1.0 / (w.request_rate * shape))
    return times


def token_range(vocab: int) -> tuple[int, int]:
    """Stay clear of the ids tokenizers tend to reserve at both ends (and synthetic models' EOS)."""
    return vocab // 32, int(vocab * 0.9)


def vocab_of(model: str, w: Workload) -> int:
    """The vocabulary to draw token ids from, without loading weights: the workload's `vocab`, else
    the model's config, else 32000."""
    if w.vocab is not None:
        return w.vocab
    from mvllm.model.loader import DEFAULT_MODEL
    from mvllm.model.presets import PRESETS

    if model.startswith("synthetic:") and model[10:] in PRESETS:
        return PRESETS[model[10:]]["vocab_size"]
    if model == DEFAULT_MODEL:
        return PRESETS["smollm2-135m"]["vocab_size"]
    config = Path(model).expanduser() / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        return int(data.get("vocab_size") or data.get("text_config", {}).get("vocab_size", 32000))
    return 32000


def build(w: Workload, vocab: int) -> tuple[list[int], list[Request]]:
    """(shared prefix, requests). Prompts depend only on the seed and the lengths, not on arrivals."""
    lo, hi = token_range(vocab)
    rng = random.Random(f"prompts-{w.seed}")
    prefix = [rng.randrange(lo, hi) for _ in range(w.prefix_tokens)]
    times = arrivals(w)
    reqs = []
    for i in range(len(times)):
        suffix = [rng.randrange(lo, hi) for _ in range(w.suffix_tokens)]
        reqs.append(Request(i, prefix + suffix, w.output_tokens, times[i]))
    return prefix, reqs
