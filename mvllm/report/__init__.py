"""`mvllm report`: every chart and table of an experiment, rebuilt from its result files alone."""

from __future__ import annotations

from pathlib import Path

from mvllm.bench.results import ResultsError, experiments_in, write_json
from mvllm.report import charts, detail, traffic
from mvllm.report.load import Results, load
from mvllm.report.oracle import oracle
from mvllm.report.summary import markdown


def report(folder: Path, out: Path | None = None, slo: dict | None = None) -> list[Path]:
    """Write the charts and summary.md of one experiment (and oracle.json where static splits ran);
    returns the files written. `slo` ({"ttft_ms": 500, ...}): goodput recomputed under it for every run."""
    res = load(folder, slo)
    out = out or folder / "report"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    notes: list[str] = []

    def path(name: str) -> Path:
        p = out / f"{name}.png"
        written.append(p)
        return p

    charts.makespan(res, path("makespan"))
    workloads(res, path, notes)
    for v in res.values:
        sfx = charts.suffix(res, v)
        charts.latency(res, path(f"latency{sfx}"), v)
        traffic.cdf(res, path(f"cdf{sfx}"), v)
        detail.timeline(res, path(f"timeline{sfx}"), v)
        p = out / f"hit_rate{sfx}.png"
        if traffic.hit_rate(res, p, v):
            written.append(p)
        else:
            known = any(r.summary.get("hit_rate") is not None for r in res.select(value=v))
            note = "no hit-rate chart: " + ("each backend's prefix hit rate stays the same over time (the tables "
                                            "give it)" if known else "no run reported cached tokens")
            notes += [] if note in notes else [note]
        p = out / f"scores{sfx}.png"
        if detail.scores(res, p, v):
            written.append(p)
        else:
            notes.append("no scores chart" + (f" for {res.knob} = {v}" if res.knob else "") +
                         ": no policy here logged router scores (only `mixed` does)")
    if res.knob:
        charts.sweep(res, path("sweep"))
    oracles = oracle(res)
    if oracles:
        charts.oracle(res, oracles, path("oracle"))
        write_json(out / "oracle.json", oracles)
        written.append(out / "oracle.json")
    md = out / "summary.md"
    md.write_text(markdown(res, [c for c in written if c.suffix == ".png"], notes, oracles))
    return [md, *written]


def workloads(res: Results, path, notes: list[str]) -> None:
    """The workload chart, from one run (one per value where the sweep changes the workload), where lengths or
    arrival gaps vary."""
    per_value = (res.knob or "").startswith("workload.")
    for v in res.values if per_value else [res.first.value]:
        run = res.select(value=v)[0]
        if traffic.workload_varies(run):
            traffic.workload(res, path(f"workload{charts.suffix(res, v) if per_value else ''}"), run)
            continue
        df = run.requests
        notes.append(f"no workload chart{f' for {res.knob} = {v}' if per_value else ''}: every request has "
                     f"{df['prompt_tokens'].iloc[0]} prompt tokens and {traffic.outputs(df)[0].iloc[0]} output "
                     "tokens, sent at even gaps")


def report_all(folder: Path | None = None, out: Path | None = None, root: Path = Path("results"),
               slo: dict | None = None) -> list[Path]:
    """One experiment folder, or every experiment under results/ (each into its own report/)."""
    if folder is not None:
        return report(folder, out, slo)
    found = experiments_in(root)
    if not found:
        raise ResultsError(f"no experiment results under {root}/; run `mvllm bench` first")
    written = []
    for f in found:
        written += report(f, out / f.relative_to(root) if out else None, slo)
    return written
