"""`mvllm simulate`: an experiment's workload replayed through the real Router and policies, with every
backend modelled from a profile instead of run (simulate/backend.py: the modelled engine; simulate/kv.py:
its KV blocks and prefix cache).

Every workload kind bench replays (bench/workload.py): the client side sends what a real client sends. The
router is told what the server would be told: the request's max_tokens (its true length where lengths are
told; with lengths hidden the experiment's cap, else what the server takes when a client sends none: the room
left in the context, `context - prompt`, the context capped at the smallest backend's pool), and each
backend's cached prefix at that moment (the server's look-up); the modelled engine ends the request at its
true length. A follow-up turn is sent its think time after its parent's last token, its prompt the parent's
whole prompt, the parent's reply (`workload.reply_tokens`, as the client builds it) and its own tokens, so it
finds the blocks its parent left cached on the backend that ran it. A request whose prompt and max_tokens do not
fit the context fails, as the server's 400 would, and the turns that follow it with it. Each backend's prefix cache has the
profile's `kv_blocks` (the pool the backend has when served; a backend spec's num_blocks wins), with LRU
eviction of free cached blocks; a profile without kv_blocks leaves that backend's pool unbounded (no eviction,
no wait for blocks), and the summary says so (`kv_blocks`: backend -> blocks, or None). The router sees the
events a worker would send (admitted, token, finished), so mixed, eta and split:K decide as they would in
`mvllm serve`. Output: one `summary.json` per policy and setting with bench's keys, in seconds of simulated
time, plus `kv_blocks` and `preemptions` per backend.
"""

from __future__ import annotations

import copy
import gc
import heapq
import json
import os
import pickle
import sys
from collections import deque
from pathlib import Path

from mvllm.backends.spec import BackendSpec, default_backends, parse_backends
from mvllm.bench import workload as wl
from mvllm.bench.experiment import Experiment
from mvllm.bench.idprompt import IdPrompt
from mvllm.bench.metrics import RequestRecord, summarize, tails
from mvllm.bench.results import read_aggregate
from mvllm.engine.block_manager import BLOCK_SIZE
from mvllm.errors import MvllmError
from mvllm.routing.eta import Timing
from mvllm.routing.lengths import Lengths
from mvllm.routing.policies.registry import uses_slo
from mvllm.routing.rates import rates_as_served
from mvllm.routing.router import Router
from mvllm.simulate.backend import Backend, Job
from mvllm.simulate.kv import KVCache, chain, stand_ins

CONTEXT = 2048  # the context where the model's config is not found here
INF = float("inf")


class SimulateError(MvllmError):
    pass


def timings(rates: dict[str, dict], names: list[str]) -> dict[str, Timing]:
    out = {}
    for name in names:
        timing = Timing.from_profile(rates.get(name, {}))
        if timing is None:
            raise SimulateError(f"the profile has no decode step times for backend {name!r}; the simulator "
                                "needs a profile made by `mvllm profile`")
        out[name] = timing
    return out


def step_budgets(profile: dict, specs: list[BackendSpec]) -> dict[str, int | None]:
    """Each backend's step budget as the simulator runs it: the profile's max_step_tokens where the profile
    measured its chunk rows (else None: prompts priced whole, as the engine ran them before steps had a budget).
    A backend whose spec sets another budget than the one its profile measured under is refused."""
    out = {}
    for s in specs:
        entry = profile["backends"].get(s.name, {})
        have, want = entry.get("max_step_tokens"), s.max_step_tokens
        if want and have and want != have:
            raise SimulateError(f"backend {s.name} runs max_step_tokens={want}, its profile was measured under "
                                f"{have}: profile it again with that budget (`mvllm profile`)")
        out[s.name] = have if have and entry.get("chunks") else None
    return out


def budget_line(budgets: dict[str, int | None]) -> str | None:
    """The one line that says which backends' prompts are priced whole (a profile without the chunk rows)."""
    old = [name for name, b in budgets.items() if b is None]
    if not old:
        return None
    return (f"the profile has no budgeted step rows for {', '.join(old)}: their prompts are priced whole in one "
            "step, as before steps had a budget (`mvllm profile` again to price chunked prefill)")


def kv_blocks(profile: dict, specs: list[BackendSpec]) -> dict[str, int | None]:
    """Each backend's KV blocks as served: its spec's num_blocks, else the profile's kv_blocks, else None
    (unbounded: an older profile)."""
    return {s.name: s.num_blocks or profile["backends"].get(s.name, {}).get("kv_blocks") for s in specs}


