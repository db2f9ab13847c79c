"""`mvllm profile`: each backend measured alone, written as the JSON profile the router reads (its rates
chosen by routing/rates.py's rule)."""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from mvllm import machine
from mvllm.backends.spec import BackendSpec, share_cores
from mvllm.engine.block_manager import BLOCK_SIZE
from mvllm.engine.cuda_graphs import token_buckets
from mvllm.engine.engine import Engine, served_pool, step_tokens
from mvllm.engine.params import SamplingParams
from mvllm.env import backend_facts, cpu_name, git_commit
from mvllm.kernels import cpu_int8
from mvllm.model.loader import ModelSource, resolve
from mvllm.profile.accuracy import SYNTHETIC_NOTE, Reference
from mvllm.profile.plan import DECODE_NEW, DECODE_PREFIX, LENGTHS, WARM_CACHED, WARM_NEW, Progress, Tokens
from mvllm.routing.rates import REFERENCE_LEN, choose_rates, validate

CONTEXT_BATCH = 4  # --contexts measures batch 1 and this (llama-batched-bench's -npl 1,4)
CHUNK_SIZES = (8, 4, 2, 1)  # prefill chunks of budget / each (the `chunks` rows)
CHUNK_OFFSETS = (0, 1, 3)  # ... after budget x each tokens in the KV
DENSE = 64  # decode is measured at every batch size up to this, past it at CUDA's graph buckets and max_active


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def decode_steps(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list, list[float]]:
    """Admit the prompts together, run them to the end, and time (seconds) each step in which all of them
    decoded; returns their sequences and those times."""
    seqs = [engine.add_request(p, params) for p in prompts]
    engine.step()
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        done = engine.step()
        if len(done) == len(prompts):
            times.append(time.perf_counter() - t)
    return seqs, times


