"""Replayed files: Mooncake traces (kind "trace") and your own requests as JSONL (kind "custom").

Mooncake (vLLM bench's timed trace, AIPerf's mooncake_trace, SGLang's mooncake): one JSON object a line,
`timestamp` (ms), `input_length`, `output_length`, `hash_ids` (the prompt's blocks of `block_tokens`, the last
one partial). Every hash id stands for one fixed block of seeded random tokens, the same wherever it appears,
so requests whose ids share a first run share that prefix. `scale` divides every length and the block (scale
16: 512-token blocks become 32), `speedup` the gaps, `start` and `duration` pick a window (seconds of trace,
before the speed-up), `max_requests` the first so many of it.

Custom (vLLM's custom dataset): `prompt` (text, tokenized with the model's tokenizer) or `prompt_tokens` (ids),
`output_tokens`, and optionally `timestamp` (ms; used with arrival = "trace").
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np

from mvllm.bench.experiment import ExperimentError, Workload
from mvllm.bench.idprompt import Trie
from mvllm.bench.request import Built, Request, arrivals, context_of, fit, token_range
from mvllm.engine.block_manager import BLOCK_SIZE


def _lines(path_text: str, kind: str):
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ExperimentError(f"workload kind {kind!r}: key 'workload.path': no file {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield number, json.loads(line)
                    except ValueError as e:
                        raise ExperimentError(f"{path}:{number}: not a JSON object ({e})") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ExperimentError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None


def _int(row: dict, key: str, where: str, least: int = 0) -> int:
    v = row.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < least:
        raise ExperimentError(f"{where}: {key!r} must be an integer of at least {least}, got {v!r}")
    return v


def block_tokens(ids: np.ndarray, size: int, vocab: int, seed: int) -> np.ndarray:
    """The fixed random tokens of each hash id's block: rows of `size`, a counter-based hash of (seed, id,
    position) (splitmix64), so an id's tokens do not depend on which other ids were read."""
    lo, hi = token_range(vocab)
    x = (ids.astype(np.uint64)[:, None] * np.uint64(size) + np.arange(size, dtype=np.uint64)[None, :])
    with np.errstate(over="ignore"):
        x = x + np.uint64((seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) % 2**64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (lo + x % np.uint64(hi - lo)).astype(np.int64)


def mooncake(w: Workload, vocab: int, model: str | None = None, tokens: bool = True) -> Built:
    """`tokens` False: prompts left as their hash ids (bench/idprompt.py) where each block holds whole engine
    blocks (the simulator's prefix cache is keyed on them); else made."""
    block = max(1, round(w.block_tokens / w.scale))
    end = w.start + w.duration if w.duration is not None else math.inf
    rows, dropped, clipped, path = [], 0, 0, Path(w.path)
    context = context_of(model) if model else None
    first_ts = None
    for number, row in _lines(w.path, "trace"):
        where = f"{path}:{number}"
        if not isinstance(row, dict):
            raise ExperimentError(f"{where}: not a JSON object")
        ts, n_in, n_out = (_int(row, "timestamp", where), _int(row, "input_length", where, 1),
                           _int(row, "output_length", where, 1))
        ids = row.get("hash_ids")
        if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise ExperimentError(f"{where}: 'hash_ids' must be a list of integers")
        if len(ids) != -(-n_in // w.block_tokens):
            raise ExperimentError(f"{where}: {len(ids)} hash_ids for input_length {n_in}; the rule is "
                                  f"len(hash_ids) == ceil(input_length / block_tokens) = {-(-n_in // w.block_tokens)}"
                                  f" (block_tokens {w.block_tokens})")
        first_ts = ts if first_ts is None else first_ts
        t = (ts - first_ts) / 1000.0
        if t < w.start:
            continue
        if t >= end or (w.max_requests is not None and len(rows) >= w.max_requests):
            break
        n_in, n_out = max(1, math.ceil(n_in / w.scale)), max(1, round(n_out / w.scale))
        keep = fit(n_in, n_out, w, context)
        if keep is None:
            dropped += 1
            continue
        clipped += keep < n_in
        rows.append(((t - w.start) / w.speedup, keep, n_out, ids[:-(-keep // block)]))
    times = [r[0] for r in rows] if w.arrival == "trace" else arrivals(w, len(rows))
    if not tokens and block % BLOCK_SIZE == 0:
        trie = Trie(block)
        prompts = [trie.prompt(ids, n_in) for _, n_in, _, ids in rows]
    else:
        unique = np.array(sorted({h for r in rows for h in r[3]}), dtype=np.int64)
        table = block_tokens(unique, block, vocab, w.seed) if len(unique) else np.zeros((0, block), np.int64)
        index = {int(h): i for i, h in enumerate(unique)}
        prompts = [table[[index[h] for h in ids]].reshape(-1)[:n_in].tolist() for _, n_in, _, ids in rows]
    reqs = [Request(i, prompt, r[2], t) for i, (r, prompt, t) in enumerate(zip(rows, prompts, times, strict=True))]
    selection = {"source": str(path), "block_tokens_scaled": block, "window_s": [w.start, None if end == math.inf
                                                                                   else end]}
    if dropped or clipped:
        selection["dropped"] = {"over_context": dropped, "clipped": clipped}
    return Built([], reqs, selection)


def output_lengths(path: str) -> list[int]:
    """Every `output_length` of a Mooncake trace (for workloads that draw their lengths from it)."""
    out = [_int(row, "output_length", f"{path}:{n}", 1) for n, row in _lines(path, "output_from")
           if isinstance(row, dict)]
    if not out:
        raise ExperimentError(f"key 'workload.output_from': {path} holds no request")
    return out


def custom(w: Workload, vocab: int, model: str | None = None) -> Built:
    tokenizer = None
    rows, dropped, clipped, path = [], 0, 0, Path(w.path)
    context = context_of(model) if model else None
    for number, row in _lines(w.path, "custom"):
        where = f"{path}:{number}"
        if not isinstance(row, dict):
            raise ExperimentError(f"{where}: not a JSON object")
        if w.max_requests is not None and len(rows) >= w.max_requests:
            break
        if isinstance(row.get("prompt_tokens"), list):
            prompt = row["prompt_tokens"]
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                     for t in prompt):
                raise ExperimentError(f"{where}: 'prompt_tokens' must be a non-empty list of token ids below {vocab}")
        elif isinstance(row.get("prompt"), str):
            if tokenizer is None:
                tokenizer = _tokenizer(model, where)
            prompt = tokenizer.encode(row["prompt"], add_special_tokens=True)
        else:
            raise ExperimentError(f"{where}: needs 'prompt' (text) or 'prompt_tokens' (a list of token ids)")
        n_out = _int(row, "output_tokens", where, 1)
        ts = row.get("timestamp")
        if w.arrival == "trace" and (not isinstance(ts, (int, float)) or isinstance(ts, bool)):
            raise ExperimentError(f"{where}: arrival = 'trace' needs a numeric 'timestamp' (ms) on every line")
        keep = fit(len(prompt), n_out, w, context)
        if keep is None:
            dropped += 1
            continue
        clipped += keep < len(prompt)
        rows.append((ts, prompt[:keep], n_out))
    if w.arrival == "trace":
        t0 = min((r[0] for r in rows), default=0)
        times = [(r[0] - t0) / 1000.0 / w.speedup for r in rows]
    else:
        times = arrivals(w, len(rows))
    reqs = [Request(i, list(p), n, t) for i, ((_, p, n), t) in enumerate(zip(rows, times, strict=True))]
    reqs.sort(key=lambda r: r.arrival)
    for i, r in enumerate(reqs):
        r.id = i
    selection = {"source": str(path)}
    if dropped or clipped:
        selection["dropped"] = {"over_context": dropped, "clipped": clipped}
    return Built([], reqs, selection)


def _tokenizer(model: str | None, where: str):
    from mvllm.model.loader import load_tokenizer, resolve

    tok = load_tokenizer(resolve(model)) if model else None
    if tok is None:
        raise ExperimentError(f"{where}: 'prompt' is text but model {model} has no tokenizer; give 'prompt_tokens'")
    return tok
