"""`mvllm simulate --slo`: the highest load at which a share of the requests (default 99%) meets an SLO, per
policy, found by bisection (GuideLLM's goodput search and vLLM's `bench sweep serve_sla` ask the same of one
server). The load is the experiment's own: its Poisson or gamma `rate`, its fixed `interval` (as 1/interval),
or a trace's `speedup`. A request that failed or missed any bound of the SLO counts against the share.

    search(meets, lo, hi, tolerance)   the bisection, on any pass/fail function of the load
    capacity(exp, profile, ...)        the simulator's answer per policy, every point tried kept
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from mvllm.bench import workload as wl
from mvllm.bench.experiment import Experiment, apply
from mvllm.bench.metrics import meets as meets_slo
from mvllm.errors import MvllmError

DOUBLINGS = 8  # above the first upper bound, at most 2**8 times it is tried before "meets at every load"


class NoLoadMeetsError(MvllmError):
    pass


@dataclass
class Load:
    """How an experiment's load is set: knob, the experiment's own value as a load, and the unit shown."""

    knob: str
    base: float
    unit: str

    def setting(self, load: float) -> float:
        return 1.0 / load if self.knob == "workload.interval" else load


def load_of(exp: Experiment) -> Load:
    w = exp.workload
    if w.arrival in ("poisson", "gamma"):
        return Load("workload.rate", float(w.rate), "requests/s")
    if w.arrival == "fixed":
        return Load("workload.interval", 1.0 / w.interval, "requests/s")
    if w.arrival == "trace":
        return Load("workload.speedup", float(w.speedup), "x the trace's speed")
    raise MvllmError(f"--slo searches the load of poisson, gamma, fixed or trace arrivals, not {w.arrival!r}")


@dataclass
class Search:
    best: float | None = None  # the highest load that passed
    above: float | None = None  # the lowest that failed (None: every load tried passed)
    points: list[tuple[float, bool]] = field(default_factory=list)


def search(meets: Callable[[float], bool], lo: float, hi: float, tolerance: float = 0.05) -> Search:
    """The highest load in [lo, ...) that meets, to within `tolerance` (relative): lo must meet; hi is doubled
    while it meets (at most DOUBLINGS times); then [pass, fail] is halved until fail / pass - 1 <= tolerance.
    A noisy `meets` gives one crossing of the noise band."""
    if not 0 < lo < hi:
        raise MvllmError(f"the search needs 0 < low < high, got {lo:g} and {hi:g}")
    s = Search()

    def tried(load: float) -> bool:
        ok = meets(load)
        s.points.append((load, ok))
        return ok

    if not tried(lo):
        raise NoLoadMeetsError(f"no load meets the SLO: even the lowest tried, {lo:g}, misses it")
    s.best = lo
    for _ in range(DOUBLINGS + 1):
        if not tried(hi):
            s.above = hi
            break
        s.best, hi = hi, hi * 2
    else:
        return s
    while s.above / s.best - 1 > tolerance:
        mid = math.sqrt(s.best * s.above)
        if tried(mid):
            s.best = mid
        else:
            s.above = mid
    return s


def capacity(exp: Experiment, profile: dict, policies: list[str], slo: dict, share: float = 0.99,
             bounds: tuple[float, float] | None = None, tolerance: float = 0.05, say=None,
             done: list | None = None) -> list[dict]:
    """Per policy: {"policy", "capacity" (load, None if it misses even at the low bound), "unit", "points"}.
    Every point is simulated as `mvllm simulate` would the experiment at that load. `bounds` default to a
    quarter of the experiment's load and the load itself. `done` receives each policy's result as it ends."""
    from mvllm.simulate.sim import run_one

    load = load_of(exp)
    lo, hi = bounds or (load.base / 4, load.base)
    out = done if done is not None else []

    def measure(policy: str, rows: list[dict], x: float) -> bool:
        point = apply(exp, load.knob, load.setting(x))
        records: list = []
        summary = run_one(point, policy, profile, wl.vocab_of(point.model, point.workload), keep=records)
        good = sum(r.ok and meets_slo(slo, r) for r in records)
        got = good / max(len(records), 1)
        rows.append({"load": x, "share": got, "goodput": good / summary["duration"] if summary["duration"] else None,
                     "p99_ttft_ms": summary.get("p99_ttft_ms"), "p99_tpot_ms": summary.get("p99_tpot_ms"),
                     "backend_requests": summary["backend_requests"]})
        if say is not None:
            say(f"{policy} at {x:.4g} {load.unit}: {100 * got:.1f}% meet the SLO")
        return got >= share

    for policy in policies:
        rows: list[dict] = []
        result = {"policy": policy, "capacity": None, "unit": load.unit, "knob": load.knob, "slo": slo,
                  "share": share, "tolerance": tolerance, "points": rows, "complete": False}
        out.append(result)

        try:
            found = search(lambda x, p=policy, r=rows: measure(p, r, x), lo, hi, tolerance)
        except NoLoadMeetsError as e:
            result["complete"] = True
            result["error"] = str(e)
            continue
        result.update(capacity=found.best, above=found.above, complete=True)
        rows.sort(key=lambda r: r["load"])
    return out


def draw(results: list[dict], title: str, path) -> None:
    """The share of requests meeting the SLO against the load, one line per policy, its capacity marked."""
    from mvllm.report.style import figure, policy_color, save

    fig, axes = figure(1, 1, width=9, height=5)
    ax = axes[0][0]
    names = [r["policy"] for r in results]
    for r in results:
        pts = sorted(r["points"], key=lambda p: p["load"])
        color = policy_color(r["policy"], names)
        ax.plot([p["load"] for p in pts], [100 * p["share"] for p in pts], "o-", color=color, label=r["policy"])
        if r["capacity"] is not None:
            ax.axvline(r["capacity"], color=color, ls=":", lw=1)
    if results:
        ax.axhline(100 * results[0]["share"], color="k", ls="--", lw=1)
        ax.set_xlabel(f"load ({results[0]['unit']})")
    ax.set_ylabel("requests meeting the SLO (%)")
    ax.set_title(title)
    ax.legend()
    save(fig, path)


def parse_loads(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise MvllmError(f"--loads {text!r}: expected LOW:HIGH, e.g. 1:8") from None
    if not 0 < lo < hi < math.inf:
        raise MvllmError(f"--loads {text!r}: needs 0 < LOW < HIGH")
    return lo, hi


def run_capacity(exp: Experiment, profile: dict, policies: list[str], folder, slo_text: str, share: float,
                 loads: str | None, tolerance: float, console) -> None:
    """The CLI's --slo: search, print one line per policy, write capacity.json and capacity.png. Ctrl-C keeps
    the points simulated so far (marked incomplete); no policy meeting the SLO at the low bound exits 2."""
    import json

    from mvllm.bench.metrics import parse_slo

    slo = parse_slo([slo_text], "--slo")
    if not slo:
        raise MvllmError("--slo names no bound; e.g. --slo \"ttft:2000 tpot:50\"")
    if not 0 < share <= 1:
        raise MvllmError(f"--slo-share must be in (0, 1], not {share:g}")
    if not 0 < tolerance < 1:
        raise MvllmError(f"--tolerance must be in (0, 1), not {tolerance:g}")
    bounds = parse_loads(loads)
    load = load_of(exp)
    results: list[dict] = []
    folder.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        data = {"experiment": exp.name, "slo": slo, "share": share, "tolerance": tolerance, "knob": load.knob,
                "unit": load.unit, "experiment_load": load.base, "policies": results}
        (folder / "capacity.json").write_text(json.dumps(data, indent=2) + "\n")
        bound = " ".join(f"{k.removesuffix('_ms')}≤{v:g} ms" for k, v in slo.items())
        draw(results, f"{exp.name}: {100 * share:g}% of requests within {bound} (simulated)", folder / "capacity.png")

    try:
        capacity(exp, profile, policies, slo, share, bounds, tolerance,
                 lambda line: console.print(f"[dim]{line}[/dim]", highlight=False), results)
    except KeyboardInterrupt:
        write()
        raise MvllmError(f"interrupted; the points simulated so far are in {folder / 'capacity.json'}") from None
    write()
    base = next((r["capacity"] for r in results if r["policy"] == "gpu-only"), None)
    for r in results:
        if r["capacity"] is None:
            console.print(f"{r['policy']}: {r['error']}", highlight=False)
            continue
        more = f" ({100 * (r['capacity'] / base - 1):+.1f}% against gpu-only)" if base and r["policy"] != "gpu-only" else ""
        edge = "" if r["above"] is not None else " (met at every load tried)"
        console.print(f"{r['policy']}: {r['capacity']:.4g} {load.unit}{more}{edge}", highlight=False)
    console.print(f"wrote {folder / 'capacity.json'} and capacity.png", highlight=False)
    if all(r["capacity"] is None for r in results):
        raise MvllmError(f"no policy meets the SLO even at the lowest load tried, {results[0]['points'][0]['load']:g} "
                         f"{load.unit}")
