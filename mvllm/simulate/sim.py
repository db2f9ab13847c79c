"""`mvllm simulate`: an experiment's workload replayed through the real Router and policies, with every
backend modelled from a profile instead of run.

Each backend is eta's timing model (routing/eta.py: `Timing`), stepped through time as the engine steps:
FCFS admission up to max_active; every step gives one token to each running request, and a request's first
token comes at the end of the step that admits it. A backend profiled with overlap (CUDA's default) schedules
each step as the one before it starts, counting the tokens in flight: a request that arrives while a step
runs joins the step after next, and a slot freed by a request's last token is filled in the next step as in
the plain loop. A step of b requests takes the profile's decode step
time at batch b, plus the uncached prompt tokens it admits at the profile's prefill rate. Cached prefixes
are full blocks of the engine's BLOCK_SIZE found by the engine's chain of block hashes (warmed as the bench
warms them; no eviction is modelled). The router sees the events a worker would send (admitted, token,
finished), so mixed, eta and split:K decide as they would in `mvllm serve`. Requests run to max_tokens
(the bench ignores EOS). Output: one `summary.json` per policy and setting with bench's keys, in seconds
of simulated time.
"""

from __future__ import annotations

import copy
import heapq
import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from mvllm.backends.spec import default_backends, parse_backends
from mvllm.bench import workload as wl
from mvllm.bench.experiment import Experiment
from mvllm.bench.metrics import RequestRecord, summarize
from mvllm.engine.block_manager import BLOCK_SIZE, block_hashes
from mvllm.errors import MvllmError
from mvllm.routing.eta import Timing
from mvllm.routing.rates import rates_as_served
from mvllm.routing.router import Router


class SimulateError(MvllmError):
    pass


@dataclass(slots=True)
class Job:
    record: RequestRecord
    prompt: list[int]
    max_tokens: int
    rid: str
    cached: int = 0
    generated: int = 0


@dataclass
class Backend:
    name: str
    timing: Timing
    waiting: deque = field(default_factory=deque)
    running: list = field(default_factory=list)
    blocks: set = field(default_factory=set)
    busy: bool = False
    planned: list = field(default_factory=list)  # overlap: the next step's requests, scheduled as this one began
    planned_prefill: float = 0.0

    def cached_prefix_len(self, tokens: list[int]) -> int:
        n = 0
        for h in block_hashes(tokens):
            if h not in self.blocks:
                break
            n += BLOCK_SIZE
        return n

    def cache(self, tokens: list[int]) -> None:
        self.blocks.update(block_hashes(tokens))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.planned)


    def admit(self, router: Router, into: list) -> float:
        """Move waiting requests into `into` while it has room; returns their prefill's extra seconds."""
        prefill = 0.0
        while self.waiting and len(into) < self.timing.max_active:
            job = self.waiting.popleft()
            job.cached = min(self.cached_prefix_len(job.prompt), len(job.prompt) - 1)
            prefill += self.timing.prefill_s(len(job.prompt) - job.cached)
            router.on_scheduled(self.name, job.rid, job.cached)
            into.append(job)
        return prefill

    def start_step(self, router: Router) -> float:
        """Admit what fits, return the step's duration; the caller ends it with `end_step`. With overlap the
        step runs what was scheduled as the step before it began (if anything was: an idle engine schedules
        at once), and the step after it is scheduled now, without the requests this one ends."""
        if self.planned:
            self.running, prefill = self.planned, self.planned_prefill
        else:
            prefill = self.admit(router, self.running)
        self.planned, self.planned_prefill = [], 0.0
        if self.timing.overlap:
            self.planned = [job for job in self.running if job.generated + 1 < job.max_tokens]
            self.planned_prefill = self.admit(router, self.planned)
        self.busy = True
        return self.timing.step_s[len(self.running) - 1] + prefill

    def end_step(self, now: float, router: Router) -> None:
        for job in list(self.running):
            if job.generated == 0:
                job.record.first_token, job.record.cached_tokens = now, job.cached
                self.cache(job.prompt)
            job.generated += 1
            job.record.chunks.append(now)
            router.on_tokens(self.name, job.rid, 1)
            if job.generated >= job.max_tokens:
                job.record.finish, job.record.output_tokens = now, job.generated
                router.on_finished(self.name, job.rid)
                self.running.remove(job)
        self.busy = False


def timings(rates: dict[str, dict], names: list[str]) -> dict[str, Timing]:
    out = {}
    for name in names:
        timing = Timing.from_profile(rates.get(name, {}))
        if timing is None:
            raise SimulateError(f"the profile has no decode step times for backend {name!r}; the simulator "
                                "needs a profile made by `mvllm profile`")
        out[name] = timing
    return out


