"""What a user watches: a live line per run while it replays, and the final table over runs."""

from __future__ import annotations

import time

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from mvllm.bench.metrics import RequestRecord, percentile
from mvllm.bench.results import BASELINE
from mvllm.tables import (
    decimals,
    name_column,
    narrow,
    number_column,
    pct_change,
    plus_minus,
    short,
    text_column,
)

COLUMNS = (  # (metric, header, scale, decimals, legend)
    ("makespan", "batch", 1.0, 2, "batch: batch completion time, s"),
    ("output_throughput", "tok/s", 1.0, 1, "tok/s: output tokens per second"),
    ("median_ttft_ms", "TTFT\np50", 1.0, 0, "TTFT p50, p95: time to first token, median and p95, ms"),
    ("p95_ttft_ms", "TTFT\np95", 1.0, 0, ""),
    ("median_e2el_ms", "E2EL\np50", 1e-3, 2, "E2EL p50, p95: end-to-end latency, s"),
    ("p95_e2el_ms", "E2EL\np95", 1e-3, 2, ""),
)
GOODPUT = ("request_goodput", "good\nreq/s", 1.0, 2, "good req/s: requests per second within every SLO")


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


def backend_hits(metrics: dict) -> list[str]:
    """Each backend's mean hit rate over runs in percent, from the aggregate's backend_hit_rate.NAME metrics."""
    prefix = "backend_hit_rate."
    return [f"{k[len(prefix):]}:{100 * m['mean']:.1f}" for k, m in metrics.items()
            if k.startswith(prefix) and m["mean"] is not None]


def _cell(metric: dict | None, change: float | None, scale: float, digits: int) -> str:
    if metric is None:
        return "-"
    mean = metric["mean"] * scale
    d = decimals(mean, digits)  # the std with the mean's decimals
    text = plus_minus(f"{mean:.{d}f}", f"{metric['std'] * scale:.{d}f}" if metric["n"] > 1 else None)
    if change is not None:
        text += "\n" + pct_change(change)
    return text


def table(rows: list[dict], title: str) -> Group:
    """Means over runs (± standard deviation below, then the change against gpu-only; goodput where SLOs were
    given), then where the requests went: the prefix hit rate (overall, then per backend) and the number of
    requests each backend served in each run, as in the reference experiment's table. Two tables so that each
    fits 80 columns: short headers, their units in the legend below each; runs only where they differ."""
    knob = next((r["knob"] for r in rows if r.get("knob")), None)
    columns = COLUMNS + ((GOODPUT,) if any(GOODPUT[0] in r["metrics"] for r in rows) else ())
    hit = any("hit_rate" in r["metrics"] for r in rows)
    runs = {r["runs"] for r in rows}
    legend = ["mean over runs" + (f" ({next(iter(runs))} each)" if len(runs) == 1 else "") + ", ± standard "
              "deviation below, then the change of the mean against gpu-only", *(c[4] for c in columns if c[4])]
    if knob:
        legend.append(f"{short(knob)}: {knob}")
    means = narrow(title, "\n".join(legend), show_lines=True)  # rows of several lines: a blank line between
    where = narrow("where the requests went", "\n".join(
        (["hit %: prefix cache hit rate (mean over runs), overall then per backend"] if hit else [])
        + ["requests: requests per backend, one line per run"]), show_lines=True)
    for t in (means, where):
        if knob:
            text_column(t, short(knob))
        name_column(t, "policy")
        if len(runs) > 1:
            number_column(t, "runs")
    for _, header, _, _, _ in columns:
        number_column(means, header)
    if hit:
        number_column(where, "hit %")
    text_column(where, "requests")
    for r in rows:
        first = ([str(r["value"])] if knob else []) + [r["policy"]] + ([str(r["runs"])] if len(runs) > 1 else [])
        cells = list(first)
        for key, _, scale, digits, _ in columns:
            change = r["change_vs_gpu_only"].get(key) if r["policy"] != BASELINE else None
            cells.append(_cell(r["metrics"].get(key), change, scale, digits))
        means.add_row(*cells)
        cells = list(first)
        if hit:
            m = r["metrics"].get("hit_rate")
            cells.append("-" if m is None else "\n".join([f"{100 * m['mean']:.1f}", *backend_hits(r["metrics"])]))
        cells.append("\n".join(" ".join(f"{k}:{v}" for k, v in b.items()) or "-" for b in r["backend_requests"]))
        where.add_row(*cells)
    return Group(means, where)

