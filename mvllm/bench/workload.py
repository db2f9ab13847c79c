"""The workload of an experiment: every kind built (bench/generators.py, bench/traces.py), and what it selected.

The request itself and what the kinds share live in bench/request.py (re-exported here for the callers)."""

from __future__ import annotations

from mvllm.bench import generators, traces
from mvllm.bench.experiment import ExperimentError, Workload
from mvllm.bench.idprompt import IdPrompt
from mvllm.bench.request import (  # noqa: F401
    Built,
    Request,
    arrivals,
    context_of,
    fit,
    full_prompt,
    reply_tokens,
    token_range,
    vocab_of,
)


def build(w: Workload, vocab: int, model: str | None = None) -> tuple[list[int], list[Request]]:
    """(prefix to warm, requests), for callers that need no selection report."""
    b = build_all(w, vocab, model)
    return b.prefix, b.requests


def build_all(w: Workload, vocab: int, model: str | None = None, tokens: bool = True) -> Built:
    """The workload of `w`'s kind. `model` gives the context that prompts must fit (and custom's tokenizer).
    `tokens` False (the simulator's): a trace's prompts may be left as their hash ids (bench/idprompt.py)."""
    if w.kind == "trace":
        built = traces.mooncake(w, vocab, model, tokens)
    else:
        make = {"prefix": generators.prefix, "random": generators.random_lengths,
                "shared-prefix": generators.shared_prefix, "custom": traces.custom}[w.kind]
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
    nodes: dict[int, int] = {}  # a trace's prompts left as hash ids count by their trie's nodes
    reused = total = 0
    full: dict[int, list[int]] = {}
    ids = {r.id: r for r in reqs}
    for r in sorted(reqs, key=lambda r: r.id):  # a parent's id is below its turns'
        p = r.parent
        prompt = full[r.id] = full_prompt(r, full.get(p), None if p is None else
                                          reply_tokens(p, ids[p].output_tokens, vocab))
        total += len(prompt)
        if isinstance(prompt, IdPrompt):
            reused += prompt.seen(nodes) * BLOCK_SIZE
            continue
        hashes = list(block_hashes(prompt))
        if p is None:  # the simulator's memo (a follow-up turn's it makes itself, over its stand-in reply)
            r.hashes = hashes
        for h in hashes:
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
