"""What a user watches: a live line per run while it replays, and the final table over runs."""

from __future__ import annotations

import time

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from mvllm.bench.metrics import RequestRecord, percentile
from mvllm.bench.results import BASELINE

COLUMNS = (  # (metric, header, scale, format)
    ("makespan", "batch\ncompletion s", 1.0, "{:.2f}"),
    ("output_throughput", "output\ntok/s", 1.0, "{:.1f}"),
    ("median_ttft_ms", "TTFT\nmedian ms", 1.0, "{:.0f}"),
    ("p95_ttft_ms", "TTFT\np95 ms", 1.0, "{:.0f}"),
    ("median_e2el_ms", "E2EL\nmedian s", 1e-3, "{:.2f}"),
    ("p95_e2el_ms", "E2EL\np95 s", 1e-3, "{:.2f}"),
    ("hit_rate", "prefix\nhit rate", 100.0, "{:.1f}%"),
)
GOODPUT = ("request_goodput", "goodput\nreq/s", 1.0, "{:.2f}")  # a column only where SLOs were given


class RunDisplay:
    """`with RunDisplay(console, label, total) as d:` then `d.done(record)` as requests finish."""

    def __init__(self, console: Console, label: str, total: int):
        self.console, self.label, self.total = console, label, total
        self.records: list[RequestRecord] = []
        self.start = time.monotonic()
        self.live = Live(self.render(), console=console, refresh_per_second=4, transient=True)

    def render(self) -> Text:
        ok = [r for r in self.records if r.ok]
        failed = len(self.records) - len(ok)
        ttft = f"{1000 * percentile([r.ttft for r in ok], 50):.0f} ms" if ok else "-"
        text = Text.assemble((self.label, "bold"), f"  requests {len(self.records)}/{self.total}",
                             (f"  failed {failed}" if failed else "", "red"), f"  median TTFT {ttft}",
                             f"  {time.monotonic() - self.start:.1f} s")
        return text

    def done(self, rec: RequestRecord) -> None:
        self.records.append(rec)
        self.live.update(self.render())

    def __enter__(self) -> RunDisplay:
        self.start = time.monotonic()
        self.live.start()
        return self

    def __exit__(self, *exc) -> None:
        self.live.stop()


def percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def run_line(label: str, s: dict) -> str:
    per = ", ".join(f"{k} {v}" for k, v in s.get("backend_requests", {}).items()) or "none"
    ttft = s.get("median_ttft_ms")
    ttft = f"{ttft:.0f} ms" if ttft is not None else "-"
    failed = f", [red]{s['failed']} failed[/red]" if s.get("failed") else ""
    each = ", ".join(f"{k} {percent(v)}" for k, v in (s.get("backend_hit_rate") or {}).items())
    hits = f"; prefix hit rate {percent(s['hit_rate'])}" + (f" ({each})" if each else "") if "hit_rate" in s else ""
    good = ""
    if s.get("slo"):
        slo = ", ".join(f"{k.removesuffix('_ms')} {v:g} ms" for k, v in s["slo"].items())
        good = (f"; goodput {s['request_goodput'] or 0:.2f} req/s ({s['good_requests']} of {s['completed']} "
                f"within {slo})")
    return (f"{label}: batch completion {s['makespan']:.2f} s, median TTFT {ttft}, "
            f"{s['output_throughput'] or 0:.1f} output tok/s; requests per backend: {per}{hits}{good}{failed}")


def backend_hits(metrics: dict) -> str:
    """Each backend's mean hit rate over runs, from the aggregate's backend_hit_rate.NAME metrics."""
    prefix = "backend_hit_rate."
    return ", ".join(f"{k[len(prefix):]} {percent(m['mean'])}" for k, m in metrics.items()
                     if k.startswith(prefix)) or "-"


def _cell(metric: dict | None, change: float | None, scale: float, fmt: str) -> str:
    if metric is None:
        return "-"
    text = fmt.format(metric["mean"] * scale)
    if metric["n"] > 1:
        text += " ± " + fmt.format(metric["std"] * scale)
    if change is not None:
        text += f"\n{change:+.1f}%"
    return text


def table(rows: list[dict], title: str) -> Table:
    """Means over runs (± standard deviation), change against gpu-only in brackets, the prefix hit rate
    (overall, then per backend; goodput where SLOs were given), and the number of requests each backend
    served in each run, as in the reference experiment's table."""
    knob = next((r["knob"] for r in rows if r.get("knob")), None)
    columns = COLUMNS + ((GOODPUT,) if any(GOODPUT[0] in r["metrics"] for r in rows) else ())
    t = Table(title=title, title_justify="left", caption="mean ± standard deviation over runs; change of the "
              "mean against gpu-only below", caption_justify="left")
    if knob:
        t.add_column(knob)
    t.add_column("policy")
    t.add_column("runs", justify="right")
    for _, header, _, _ in columns:
        t.add_column(header, justify="right")
    t.add_column("requests per\nbackend, per run")
    for r in rows:
        cells = [str(r["value"])] if knob else []
        cells += [r["policy"], str(r["runs"])]
        for key, _, scale, fmt in columns:
            change = r["change_vs_gpu_only"].get(key) if r["policy"] != BASELINE and key != "hit_rate" else None
            cells.append(_cell(r["metrics"].get(key), change, scale, fmt))
            if key == "hit_rate" and len(hits := backend_hits(r["metrics"])) > 1:
                cells[-1] += "\n" + hits.replace(", ", "\n")
        cells.append("\n".join(", ".join(f"{k} {v}" for k, v in b.items()) or "-" for b in r["backend_requests"]))
        t.add_row(*cells)
    return t
