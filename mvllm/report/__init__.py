"""`mvllm report`: every chart and table of an experiment, rebuilt from its result files alone."""

from __future__ import annotations

from pathlib import Path

from mvllm.bench.results import ResultsError, experiments_in, write_json
from mvllm.report import charts, detail
from mvllm.report.load import load
from mvllm.report.oracle import oracle
from mvllm.report.summary import markdown


def report(folder: Path, out: Path | None = None) -> list[Path]:
    """Write the charts and summary.md of one experiment (and oracle.json where static splits ran);
    returns the files written."""
    res = load(folder)
    out = out or folder / "report"
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    notes: list[str] = []

    def path(name: str) -> Path:
        p = out / f"{name}.png"
        written.append(p)
        return p

    charts.makespan(res, path("makespan"))
    for v in res.values:
        sfx = charts.suffix(res, v)
        charts.latency(res, path(f"latency{sfx}"), v)
        detail.timeline(res, path(f"timeline{sfx}"), v)
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


def report_all(folder: Path | None = None, out: Path | None = None, root: Path = Path("results")) -> list[Path]:
    """One experiment folder, or every experiment under results/ (each into its own report/)."""
    if folder is not None:
        return report(folder, out)
    found = experiments_in(root)
    if not found:
        raise ResultsError(f"no experiment results under {root}/; run `mvllm bench` first")
    written = []
    for f in found:
        written += report(f, out / f.relative_to(root) if out else None)
    return written