def run_one(exp: Experiment, policy: str, profile: dict, vocab: int, keep: list | None = None,
            believed: dict | None = None) -> dict:
    """One simulated run; `keep`, if given, receives the per-request records. `believed`: the profile the
    router decides by, where it differs from the one the backends run by (the model's error)."""
    text = default_backends() if exp.backends == "default" else exp.backends
    specs = parse_backends(text, exp.max_active, check_devices=False)
    rates = rates_as_served(profile, {s.name: s.max_active for s in specs})
    backends = {name: Backend(name, t) for name, t in timings(rates, [s.name for s in specs]).items()}
    router = Router(list(backends), policy, rates_as_served(believed, {s.name: s.max_active for s in specs}) if believed else rates)
    prefix, requests = wl.build(exp.workload, vocab)
    if exp.workload.warm and prefix:
        for b in backends.values():
            b.cache(prefix)
    events: list[tuple[float, int, str, object]] = [(r.arrival, i, "arrive", r) for i, r in enumerate(requests)]
    heapq.heapify(events)
    seq, records = len(events), []
    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == "arrive":
            rec = RequestRecord(what.id, what.arrival, len(what.prompt), sent=what.arrival)
            records.append(rec)
            rid = f"sim-{what.id}"
            cached = {n: b.cached_prefix_len(what.prompt) for n, b in backends.items()}
            name = router.route(rid, len(what.prompt), what.output_tokens, cached)
            rec.backend = name
            backend = backends[name]
            job = Job(rec, what.prompt, what.output_tokens, rid)
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
            backend.end_step(now, router)
        if not backend.busy and backend.has_work:
            seq += 1
            heapq.heappush(events, (now + backend.start_step(router), seq, "step", backend))
    router.close()
    if keep is not None:
        keep.extend(records)
    return summarize(records)


def scaled_steps(profile: dict, ratios: dict[str, float]) -> dict:
    """The profile with each named backend's decode and mixed steps scaled by its ratio."""
    out = copy.deepcopy(profile)
    for name, ratio in ratios.items():
        entry = out["backends"][name]
        for step in entry.get("decode", []):
            step["step_ms"] *= ratio
        for step in entry.get("mixed", []):
            step["ms"] *= ratio
    return out


BAND_KEYS = ("makespan", "p95_ttft_ms", "p95_e2el_ms")
# A host's run-to-run drift of the step time: over the 105 GPU runs of results/compiled-gpu (one H200 machine,
# back to back), each run's served TPOT over the simulated one had its 10th-90th percentiles at 0.91 and 1.07
# (results/simulate/vs-measured.json, drift_check); the CPU's, over 52 runs, at 0.86 and 1.13.
DRIFT = 0.08


def band(point: Experiment, policy: str, profile: dict, vocab: int, spread: float, base: dict,
         believed: dict | None = None) -> dict:
    """The same run with every backend's steps `spread` faster and slower than profiled, the router still
    deciding by the profile (or by `believed`): how far the prediction moves within a host's run-to-run drift. A narrow band is
    a firm prediction; a wide one says the load sits at a backend's capacity, where a few percent of step
    time decide whether requests queue. `base`, the run as profiled, lies in it (a tail need not move
    monotonically with the step time)."""
    runs = [base] + [run_one(point, policy, scaled_steps(profile, {n: f for n in profile["backends"]}), vocab,
                             believed=believed or profile) for f in (1 - spread, 1 + spread)]
    return {"spread": spread, **{k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in BAND_KEYS}}


def simulate(exp: Experiment, profile: dict, policies: list[str], out: Path | None,
             believed: dict | None = None, spread: float = 0.0) -> list[dict]:
    """One summary per (setting, policy), in the order bench runs them. `spread` > 0 adds each one's `band`."""
    if exp.workload.arrival not in ("fixed", "poisson", "gamma"):
        raise SimulateError(f"arrival {exp.workload.arrival!r} cannot be simulated")
    rows = []
    for value, point in exp.points():
        vocab = wl.vocab_of(point.model, point.workload)
        for policy in policies:
            summary = run_one(point, policy, profile, vocab, believed=believed)
            if spread > 0:
                summary["band"] = band(point, policy, profile, vocab, spread, summary, believed)
            summary.update(policy=policy, knob=exp.sweep.knob if exp.sweep else None, value=value, simulated=True)
            rows.append(summary)
            if out is not None:
                label = policy.replace(":", "-") + ("" if value is None else f"-{exp.sweep.knob}-{value}")
                folder = out / label
                folder.mkdir(parents=True, exist_ok=True)
                (folder / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return rows


def measured(folder: Path) -> dict[tuple, dict]:
    """(policy, value) -> the measured aggregate's metrics, where bench has run this experiment."""
    path = folder / "aggregate.json"
    if not path.is_file():
        return {}
    return {(a["policy"], a["value"]): a["metrics"] for a in json.loads(path.read_text())}


def table(exp: Experiment, rows: list[dict], real: dict[tuple, dict]):
    from rich.table import Table

    t = Table(title=f"mvllm simulate: {exp.name} (predicted; measured where bench has run it)")
    spread = next((r["band"]["spread"] for r in rows if "band" in r), None)
    cols = ["policy", "setting", "batch completion s", "measured s", "error", "p95 TTFT ms", "measured ms",
            "requests per backend"]
    if spread:
        cols.insert(6, f"p95 TTFT at ±{100 * spread:.0f}% steps")
    for col in cols:
        t.add_column(col, justify="left" if col in ("policy", "setting", "requests per backend") else "right")
    for r in rows:
        m = real.get((r["policy"], r["value"]))
        mk = m["makespan"]["mean"] if m else None
        cells = [r["policy"], "" if r["value"] is None else f"{r['knob']}={r['value']}", f"{r['makespan']:.2f}",
                 f"{mk:.2f}" if mk else "-", f"{100 * (r['makespan'] / mk - 1):+.1f}%" if mk else "-",
                 f"{r['p95_ttft_ms']:.0f}", f"{m['p95_ttft_ms']['mean']:.0f}" if m else "-",
                 ", ".join(f"{k} {v}" for k, v in r["backend_requests"].items())]
        if spread:
            lo, hi = r["band"]["p95_ttft_ms"]
            cells.insert(6, f"{lo:.0f}-{hi:.0f}")
        t.add_row(*cells)
    return t
