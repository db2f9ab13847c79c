"""A replayed request and what every workload kind shares: send times, token ranges, the stand-in replies of
multi-turn conversations, the model's vocabulary and context, and whether a prompt fits (bench/workload.py
builds the kinds).

A request carries what a real client sends (its prompt and, with lengths told, max_tokens = its length; with
lengths hidden, the experiment's cap or none) and, apart, its true length: where it ends. A follow-up turn
(`parent` set) is sent `arrival` seconds after its parent's reply ends; its prompt is the parent's whole prompt,
the parent's reply and its own new tokens (`full_prompt`).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from mvllm.bench.experiment import Workload


@dataclass(slots=True)
class Request:
    id: int
    prompt: list[int]  # a follow-up turn: its own new tokens only
    output_tokens: int  # the true length: the request ends after this many tokens
    arrival: float  # seconds from the start; a follow-up turn: think time after its parent's reply
    max_tokens: int | None = -1  # what the client sends: -1 means told (= output_tokens), None no cap
    parent: int | None = None
    hashes: list = field(default_factory=list, repr=False)  # the simulator's memo of its block hashes

    @property
    def cap(self) -> int | None:
        """The max_tokens the client sends: the true length where lengths are told."""
        return self.output_tokens if self.max_tokens == -1 else self.max_tokens

    @property
    def told(self) -> bool:
        return self.max_tokens == -1


@dataclass(slots=True)
class Built:
    """A built workload: the prefix to warm (may be empty), the requests in send order, and what was
    selected and dropped (saved as workload.json, printed by bench and simulate)."""

    prefix: list[int]
    requests: list[Request]
    selection: dict = field(default_factory=dict)


def arrivals(w: Workload, count: int | None = None) -> list[float]:
    """Send times in seconds from the start; the first request goes at 0 (as in vLLM's bench).
    fixed: every `interval`; poisson: exponential gaps at `rate`; gamma: gaps of shape `burstiness`
    and mean 1/rate (burstiness 1 is Poisson, below 1 burstier, above 1 more regular).
    `count` (default `requests`) of them, or with `duration` set, every one that falls inside that many seconds."""
    rng = random.Random(f"arrivals-{w.seed}")
    times, t = [], 0.0
    while (len(times) < (count or w.requests)) if count is not None or w.duration is None else t < w.duration:
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


def reply_tokens(request_id: int, n: int, vocab: int) -> list[int]:
    """The stand-in for a reply the client did not receive as token ids (and the simulator's): fixed per request."""
    lo, hi = token_range(vocab)
    rng = random.Random(f"reply-{request_id}")
    return [rng.randrange(lo, hi) for _ in range(n)]


def full_prompt(req: Request, parent_prompt: list[int] | None, parent_reply: list[int] | None) -> list[int]:
    """The tokens a turn sends: its own, after its parent's whole prompt and reply (a first turn: its own)."""
    if req.parent is None:
        return req.prompt
    return list(parent_prompt) + list(parent_reply) + req.prompt


def _config(model: str) -> dict:
    from mvllm.model.presets import DEFAULT_MODEL, PRESETS

    if model.startswith("synthetic:") and model[10:] in PRESETS:
        return PRESETS[model[10:]]
    if model == DEFAULT_MODEL:
        return PRESETS["smollm2-135m"]
    config = Path(model).expanduser() / "config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        return data.get("text_config", data) if "vocab_size" not in data else data
    return {}


def vocab_of(model: str, w: Workload) -> int:
    """The vocabulary to draw token ids from, without loading weights: the workload's `vocab`, else
    the model's config, else 32000."""
    if w.vocab is not None:
        return w.vocab
    return int(_config(model).get("vocab_size") or 32000)


def context_of(model: str) -> int | None:
    """The model's context (max_position_embeddings) from its config, without loading weights; None unknown."""
    n = _config(model).get("max_position_embeddings")
    return int(n) if n else None


def fit(prompt_len: int, output_len: int, w: Workload, context: int | None) -> int | None:
    """The prompt length a request keeps (its own, or clipped), or None to drop it: the prompt stays within
    `max_prompt_tokens`, and the prompt and what the client may ask for (the cap, else its length) within the
    model's context."""
    limit = w.max_prompt_tokens or math.inf
    if context is not None:
        asked = w.max_tokens if (w.hidden and w.max_tokens is not None) else output_len
        limit = min(limit, context - asked)
    if prompt_len <= limit:
        return prompt_len
    if w.over == "clip" and limit >= 1:
        return int(limit)
    return None