def kv_blocks(spec: BackendSpec, lengths: tuple[int, ...], block_size: int, contexts: tuple[int, ...] = (),
              budget: int = 0) -> int | None:
    if spec.num_blocks or spec.kv_cache_gb:
        return spec.num_blocks
    tokens = (max(lengths + (WARM_CACHED + WARM_NEW,)) + (spec.max_active + 2) * (DECODE_PREFIX + 64))
    tokens = max(tokens, CONTEXT_BATCH * (max(contexts, default=0) + 64))
    tokens = max(tokens, (CHUNK_OFFSETS[-1] + 2) * budget + (CONTEXT_BATCH + 1) * (DECODE_PREFIX + 64))
    return 2 * -(-tokens // block_size)


def served_blocks(engine: Engine, spec: BackendSpec) -> int:
    """The KV blocks the backend has when served (the simulator's prefix cache): its spec's num_blocks, else what
    the engine's budget gives for its config; counted, not allocated (the profile runs with a smaller pool)."""
    return served_pool(replace(engine.config, num_blocks=spec.num_blocks), engine.source.config)[0]


def served_max_active(spec: BackendSpec, source: ModelSource, block_size: int) -> int:
    """The spec's max_active, else the one its engine picks for the pool it is served with (not the profile's)."""
    if spec.max_active is not None:
        return spec.max_active
    config = spec.engine_config(source.spec, block_size)
    config.validate()
    return served_pool(config, source.config)[1]


def decode_batches(max_active: int) -> list[int]:
    return sorted(set(range(1, min(max_active, DENSE) + 1)) | {b for b in token_buckets(max_active) if b <= max_active})


def measure_backend(model: str, spec: BackendSpec, lengths: tuple[int, ...], repeats: int, steps: int,
                    progress: Progress, block_size: int = BLOCK_SIZE, reference: Reference | None = None,
                    contexts: tuple[int, ...] = ()) -> dict:
    source = resolve(model)
    spec.max_active = served_max_active(spec, source, block_size)
    config = spec.engine_config(model, block_size)
    budget = step_tokens(config, spec.max_active)[0]
    config.num_blocks = kv_blocks(spec, lengths, block_size, contexts, budget)
    progress(f"{spec.name}: loading {model} on {spec.device}")
    start = time.perf_counter()
    engine = Engine(config, source)
    ready_s = time.perf_counter() - start
    budget = engine.config.max_step_tokens  # as the engine resolved it
    progress(f"{spec.name}: ready in {ready_s:.1f} s")
    tokens = Tokens(engine.source.config.vocab_size)
    out = {"device": spec.device, "device_name": device_name(engine.device), "dtype": str(engine.dtype)[6:],
           "quant": engine.config.quant, "picked": engine.config.picked, "threads": torch.get_num_threads(),
           "huge_pages": engine.config.quant == "int8w" and cpu_int8.packs() and cpu_int8.huge_pages(),
           "max_active": spec.max_active, "graphs": engine.runner.captured, "compiled": engine.runner.compiled,
           "fused": engine.runner.fused, "overlap": engine.config.overlap,
           "batch_invariant": engine.config.batch_invariant, "ready_s": round(ready_s, 1),
           "kv_blocks": served_blocks(engine, spec), "max_step_tokens": budget, "prefill": [], "decode": []}

    def first_token(prompt: list[int]) -> tuple[float, int]:
        seq = engine.add_request(prompt, _greedy(1))
        t = time.perf_counter()
        while seq.times.first_token is None:  # one step; two with overlap (launched, then read)
            engine.step()
        dt = time.perf_counter() - t
        while engine.has_unfinished():
            engine.step()
        return dt, seq.num_cached_tokens

    first_token(tokens(min(lengths)))  # warm-up: allocator, kernels, thread pools
    for n in lengths:
        if n + 1 >= engine.max_model_len:
            continue
        progress(f"{spec.name}: cold prefill, {n} tokens")
        times = [first_token(tokens(n))[0] for _ in range(repeats)]
        ms = _median_ms(times)
        out["prefill"].append({"kind": "cold", "tokens": n, "cached": 0, "ms": ms, "tok_s": n / ms * 1000})
    progress(f"{spec.name}: warm prefill, {WARM_NEW} new after {WARM_CACHED} cached")
    prefix = warm_prefix = tokens(WARM_CACHED)
    engine.warm(prefix)
    runs = [first_token(prefix + tokens(WARM_NEW)) for _ in range(repeats)]
    ms = _median_ms([t for t, _ in runs])
    out["prefill"].append({"kind": "warm", "tokens": WARM_NEW, "cached": min(c for _, c in runs), "ms": ms,
                           "tok_s": WARM_NEW / ms * 1000})
    prefix = tokens(DECODE_PREFIX)
    engine.warm(prefix)
    for b in decode_batches(spec.max_active):
        progress(f"{spec.name}: decode, batch {b}")
        seqs, times = decode_steps(engine, [prefix + tokens(DECODE_NEW) for _ in range(b)], _greedy(steps + 2))
        ms = _median_ms(times)
        ctx = (DECODE_PREFIX + DECODE_NEW) + (steps + 1) // 2
        out["decode"].append({"batch": b, "context": ctx, "step_ms": ms, "tok_s": b / ms * 1000,
                              "cached": min(s.num_cached_tokens for s in seqs)})
    if contexts:
        out["contexts"] = context_steps(engine, spec, contexts, steps, tokens, progress)
    if spec.max_active > 1:
        half = REFERENCE_LEN // 2 // block_size * block_size  # half of the prompt cached: past CUDA graphs' size
        prompts = {"warm": lambda: warm_prefix + tokens(WARM_NEW)}
        if REFERENCE_LEN + 1 < engine.max_model_len:
            prompts["half"] = lambda: warm_prefix[:half] + tokens(REFERENCE_LEN - half)
            prompts["cold"] = lambda: tokens(REFERENCE_LEN)
        out["mixed"] = mixed_steps(engine, spec.max_active, lambda: prefix + tokens(DECODE_NEW), repeats, prompts,
                                   progress, spec.name)
    out["chunks"] = chunk_steps(engine, budget, min(spec.max_active - 1, CONTEXT_BATCH),
                                lambda: prefix + tokens(DECODE_NEW), tokens, repeats, progress, spec.name)
    out.update(choose_rates(out))
    if reference is not None:
        progress(f"{spec.name}: accuracy against float32 on {len(reference.ids)} tokens")
        out["accuracy"] = reference.measure(engine.model, engine.device, engine.dtype, runner=engine.runner)
    elif engine.source.synthetic:
        out["accuracy"] = {"note": SYNTHETIC_NOTE}
    return out


def context_steps(engine: Engine, spec: BackendSpec, contexts: tuple[int, ...], steps: int, tokens: Tokens,
                  progress: Progress) -> list[dict]:
    """Decode at chosen depths, as `llama-bench -d DEPTH` measures it: each request's prompt is DEPTH tokens (one
    for depth 0), warmed into the cache first so the batch's prompts end in one step, then `steps` timed decode
    steps, at batch 1 and CONTEXT_BATCH (within max_active). `context` is the mean context of the timed steps."""
    rows = []
    for depth in contexts:
        if max(depth, 1) + steps + 3 >= engine.max_model_len:
            progress(f"{spec.name}: depth {depth} does not fit the context ({engine.max_model_len}); skipped")
            continue
        for b in sorted({1, min(CONTEXT_BATCH, spec.max_active)}):
            progress(f"{spec.name}: decode at depth {depth}, batch {b}")
            prompts = [tokens(max(depth, 1)) for _ in range(b)]
            for p in prompts:  # cached first: under a step budget their prefills would end steps apart
                engine.warm(p)
            _, times = decode_steps(engine, prompts, _greedy(steps + 2))
            ms = _median_ms(times)
            rows.append({"batch": b, "depth": depth, "context": max(depth, 1) + 1 + (steps + 1) // 2,
                         "step_ms": ms, "tok_s": b / ms * 1000})
    return rows


def mixed_steps(engine: Engine, batch: int, decoding: Callable[[], list[int]], repeats: int,
                prompts: dict[str, Callable[[], list[int]]], progress: Progress, name: str) -> list[dict]:
    """The step that admits one prompt while batch - 1 requests decode, as serving runs it (the simulator and
    eta price a prompt's admission by it: a mixed step can cost more than a lone prefill plus a decode step)."""
    out = []
    for kind, prompt in prompts.items():
        progress(f"{name}: {kind} prefill beside {batch - 1} decoding")
        times, uncached = [], []
        for _ in range(repeats):
            for _ in range(batch - 1):
                engine.add_request(decoding(), _greedy(4))
            engine.step()
            ids = prompt()
            seq = engine.add_request(ids, _greedy(1))
            t = time.perf_counter()
            while seq.times.first_token is None:
                engine.step()
            times.append(time.perf_counter() - t)
            uncached.append(len(ids) - seq.num_cached_tokens)
            while engine.has_unfinished():
                engine.step()
        out.append({"kind": kind, "tokens": min(uncached), "cached": len(ids) - min(uncached), "batch": batch,
                    "ms": _median_ms(times)})
    return out


def chunk_steps(engine: Engine, budget: int, decodes: int, decoding: Callable[[], list[int]], tokens: Tokens,
                repeats: int, progress: Progress, name: str) -> list[dict]:
    """The steps a budget runs (eta's `Chunks` prices them): one prefill chunk of budget / CHUNK_SIZES tokens
    after budget x CHUNK_OFFSETS tokens already in its KV (a prefix warmed into the cache, so the chunk is what
    the step computes), alone, and at offset 0 also beside `decodes` requests decoding (each chunk then at most
    budget - decodes: the step stays within the budget). `ms`: from the chunk's admission to its first token."""
    rows = []
    sizes = sorted({max(budget // k, 1) for k in CHUNK_SIZES})
    for offset in sorted({budget * k // BLOCK_SIZE * BLOCK_SIZE for k in CHUNK_OFFSETS}):
        prefix = tokens(offset)
        if offset:
            engine.warm(prefix)
        for d in (0, decodes) if offset == 0 and decodes > 0 else (0,):
            for size in sorted({min(n, budget - d) for n in sizes}):
                if offset + size + 2 >= engine.max_model_len:
                    continue
                progress(f"{name}: prefill chunk of {size} after {offset} beside {d} decoding")
                times = []
                for _ in range(repeats):
                    for _ in range(d):
                        engine.add_request(decoding(), _greedy(4))
                    if d:
                        engine.step()
                    seq = engine.add_request(prefix + tokens(size), _greedy(1))
                    t = time.perf_counter()
                    while seq.times.first_token is None:
                        engine.step()
                    times.append(time.perf_counter() - t)
                    while engine.has_unfinished():
                        engine.step()
                rows.append({"tokens": size, "offset": offset, "decodes": d,
                             "context": DECODE_PREFIX + DECODE_NEW + 1, "ms": _median_ms(times)})
    return rows


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    return cpu_name()


def environment(model: str) -> dict:
    import transformers

    return {"model": model, "cpu_model": cpu_name(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "build": machine.build_facts(), "git_commit": git_commit(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def run_profile(model: str, specs: list[BackendSpec], lengths: tuple[int, ...] = LENGTHS, repeats: int = 5,
                steps: int = 16, baseline: str | None = None, progress: Progress | None = None,
                accuracy: bool = True, contexts: tuple[int, ...] = ()) -> dict:
    """accuracy: measure each backend against the float32 model on the evaluation text (real weights only).
    contexts: also decode at these depths (context_steps)."""
    progress = progress or (lambda _: None)
    reference, source = None, resolve(model)
    if accuracy and not source.synthetic and any(not s.remote for s in specs):
        progress("accuracy: the float32 reference over the evaluation text")
        reference = Reference(source)
    default_threads = torch.get_num_threads()
    share_cores(specs)  # each backend measured with the threads `serve` gives it
    profile = {"model": model, "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "environment": environment(model), "backends": {}}
    for spec in specs:
        if spec.remote:  # another server: measured from outside over HTTP (profile_remote.py)
            from mvllm.profile.remote import measure_remote

            profile["backends"][spec.name] = measure_remote(spec, model, source.config.vocab_size, lengths, repeats,
                                                            steps, progress)
            continue
        torch.set_num_threads(spec.threads or default_threads)
        facts = backend_facts(spec, model, source.config)  # before measure_backend resolves spec.max_active
        entry = measure_backend(model, spec, lengths, repeats, steps, progress, reference=reference,
                                contexts=contexts)
        entry["env"] = facts
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if baseline == "transformers":
            from mvllm.profile.baseline import compare, measure

            progress(f"{spec.name}: transformers baseline")
            entry["baseline"] = measure(model, entry, repeats=max(repeats // 2, 2), steps=steps)
            entry["baseline"]["ratios"] = compare(entry, entry["baseline"])
        profile["backends"][spec.name] = entry
    torch.set_num_threads(default_threads)
    validate(profile, "the new profile")
    return profile


def add_serving(profile: dict, model: str, text: str, specs: list[BackendSpec], repeats: int, steps: int,
                progress: Progress) -> dict:
    """--serving: each local backend's serving overheads, measured through `mvllm serve` (profile_serving.py)."""
    from mvllm.profile.serving import measure_serving

    source = resolve(model)
    start = time.perf_counter()
    found = measure_serving(model, text, specs, profile, Tokens(source.config.vocab_size, seed=1), repeats, steps,
                            source.config.max_position, progress)
    for name, block in found.items():
        profile["backends"][name]["serving"] = block
    profile["serving_s"] = round(time.perf_counter() - start, 1)
    return profile


def save_profile(profile: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n")
    return path


def table(profile: dict):
    """Rich tables: one row per backend, then mvllm/transformers ratios where a baseline ran."""
    from rich.console import Group

    from mvllm.tables import name_column, narrow, number_column, text_column

    serving = any("serving" in b for b in profile["backends"].values())
    legend = ["cold: prefill tok/s without a cached prefix (prompt tokens)",
              "warm: prefill of a prompt whose prefix is cached, ms", "decode: ms per step at batch 1, 2, ...",
              "prefill rate, decode rate: the rates the router uses, tok/s", "ready: s to load and warm"]
    if serving:
        legend.append("serving: ms per request, then per step, through serve")
    t = narrow(f"mvllm profile: {profile['model']}", "\n".join(legend))
    name_column(t, "backend")
    text_column(t, "setting")
    for col in ("cold", "warm", "decode") + ("prefill\nrate", "decode\nrate", "ready") + (("serving",) if serving else ()):
        number_column(t, col)
    accuracy = narrow("accuracy against float32 (mean KL, nats/token)")
    name_column(accuracy, "backend")
    for col in ("KL prefill", "KL decode", "top-1", "verdict"):
        text_column(accuracy, col)
    ratios = narrow("mvllm / transformers (above 1: mvllm faster)")
    name_column(ratios, "backend")
    text_column(ratios, "ratios")
    for name, b in profile["backends"].items():
        pre = b.get("prefill", [])
        cold = " ".join(f"{p['tok_s']:.0f} ({p['tokens']})" for p in pre if p["kind"] == "cold")
        warm = next((f"{p['ms']:.1f}" for p in pre if p["kind"] == "warm"), "-")
        dec = " ".join(f"{d['step_ms']:.2f}" if d["step_ms"] < 10 else f"{d['step_ms']:.1f}"
                       for d in b.get("decode", []))
        setting = (f"{b.get('device', '?')} {b.get('dtype', '')} {b.get('quant', '')} x{b.get('threads', '')}"
                   if not b.get("remote") else f"{b['device']} (over HTTP)")
        over = b.get("serving")
        t.add_row(name, setting, cold, warm, dec, f"{b['prefill_rate']:.0f}", f"{b['decode_rate']:.1f}",
                  str(b.get("ready_s", "-")),
                  *((f"{over['request_ms']:.1f}, {over['step_ms']:.2f}" if over else "-",) if serving else ()))
        if b.get("accuracy"):
            accuracy.add_row(name, *accuracy_cells(b["accuracy"]))
        got = b.get("baseline", {}).get("ratios", {})
        if got:
            ratios.add_row(name, "  ".join(f"{k} {v:.2f}" for k, v in got.items()))
    return Group(*(x for x in (t, accuracy, ratios) if x is t or x.row_count))


def accuracy_cells(acc: dict) -> tuple[str, str, str, str]:
    if "kl_mean" not in acc:
        return "-", "-", "-", "n/a: synthetic weights" if acc.get("note") == SYNTHETIC_NOTE else "n/a"
    verdict = "accurate" if acc["within_bound"] else f"LOSSY (KL > {acc['bound']})"
    return (f"{acc['prefill']['kl_mean']:.4f}", f"{acc['decode']['kl_mean']:.4f}", f"{100 * acc['top1']:.1f}%",
            verdict)


def cli_profile(model: str, backends: str | None, out: str | None, json_out: bool, baseline: str | None,
                lengths: str, repeats: int, steps: int, max_active: int | None, console,
                accuracy: bool = True, serving: bool = False, contexts: str = "") -> dict:
    from rich.progress import Progress as Bar
    from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn

    from mvllm.backends.spec import default_backends, parse_backends
    from mvllm.errors import InvalidRequestError

    text = backends or default_backends()
    specs = parse_backends(text, max_active)
    if baseline not in (None, "transformers"):
        raise InvalidRequestError(f"unknown baseline {baseline!r}; the one known is 'transformers'", "baseline")
    try:
        sizes = tuple(int(x) for x in lengths.split(",") if x.strip())
    except ValueError:
        raise InvalidRequestError(f"--lengths must be comma-separated integers, got {lengths!r}") from None
    if not sizes or min(sizes) < 1 or repeats < 1 or steps < 1:
        raise InvalidRequestError("--lengths, --repeats and --steps must be positive")
    try:
        depths = tuple(int(x) for x in contexts.split(",") if x.strip())
    except ValueError:
        raise InvalidRequestError(f"--contexts must be comma-separated integers, got {contexts!r}") from None
    if depths and min(depths) < 0:
        raise InvalidRequestError(f"--contexts must be 0 or more, got {contexts!r}")
    with Bar(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
             transient=True) as bar:
        task = bar.add_task("profiling", total=None)
        result = run_profile(model, specs, sizes, repeats, steps, baseline,
                             lambda line: bar.update(task, description=line), accuracy, depths)
        if serving:
            add_serving(result, model, text, specs, repeats, steps, lambda line: bar.update(task, description=line))
    console.print(table(result))
    for name, entry in result["backends"].items():
        if entry.get("contexts"):
            cells = ", ".join(f"depth {c['depth']} batch {c['batch']}: {c['step_ms']:.2f} ms" for c in entry["contexts"])
            console.print(f"{name} decode by depth: {cells}", highlight=False)
    if out:
        console.print(f"wrote {save_profile(result, out)}", highlight=False)
    if json_out:
        print(json.dumps(result, indent=2))
    return result
