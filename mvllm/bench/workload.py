"""Requests to replay and their send times, for every workload kind (bench/generators.py, bench/traces.py).

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

from mvllm.bench.experiment import ExperimentError, Workload


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


def build(w: Workload, vocab: int, model: str | None = None) -> tuple[list[int], list[Request]]:
    """(prefix to warm, requests), for callers that need no selection report."""
    b = build_all(w, vocab, model)
    return b.prefix, b.requests


def build_all(w: Workload, vocab: int, model: str | None = None) -> Built:
    """The workload of `w`'s kind. `model` gives the context that prompts must fit (and custom's tokenizer)."""
    from mvllm.bench import generators, traces

    make = {"prefix": generators.prefix, "random": generators.random_lengths,
            "shared-prefix": generators.shared_prefix, "trace": traces.mooncake, "custom": traces.custom}[w.kind]
    built = make(w, vocab, model)
    clipped = 0
    for r in built.requests:
        r.max_tokens = w.max_tokens if w.hidden else -1
        if w.hidden and w.max_tokens is not None and r.output_tokens > w.max_tokens:
            r.output_tokens, clipped = w.max_tokens, clipped + 1
    if not built.requests:
        raise ExperimentError(f"workload kind {w.kind!r}: the selection holds no request "
                              f"({built.selection.get('dropped', {}) or 'check start, duration and max_requests'})")
    built.selection = describe(built, vocab, w) | built.selection
    if clipped:
        built.selection["outputs_cut_to_cap"] = clipped
    return built


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


def quantiles(values: list[float]) -> dict:
    from mvllm.bench.metrics import percentile

    if not values:
        return {}
    return {"min": min(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values), "mean": sum(values) / len(values)}


def describe(built: Built, vocab: int, w: Workload) -> dict:
    """Requests, span, rate, prompt and output length quantiles, and the share of prompt tokens an unbounded
    prefix cache (the engine's 16-token blocks, in send order) would reuse."""
    from mvllm.engine.block_manager import BLOCK_SIZE, block_hashes

    reqs = built.requests
    firsts = [r.arrival for r in reqs if r.parent is None]
    span = max(firsts) - min(firsts) if firsts else 0.0
    seen: set[int] = set()
    reused = total = 0
    full: dict[int, list[int]] = {}
    ids = {r.id: r for r in reqs}
    for r in sorted(reqs, key=lambda r: r.id):  # a parent's id is below its turns'
        p = r.parent
        prompt = full[r.id] = full_prompt(r, full.get(p), None if p is None else
                                          reply_tokens(p, ids[p].output_tokens, vocab))
        total += len(prompt)
        for h in block_hashes(prompt):
            if h in seen:
                reused += BLOCK_SIZE
            seen.add(h)
    return {"kind": w.kind, "lengths": w.lengths, "max_tokens": w.max_tokens, "requests": len(reqs),
            "first_turns": len(firsts), "span_s": span, "rate_per_s": (len(firsts) - 1) / span if span > 0 else None,
            "prompt_tokens": quantiles([len(p) for p in full.values()]),
            "output_tokens": quantiles([r.output_tokens for r in reqs]),
            "reusable_prompt_share": reused / total if total else 0.0}


def selection_line(sel: dict) -> str:
    """One line for the console: what a workload selected."""
    p, o = sel.get("prompt_tokens", {}), sel.get("output_tokens", {})
    rate = f" ({sel['rate_per_s']:.2f}/s)" if sel.get("rate_per_s") else ""
    turns = f", {sel['requests'] - sel['first_turns']} follow-up turns" if sel["requests"] > sel["first_turns"] else ""
    cap = "told" if sel["lengths"] == "told" else f"hidden, cap {sel['max_tokens'] or 'none'}"
    line = (f"workload {sel['kind']}: {sel['first_turns']:,} requests over {sel['span_s']:.1f} s{rate}{turns}; "
            f"prompts p50 {p.get('p50', 0):,.0f} p99 {p.get('p99', 0):,.0f} max {p.get('max', 0):,.0f}; "
            f"outputs p50 {o.get('p50', 0):,.0f} p99 {o.get('p99', 0):,.0f} ({cap}); "
            f"{100 * sel['reusable_prompt_share']:.1f}% of prompt tokens reusable")
    dropped = {k: v for k, v in (sel.get("dropped") or {}).items() if v}
    if dropped:
        line += "; " + ", ".join(f"{v:,} {k.replace('_', ' ')}" for k, v in dropped.items())
    if sel.get("outputs_cut_to_cap"):
        line += f"; {sel['outputs_cut_to_cap']:,} outputs cut to the cap"
    return line
