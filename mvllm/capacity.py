"""The SLO capacity search `mvllm simulate --slo` and `mvllm bench --slo` both run: per policy, the highest load
at which a share of the requests (default 99%) meets an SLO, found by bisection (GuideLLM's goodput search and
vLLM's `bench sweep serve_sla` ask the same of one server). The load is the experiment's own: its Poisson or
gamma `rate`, its fixed `interval` (as 1/interval), or a trace's `speedup`. A request that failed or missed any
bound of the SLO counts against the share. What measures a point is the caller's: the simulator
(simulate/capacity.py) or a live bench run (bench/capacity.py).

    search(meets, lo, hi, tolerance)            the bisection, on any pass/fail function of the load
    search_policies(exp, policies, measure, ..) each policy's search, every point tried kept
    run_capacity(exp, policies, folder, ...)    the CLI's answer: capacity.json, capacity.png, a line a policy
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mvllm.bench.experiment import Experiment, apply
from mvllm.errors import MvllmError
from mvllm.slo import parse_slo

DOUBLINGS = 8  # above the first upper bound, at most 2**8 times it is tried before "meets at every load"

# measure(policy, load, the experiment at that load) -> the point's row: "share" (of all requests, meeting
# the SLO), "goodput", "p99_ttft_ms", "p99_tpot_ms", "backend_requests", and whatever else the measurer keeps
Measure = Callable[[str, float, Experiment], dict]


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


@dataclass
class Goal:
    """What the CLI's --slo, --slo-share, --loads and --tolerance ask."""

    slo: dict[str, float]
    share: float = 0.99
    bounds: tuple[float, float] | None = None  # None: a quarter of the experiment's load, and the load
    tolerance: float = 0.05


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


def parse_goal(slo_text: str, share: float, loads: str | None, tolerance: float) -> Goal:
    """The CLI's options, each refused in one line naming it."""
    slo = parse_slo([slo_text], "--slo")
    if not slo:
        raise MvllmError("--slo names no bound; e.g. --slo \"ttft:2000 tpot:50\"")
    if not 0 < share <= 1:
        raise MvllmError(f"--slo-share must be in (0, 1], not {share:g}")
    if not 0 < tolerance < 1:
        raise MvllmError(f"--tolerance must be in (0, 1), not {tolerance:g}")
    return Goal(slo, share, parse_loads(loads), tolerance)


def search_policies(exp: Experiment, policies: list[str], measure: Measure, goal: Goal,
                    on_point: Callable[[str, dict], None] | None = None, done: list | None = None) -> list[dict]:
    """Per policy: {"policy", "capacity" (load, None if it misses even at the low bound), "unit", "points",
    "complete"}; every point is `measure` of the experiment with its load knob set (`apply`). `done` receives
    each policy's result as it starts (its points as they come: an interruption keeps them); `on_point(policy,
    row)` hears each point."""
    load = load_of(exp)
    lo, hi = goal.bounds or (load.base / 4, load.base)
    out = done if done is not None else []
    for policy in policies:
        rows: list[dict] = []
        result = {"policy": policy, "capacity": None, "unit": load.unit, "knob": load.knob, "slo": goal.slo,
                  "share": goal.share, "tolerance": goal.tolerance, "points": rows, "complete": False}
        out.append(result)

        def meets(x: float, policy: str = policy, rows: list = rows) -> bool:
            row = {"load": x, **measure(policy, x, apply(exp, load.knob, load.setting(x)))}
            rows.append(row)
            if on_point is not None:
                on_point(policy, row)
            return row["share"] >= goal.share

        try:
            found = search(meets, lo, hi, goal.tolerance)
        except NoLoadMeetsError as e:
            result.update(complete=True, error=str(e))
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


def run_capacity(exp: Experiment, policies: list[str], folder: Path, goal: Goal, measure: Measure, console,
                 how: str = "simulated", extra: dict | None = None, quiet: bool = False) -> dict:
    """The CLI's --slo: search, print a line per point (unless quiet) and per policy, write capacity.json (after
    every point: "complete" false until the search ends) and capacity.png. `how` ("simulated", "measured") is
    said in the chart's title and the messages; `extra` joins capacity.json's top level. An interruption or an
    error keeps the points so far (marked incomplete) and ends in one line; no policy meeting the SLO at the
    low bound exits 2. Returns what capacity.json holds."""
    load = load_of(exp)
    results: list[dict] = []
    folder.mkdir(parents=True, exist_ok=True)
    data = {"experiment": exp.name, "slo": goal.slo, "share": goal.share, "tolerance": goal.tolerance,
            "knob": load.knob, "unit": load.unit, "experiment_load": load.base, **(extra or {}),
            "complete": False, "policies": results}
    path = folder / "capacity.json"

    def write(complete: bool, chart: bool = True) -> None:
        data["complete"] = complete
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        if chart:
            bound = " ".join(f"{k.removesuffix('_ms')}≤{v:g} ms" for k, v in goal.slo.items())
            draw(results, f"{exp.name}: {100 * goal.share:g}% of requests within {bound} ({how})",
                 folder / "capacity.png")

    def point(policy: str, row: dict) -> None:
        write(False, chart=False)
        if not quiet:
            console.print(f"[dim]{policy} at {row['load']:.4g} {load.unit}: {100 * row['share']:.1f}% meet the "
                          f"SLO[/dim]", highlight=False)

    try:
        search_policies(exp, policies, measure, goal, point, results)
    except KeyboardInterrupt:
        write(False)
        raise MvllmError(f"interrupted; the points {how} so far are in {path}") from None
    except MvllmError as e:
        write(False)
        raise MvllmError(f"{e}; the points {how} before it are in {path}") from None
    write(True)
    base = next((r["capacity"] for r in results if r["policy"] == "gpu-only"), None)
    for r in results:
        if r["capacity"] is None:
            console.print(f"{r['policy']}: {r['error']}", highlight=False)
            continue
        more = f" ({100 * (r['capacity'] / base - 1):+.1f}% against gpu-only)" if base and r["policy"] != "gpu-only" else ""
        edge = "" if r["above"] is not None else " (met at every load tried)"
        lagged = sum(bool((p.get("client") or {}).get("saturated")) for p in r["points"])
        lag = f"; the client lagged at {lagged} of its {len(r['points'])} points" if lagged else ""
        console.print(f"{r['policy']}: {r['capacity']:.4g} {load.unit}{more}{edge}{lag}", highlight=False)
    console.print(f"wrote {path} and capacity.png", highlight=False)
    if all(r["capacity"] is None for r in results):
        raise NoLoadMeetsError(f"no policy meets the SLO even at the lowest load tried, "
                               f"{results[0]['points'][0]['load']:g} {load.unit}")
    return data