def context_len(model: str, blocks: dict[str, int | None]) -> int:
    """The server's max_model_len: the model's context, capped at the smallest pool (as each engine caps it)."""
    pools = [n * BLOCK_SIZE for n in blocks.values() if n]
    return min([wl.context_of(model) or CONTEXT, *pools])


def prompt_hashes(req: wl.Request, prompt: list[int], before: list[int]) -> list[int]:
    """The hash chain over the full blocks of a request's whole prompt, memoized in `req.hashes`; `before`: the
    chain of its parent's prompt and reply, whose tokens begin it (a first turn: none). A trace's prompt left as
    its hash ids (bench/idprompt.py) has its blocks' keys instead, made again each time (they are cheap)."""
    if isinstance(prompt, IdPrompt):
        return prompt.keys()
    if len(req.hashes) != len(prompt) // BLOCK_SIZE:
        req.hashes = before + chain(prompt, len(before), before[-1] if before else None)
    return req.hashes


def reply_hashes(req: wl.Request, prompt: list[int], hashes: list[int], vocab: int, followed: bool) -> list[int]:
    """The chain's blocks past the prompt's full ones, to the end of its reply: those of `reply_tokens` (what the
    client sends back in the next turn) where a turn follows, else stand-ins that no other prompt holds."""
    if followed:
        tail = prompt[len(prompt) // BLOCK_SIZE * BLOCK_SIZE:] + wl.reply_tokens(req.id, req.output_tokens, vocab)
        return chain(tail, 0, hashes[-1] if hashes else None)
    return stand_ins(hashes, req.id, (len(prompt) + req.output_tokens) // BLOCK_SIZE)


def run_one(exp: Experiment, policy: str, profile: dict, vocab: int, keep: list | None = None,
            believed: dict | None = None, built: wl.Built | None = None, lengths: Lengths | None = None,
            brief: bool = False) -> dict:
    """One simulated run; `keep`, if given, receives the per-request records. `believed`: the profile the
    router decides by, where it differs from the one the backends run by (the model's error). `built`: the
    workload, where the caller has built it already (a trace takes seconds). `lengths`: the length estimate's
    start (a server that has seen this traffic before; default: none seen). `brief`: only the band's keys
    (metrics.tails), not the whole summary."""
    text = default_backends() if exp.backends == "default" else exp.backends
    specs = parse_backends(text, exp.max_active, check_devices=False)
    most = {s.name: s.max_active for s in specs}
    rates = rates_as_served(profile, most)
    blocks = kv_blocks(profile, specs)
    budgets = step_budgets(profile, specs)
    backends = {name: Backend(name, t, KVCache(blocks[name]))
                for name, t in timings(rates, [s.name for s in specs]).items()}
    for b in backends.values():  # whose work makes a step pay the busier host's price (Timing.alone_s)
        b.others = tuple(o for o in backends.values() if o is not b)
    router = Router(list(backends), policy, rates_as_served(believed, most) if believed else rates,
                    lengths=lengths, slo=exp.goodput if uses_slo(policy) else None)
    built = built or wl.build_all(exp.workload, vocab, exp.model, tokens=False)
    if exp.workload.warm and built.prefix:
        hashes, n = chain(built.prefix), len(built.prefix)
        for b in backends.values():
            if not b.kv.can_allocate(hashes, n):
                raise SimulateError(f"backend {b.name}: its {b.kv.num_blocks} KV blocks cannot hold the "
                                    f"{n}-token prefix to warm")
            b.kv.warm(hashes, n)
    collecting = gc.isenabled()
    gc.disable()  # the replay's records, jobs and events live until it ends: its passes would free next to nothing
    try:
        records = replay(built.requests, backends, router, vocab, context_len(exp.model, blocks), times=not brief)
    finally:
        if collecting:
            gc.enable()
    router.close()
    if keep is not None:
        keep.extend(records)
    if brief:
        return tails(records)
    summary = summarize(records)
    summary["kv_blocks"] = blocks
    summary["max_step_tokens"] = budgets
    summary["preemptions"] = {name: b.preemptions for name, b in backends.items()}
    return summary


def replay(requests: list[wl.Request], backends: dict[str, Backend], router: Router, vocab: int,
           context: int, times: bool = True) -> list[RequestRecord]:
    """The client's side: first turns at their send times, each follow-up turn its think time after its
    parent's last token (or its failure). Without `times`, no record keeps its tokens' times (`chunks`: a
    sink), where only first tokens and finishes are read."""
    sink = None if times else deque(maxlen=0)
    turns: dict[int, list[wl.Request]] = {}
    for r in requests:
        if r.parent is not None:
            turns.setdefault(r.parent, []).append(r)
    by_id = {r.id: r for r in requests} if turns else {}
    prompts: dict[int, tuple[list[int], list[int]]] = {}  # whole prompt and chain of those whose turns are to come
    failed: set[int] = set()
    # first turns in send order, merged with a heap of the rest (steps, hand-overs, follow-up turns); at one time
    # a first turn comes first, as it would in one heap ordered by (time, number) with first turns numbered first
    firsts = sorted(((r.arrival, i, r) for i, r in enumerate(requests) if r.parent is None), key=lambda e: e[:2])
    events: list[tuple[float, int, str, object]] = []
    seq, records, k = len(requests), [], 0

    def follow(parent: int, end: float) -> None:
        nonlocal seq
        for child in turns.get(parent, ()):
            seq += 1
            heapq.heappush(events, (end + child.arrival, seq, "arrive", child))

    while k < len(firsts) or events:
        if k < len(firsts) and (not events or firsts[k][0] <= events[0][0]):
            (now, _, what), kind, k = firsts[k], "arrive", k + 1
        else:
            now, _, kind, what = heapq.heappop(events)
        if kind == "arrive":
            req, parent = what, by_id.get(what.parent)
            if parent is None:
                prompt, before = req.prompt, []
            else:
                (before_prompt, before), left = prompts[parent.id], turns[parent.id]
                prompt = wl.full_prompt(req, before_prompt, wl.reply_tokens(parent.id, parent.output_tokens, vocab))
                left.remove(req)
                if not left:
                    del prompts[parent.id]
            followed = bool(turns.get(req.id))
            n, cap = len(prompt), req.cap
            rec = RequestRecord(req.id, now, n, sent=now, max_tokens=cap, target_tokens=req.output_tokens,
                                parent=req.parent)
            if sink is not None:
                rec.chunks = sink
            records.append(rec)
            limit = cap if cap is not None else context - n  # the server's default: up to the context's end
            if req.parent in failed or n >= context or n + limit > context:
                rec.error = ("its parent failed" if req.parent in failed else
                             f"the prompt ({n} tokens) and max_tokens ({limit}) exceed the context ({context})")
                failed.add(req.id)
                if followed:
                    prompts[req.id] = (prompt, [])
                    follow(req.id, now)
                continue
            hashes = prompt_hashes(req, prompt, before)
            hashes = hashes + reply_hashes(req, prompt, hashes, vocab, followed)
            if followed:
                prompts[req.id] = (prompt, hashes)
            rid = f"sim-{req.id}"
            cached = {name: b.kv.cached_prefix_len(hashes, n) for name, b in backends.items()}
            blocks = hashes[:n // BLOCK_SIZE] if router.policy.needs_blocks else None
            name = router.route(rid, n, limit, cached, blocks=blocks, length=req.output_tokens)
            rec.backend = name
            backend = backends[name]
            job = Job(rec, prompt, min(req.output_tokens, limit), rid, limit=limit, hashes=hashes)
            if backend.timing.request_s > 0:  # on its way to the worker: HTTP, routing, the pipe
                seq += 1
                heapq.heappush(events, (now + backend.timing.request_s, seq, "enqueue", (backend, job)))
                continue
            backend.waiting.append(job)
        elif kind == "enqueue":
            backend, job = what
            backend.waiting.append(job)
        else:
            backend = what
            for job in backend.end_step(now, router):
                if turns:
                    follow(job.record.id, now)
        while not backend.busy and backend.has_work:
            # the steps that change nothing but tokens before the next event, run at once
            until = min(events[0][0] if events else INF, firsts[k][0] if k < len(firsts) else INF)
            now = backend.coast(now, until, router)
            seq += 1
            end = now + backend.start_step(router)
            if (events and events[0][0] <= end) or (k < len(firsts) and firsts[k][0] <= end):
                heapq.heappush(events, (end, seq, "step", backend))
                break
            now = end  # nothing comes before the step's end: it ends here, not through the heap
            for job in backend.end_step(now, router):
                if turns:
                    follow(job.record.id, now)
    return records


def scaled_steps(profile: dict, ratios: dict[str, float]) -> dict:
    """The profile with each named backend's decode, depth and mixed steps scaled by its ratio."""
    out = copy.deepcopy(profile)
    for name, ratio in ratios.items():
        entry = out["backends"][name]
        for step in entry.get("decode", []) + entry.get("contexts", []):
            step["step_ms"] *= ratio
        for step in entry.get("mixed", []) + entry.get("chunks", []):
            step["ms"] *= ratio
    return out


BAND_KEYS = ("makespan", "p95_ttft_ms", "p95_e2el_ms")
# A host's run-to-run drift of the step time: over the 105 GPU runs of results/compiled-gpu (one H200 machine,
# back to back), each run's served TPOT over the simulated one had its 10th-90th percentiles at 0.91 and 1.07
# (results/simulate/vs-measured.json, drift_check); the CPU's, over 52 runs, at 0.86 and 1.13.
DRIFT = 0.08


def band(point: Experiment, policy: str, profile: dict, vocab: int, spread: float, base: dict | None = None,
         believed: dict | None = None, built: wl.Built | None = None, lengths: Lengths | None = None):
    """The same run with every backend's steps `spread` faster and slower than profiled, the router still
    deciding by the profile (or by `believed`): how far the prediction moves within a host's run-to-run drift. A narrow band is
    a firm prediction; a wide one says the load sits at a backend's capacity, where a few percent of step
    time decide whether requests queue. `base`, the run as profiled, lies in it (a tail need not move
    monotonically with the step time). Without `base`: the two runs start at once, each in a process of its
    own where the host can fork (Linux), and what is returned, called with `base`, waits for them and gives
    the band (the base run meanwhile runs here: three runs in the time of about one and a half on two cores)."""
    runs = [later(lambda f=f: run_one(point, policy, scaled_steps(profile, {n: f for n in profile["backends"]}),
                                      vocab, believed=believed or profile, built=built, lengths=lengths,
                                      brief=True))
            for f in (1 - spread, 1 + spread)]

    def done(base: dict) -> dict:
        got = [base] + [r() for r in runs]
        return {"spread": spread, **{k: [min(r[k] for r in got), max(r[k] for r in got)] for k in BAND_KEYS}}
    return done if base is None else done(base)


def later(fn):
    """fn() in a forked child process where the host forks (Linux), else here and now; returns a function that
    gives its result (an error in the child is raised here as one line)."""
    if sys.platform != "linux":
        got = fn()
        return lambda: got
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its result back through the pipe, then out without the parent's cleanup
        try:
            os.close(r)
            try:
                data = pickle.dumps((True, fn()))
            except BaseException as e:  # noqa: BLE001 (any error goes back as the parent's one line)
                data = pickle.dumps((False, str(e) or type(e).__name__))
            with os.fdopen(w, "wb") as f:
                f.write(data)
        finally:
            os._exit(0)
    os.close(w)

    def wait():
        with os.fdopen(r, "rb") as f:
            data = f.read()
        os.waitpid(pid, 0)
        if not data:
            raise SimulateError("a band run ended without a result")
        ok, got = pickle.loads(data)
        if not ok:
            raise SimulateError(got)
        return got
    return wait


def seen(requests: list[wl.Request]) -> Lengths:
    """A length estimate that has seen these requests finish, in send order, as the router sees them: each
    stopped by itself at its length, or at its cap (lengths told: every one)."""
    lengths = Lengths()
    for r in sorted(requests, key=lambda r: (r.parent is not None, r.arrival)):
        cap = r.cap
        lengths.finished(min(r.output_tokens, cap) if cap is not None else r.output_tokens,
                         cap is None or r.output_tokens < cap)
    if lengths.ready:
        lengths.fit()
    return lengths


def simulate(exp: Experiment, profile: dict, policies: list[str], out: Path | None,
             believed: dict | None = None, spread: float = 0.0, built: wl.Built | None = None,
             say=None, warm_lengths: bool = False) -> list[dict]:
    """One summary per (setting, policy), in the order bench runs them. `spread` > 0 adds each one's `band`.
    `built`: the workload built already (an experiment without a sweep). `say(line)` hears what each setting's
    workload selected (also saved as workload.json in `out`, as bench saves it). `warm_lengths`: each run's
    length estimate starts from the lengths of the same workload sent once before (a server that has served
    this traffic before), not from nothing."""
    if exp.workload.arrival not in ("fixed", "poisson", "gamma", "trace"):
        raise SimulateError(f"arrival {exp.workload.arrival!r} cannot be simulated")
    rows = []
    for value, point in exp.points():
        vocab = wl.vocab_of(point.model, point.workload)
        if built is None or exp.sweep is not None:
            built = wl.build_all(point.workload, vocab, point.model, tokens=False)
        warm = seen(built.requests) if warm_lengths else None
        for policy in policies:
            pending = band(point, policy, profile, vocab, spread, None, believed, built, warm) if spread > 0 else None
            summary = run_one(point, policy, profile, vocab, believed=believed, built=built, lengths=warm)
            if pending is not None:
                summary["band"] = pending(summary)
            summary.update(policy=policy, knob=exp.sweep.knob if exp.sweep else None, value=value, simulated=True,
                           **({"warm_lengths": len(warm.seen)} if warm else {}))
            rows.append(summary)
            if out is not None:
                label = policy.replace(":", "-") + ("" if value is None else f"-{exp.sweep.knob}-{value}")
                folder = out / label
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if say is not None:  # after the runs: an error (a profile without step times) stays one line
            if value == exp.points()[0][0] and (line := budget_line(rows[-1]["max_step_tokens"])):
                say(line)
            say(("" if value is None else f"{exp.sweep.knob}={value}: ") + wl.selection_line(built.selection))
        if out is not None:
            name = "workload.json" if value is None else f"workload-{exp.sweep.knob}-{value}.json"
            (out / name).write_text(json.dumps(built.selection, indent=2) + "\n")
    return rows


def measured(folder: Path) -> dict[tuple, dict]:
    """(policy, value) -> the measured aggregate's metrics, where bench has run this experiment."""
    return {(a["policy"], a["value"]): a["metrics"] for a in read_aggregate(folder)}


def table(exp: Experiment, rows: list[dict], real: dict[tuple, dict]):
    """Predicted against measured (where bench has run it), 80 columns wide: short headers, a legend below."""
    from mvllm.tables import decimals, name_column, narrow, number_column, text_column

    spread = next((r["band"]["spread"] for r in rows if "band" in r), None)
    legend = ["batch: predicted batch completion time, s; meas.: bench's mean of it",
              "err: predicted against measured",
              "TTFT p95: predicted p95 time to first token, ms; meas.: bench's mean of it"]
    if spread:
        legend.append(f"band: p95 TTFT with every step ±{100 * spread:.0f}% as long, ms")
    knob = next((r["knob"] for r in rows if r["value"] is not None), None)
    if knob:
        legend.append(f"setting: {knob}")
    legend.append("requests: per backend")
    unbounded = sorted({b for r in rows for b, n in r.get("kv_blocks", {}).items() if n is None})
    if unbounded:
        legend.append(f"prefix cache without bound for {', '.join(unbounded)}: the profile has no kv_blocks")
    t = narrow(f"mvllm simulate: {exp.name} (predicted; measured where bench has run it)", "\n".join(legend))
    name_column(t, "policy")
    if knob:
        text_column(t, "setting")
    for col in ("batch", "meas.", "err", "TTFT\np95", "meas.") + (("band",) if spread else ()):
        number_column(t, col)
    text_column(t, "requests")
    for r in rows:
        m = real.get((r["policy"], r["value"]))
        mk = m["makespan"]["mean"] if m else None
        cells = [r["policy"]] + ([str(r["value"])] if knob else []) + [
            f"{r['makespan']:.{decimals(r['makespan'], 2)}f}", f"{mk:.{decimals(mk, 2)}f}" if mk else "-",
            f"{100 * (r['makespan'] / mk - 1):+.1f}%" if mk else "-",
            f"{r['p95_ttft_ms']:.0f}", f"{m['p95_ttft_ms']['mean']:.0f}" if m else "-"]
        if spread:
            lo, hi = r["band"]["p95_ttft_ms"]
            cells.append(f"{lo:.0f} - {hi:.0f}")
        cells.append(" ".join(f"{k}:{v}" for k, v in r["backend_requests"].items()))
        t.add_row(*cells)
    return t
