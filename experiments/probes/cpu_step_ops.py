"""Where a CPU decode step's time goes: one backend's engine decodes at a given context under torch.profiler,
and the table gives each op's self time per step (mvllm's int8 and fused kernels are ops of their own), their
sum, and the step's wall time; what is left is Python and dispatch between the ops. --prefill: each step is
instead the cold prefill of a fresh prompt of --context tokens (distinct tokens each time: no prefix hits).
--warm: each step is the prefill of 20 fresh tokens after a cached prefix of 496 (the profile's warm prefill).

    python experiments/probes/cpu_step_ops.py [--threads 8] [--batch 1] [--context 516] [--steps 16] [--quant int8w]
        [--python-loop] [--prefill | --warm] [--batch-invariant] [--split]
        [--knobs chunks=8,chunks=4 [--rounds 4]]

--split: also time a step's phases with perf_counter around them, without the profiler (the C++ layer loop, the LM
head, the argmax, the attention metadata, the rest: Python and small ops), median over --steps steps; and the C++
team's phases (each linear, the attention, the small work between): wall, the threads' mean work and the slowest's.

--knobs chunks=8,chunks=4: instead of the profile, time --steps steps under each setting of the int8 kernel's knobs
(cpu_int8.knob; "chunks=4:stage=0" sets two) or the layer loop's (cpu_layers.knob: team=0 a region an op, team=1 one
team of threads a step; even, the percent of a linear's blocks the team splits evenly; ahead, the bytes a waiting
thread prefetches), or the attention's (cpu_fused.attention_knob: items, token_items, lanes) in turn, --rounds
times, in one process: each setting's median step
against the first's, the host's drift shared.

--batch-invariant: int8w with batch_invariant=on, so every step's linears take the int8 kernel (AMX tiles above 32
rows where cpu_int8.amx()), never the bf16 GEMM.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from mvllm.engine.engine import Engine, EngineConfig
from mvllm.engine.params import SamplingParams
from mvllm.profile.plan import WARM_CACHED, WARM_NEW


def phases(engine, step, steps: int) -> dict[str, float]:
    """Median ms a step of each phase, timed by wrapping the functions a CPU step calls; "step" the whole."""
    from mvllm.engine import model_runner
    from mvllm.kernels import cpu_fused, cpu_layers

    spent: dict[str, float] = defaultdict(float)
    runner = engine.runner
    targets = [(cpu_layers, "_op", "layers"), (runner.model, "logits", "lm head"), (cpu_fused, "argmax", "argmax"),
               (model_runner, "build_meta", "metadata")]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]

    def timed(fn, label):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t
        return call

    for (obj, name, label), (_, _, fn) in zip(targets, saved):
        setattr(obj, name, timed(fn, label))
    per_step: dict[str, list[float]] = defaultdict(list)
    try:
        for _ in range(steps):
            spent.clear()
            t = time.perf_counter()
            step()
            wall = time.perf_counter() - t
            for label in ("layers", "lm head", "argmax", "metadata"):
                per_step[label].append(spent[label])
            per_step["rest"].append(wall - sum(spent.values()))
            per_step["step"].append(wall)
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    return {k: 1000 * sorted(v)[len(v) // 2] for k, v in per_step.items()}


def team_phases(step, steps: int, threads: int) -> dict[str, dict[str, float]]:
    """The team's phases (csrc/layers.cpp, knob "times" 1), ms a step: wall, the threads' mean work before each
    phase's barrier and the slowest thread's (wall - slowest is the barrier's cost). Empty where no step ran in a
    team."""
    from mvllm.kernels import cpu_layers

    if not cpu_layers.available():
        return {}
    cpu_layers.team_times()
    old = cpu_layers.knob("times", 1)
    try:
        for _ in range(steps):
            step()
    finally:
        cpu_layers.knob("times", old)
    return {k: {"wall": wall / steps, "work": work / steps / threads, "slowest": slowest / steps}
            for k, (wall, work, slowest) in cpu_layers.team_times().items() if wall > 0}


def knob_rounds(a, settings: list[str], step) -> None:
    """--knobs: each setting's steps in turn, a.rounds times; the medians printed against the first setting's."""
    from mvllm.kernels import cpu_fused, cpu_int8, cpu_layers

    def knob(name: str, value: int) -> int:  # the layer loop's, the attention's, or else the int8 kernel's
        if name in ("items", "token_items", "lanes"):
            return cpu_fused.attention_knob(name, value)
        layers = ("team", "even", "ahead", "amx_blocks", "last")
        return (cpu_layers.knob if name in layers else cpu_int8.knob)(name, value)

    def apply(setting: str) -> dict[str, int]:
        return {name: knob(name, int(value)) for name, value in (kv.split("=") for kv in setting.split(":"))}

    times: dict[str, list[float]] = {k: [] for k in settings}
    for _ in range(a.rounds):
        for k in settings:
            old = apply(k)
            for _ in range(a.steps):
                t = time.perf_counter()
                step()
                times[k].append(time.perf_counter() - t)
            for name, value in old.items():
                knob(name, value)
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    kind = f"batch={a.batch} context~{a.context}" if not (a.prefill or a.warm) else "prefill" if a.prefill else "warm"
    for k in settings:
        print(f"cpu threads={a.threads} {kind}: {k:<24} step {med[k]:7.3f} ms, {med[k] / med[settings[0]]:.3f}x "
              f"{settings[0]}'s ({a.rounds} rounds of {a.steps} steps)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "median_ms": med, "times_s": times}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=516)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--quant", default=None)
    ap.add_argument("--python-loop", action="store_true", help="int8w: the layers from Python, not csrc/layers.cpp")
    ap.add_argument("--prefill", action="store_true", help="time cold prefills of --context tokens, not decode")
    ap.add_argument("--warm", action="store_true", help="time warm prefills (20 new after 496 cached), not decode")
    ap.add_argument("--batch-invariant", action="store_true", help="int8w: batch_invariant=on (the kernel at any rows)")
    ap.add_argument("--split", action="store_true", help="time the step's phases without the profiler")
    ap.add_argument("--knobs", help="int8 or layer-loop knob settings to time in turn, comma-separated (see above)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out")
    a = ap.parse_args()
    settings = a.knobs.split(",") if a.knobs else []
    if a.python_loop:
        from mvllm.kernels import cpu_layers

        cpu_layers.ENABLED = False
    engine = Engine(EngineConfig(model=a.model, device="cpu", threads=a.threads, quant=a.quant,
                                 max_active=max(4, a.batch), batch_invariant=a.batch_invariant or None))
    rounds = len(settings) * a.rounds if settings else 3
    params = SamplingParams(max_tokens=(rounds + 1) * a.steps + 8 + a.batch * a.context // 64, temperature=0.0,
                            ignore_eos=True)
    seqs = [engine.add_request([(7 * b + 3 * k) % 1000 + 1 for k in range(a.context)], params)
            for b in range(a.batch)]
    while any(s.num_output_tokens == 0 for s in seqs):  # every prompt prefilled: the steps below are decode
        engine.step()
    for _ in range(a.steps):  # warm
        engine.step()
    fresh = iter(range(1, 10**6))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefix = [(11 * k) % 3000 + 7 for k in range(WARM_CACHED)]
    if a.warm:
        engine.warm(prefix)

    def step() -> None:
        if a.prefill or a.warm:  # a fresh prompt (or fresh tail), prefilled in one step, done after its first token
            n = next(fresh)
            if a.warm:
                engine.add_request(prefix + [(n * 131 + 17 * k) % 5000 + 1 for k in range(WARM_NEW)], one)
            else:
                engine.add_request([(n * 131 + 17 * k) % 5000 + 1 for k in range(a.context)], one)
        engine.step()

    if a.prefill or a.warm:
        for s in seqs:
            engine.abort(s.request_id)
        for _ in range(2):
            step()
    if settings:
        return knob_rounds(a, settings, step)
    walls = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(a.steps):
            t = time.perf_counter()
            step()
            walls.append(time.perf_counter() - t)
    plain = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        plain.append(time.perf_counter() - t)
    split = phases(engine, step, a.steps) if a.split else {}
    team = team_phases(step, a.steps, a.threads) if a.split else {}
    by_op: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.key.startswith(("mvllm", "aten::", "mkldnn::")) and e.self_cpu_time_total > 0:
            by_op[e.key] += e.self_cpu_time_total / 1000 / a.steps
    top = sorted(by_op.items(), key=lambda kv: -kv[1])
    ops_ms = sum(by_op.values())
    wall = 1000 * sorted(walls)[len(walls) // 2]
    bare = 1000 * sorted(plain)[len(plain) // 2]
    from mvllm.kernels import cpu_int8

    path = cpu_int8.build_info().get("path", "-") if engine.config.quant == "int8w" else "-"
    kind = (f"cold prefill of {a.context}" if a.prefill else f"warm prefill of {WARM_NEW} after {WARM_CACHED}"
            if a.warm else f"batch={a.batch} context~{a.context}")
    print(f"{a.model} cpu threads={a.threads} {kind} quant={engine.config.quant} "
          f"({path}): "
          f"step {bare:.2f} ms ({wall:.2f} under the profiler), ops {ops_ms:.2f} ms")
    for name, ms in top[:14]:
        print(f"  {name:<44} {ms:7.3f} ms/step")
    if split:
        print("  phases, no profiler: " + ", ".join(f"{k} {v:.3f}" for k, v in split.items()) + " ms")
    if team:
        print("  team phases, ms a step (wall / the threads' mean work / the slowest's): " + ", ".join(
            f"{k} {v['wall']:.3f}/{v['work']:.3f}/{v['slowest']:.3f}" for k, v in team.items()) +
            f"; sum {sum(v['wall'] for v in team.values()):.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "int8_path": path, "step_ms": bare, "profiled_step_ms": wall, "ops_ms": ops_ms,
                       "ops": dict(top), "phases_ms": split,
                       "team_phases_ms": team}, f, indent=1)


if __name__ == "__main__":
    main()
