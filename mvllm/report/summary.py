"""The markdown summary: what was run, where, the table over runs, every run, and the charts."""

from __future__ import annotations

from pathlib import Path

from mvllm.bench.metrics import buckets
from mvllm.bench.results import BASELINE, aggregate, read_json
from mvllm.report.load import Results
from mvllm.report.style import devices
from mvllm.tables import short

COLUMNS = (  # (metric, header, scale, digits): short headers, their units in LEGEND below each table
    ("makespan", "batch", 1.0, 2),
    ("output_throughput", "tok/s", 1.0, 1),
    ("median_ttft_ms", "TTFT p50", 1.0, 0),
    ("p95_ttft_ms", "TTFT p95", 1.0, 0),
    ("median_e2el_ms", "E2EL p50", 1e-3, 2),
    ("p95_e2el_ms", "E2EL p95", 1e-3, 2),
    ("median_tpot_ms", "TPOT p50", 1.0, 1),
    ("hit_rate", "hit %", 100.0, 1),
)
GOODPUT = ("request_goodput", "goodput", 1.0, 2)  # a column where SLOs were given
LATENCY = ("median_ttft_ms", "p95_ttft_ms", "median_e2el_ms", "p95_e2el_ms", "median_tpot_ms")
LEGEND = ("batch: batch completion time, s; tok/s: output tokens per second; TTFT p50, p95: time to first token, "
          "median and 95th percentile, ms; E2EL: end-to-end latency, s; TPOT p50: median time per output token, "
          "ms; hit %: prefix cache hit rate")
NO_CHANGE = ("hit_rate",)  # a change in percent of a percentage reads wrong; the values are beside each other


def _fmt(x, scale: float, digits: int) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "-"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _hits(rates: dict) -> str:
    return ", ".join(f"{k} {'-' if v is None else _pct(v)}" for k, v in rates.items()) or "-"


def _per_backend(metrics: dict, name: str, digits: int = 0) -> str:
    """Each backend's mean over runs of a per-backend metric (the aggregate's NAME.BACKEND)."""
    got = {k.split(".", 1)[1]: m["mean"] for k, m in metrics.items() if k.startswith(name + ".")}
    return ", ".join(f"{b} {v:.{digits}f}" for b, v in got.items()) or "-"


def _mean_hits(metrics: dict) -> str:
    """Each backend's mean hit rate over runs (the aggregate's backend_hit_rate.NAME)."""
    return _hits({k.split(".", 1)[1]: m["mean"] for k, m in metrics.items() if k.startswith("backend_hit_rate.")})


def _mean(m: dict | None, scale: float, digits: int) -> str:
    if m is None:
        return "-"
    return _fmt(m["mean"], scale, digits) + ("±" + _fmt(m["std"], scale, digits) if m["n"] > 1 else "")


def _change(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}"


def _table(res: Results, head: list[str], rows: list[dict], cells) -> list[str]:
    """A markdown table of cells(row) per aggregate row; in a sweep, a row naming each value (suffix tokens =
    20) above its rows, in the first column, instead of a column of its own: the table stays narrow."""
    lines = [_row(head), _row(["---"] * len(head))]
    value = object()
    for r in rows:
        if res.knob and r["value"] != value:
            value = r["value"]
            lines.append(_row([f"**{short(res.knob)} = {value}**"] + [""] * (len(head) - 1)))
        lines.append(_row(cells(r)))
    return lines


def _selection(res: Results) -> dict:
    """What bench's workload selected (workload.json: in the experiment folder, by sweep value for a sweep, or
    in a run's folder); {} where neither is there."""
    for folder, by_value in ((res.first.folder, False), (res.folder, res.knob is not None)):
        if folder is not None and (folder / "workload.json").is_file():
            sel = read_json(folder / "workload.json")
            return (sel.get(str(res.first.value)) or {}) if by_value else sel
    return {}


def _workload(res: Results) -> str:
    """The workload in one line: the reference's own words for kind prefix, else the selection bench saved
    (workload.json) or the experiment's settings."""
    w = res.first.summary.get("workload", {})
    if w.get("kind", "prefix") == "prefix":
        return (f"{w.get('requests')} requests of {w.get('prefix_tokens')} shared-prefix + "
                f"{w.get('suffix_tokens')} unique tokens, {w.get('output_tokens')} output tokens (EOS ignored), "
                f"{w.get('arrival')} arrivals" + (f" every {w.get('interval')} s" if w.get("arrival") == "fixed" else
                                                  f" at {w.get('rate')} req/s, burstiness {w.get('burstiness')}")
                + f", seed {w.get('seed')}; prefix warmed: {'yes' if w.get('warm') else 'no'}")
    sel = _selection(res)
    text = f"kind {w.get('kind')}" + (f" ({w['path']})" if w.get("path") else "")
    if not sel:
        return text + f", {w.get('requests')} requests, {w.get('arrival')} arrivals, lengths {w.get('lengths')}"

    def q(d: dict) -> str:
        return "-" if not d else f"p50 {d.get('p50', 0):.0f}, p99 {d.get('p99', 0):.0f}, max {d.get('max', 0):.0f}"

    rate = sel.get("rate_per_s")
    if res.knob:
        text += f" (at {res.knob} = {res.first.value})"
    return (text + f": {sel.get('requests')} requests ({sel.get('first_turns')} first turns) over "
            f"{sel.get('span_s', 0):.1f} s" + (f", {rate:.2f} req/s" if rate else "") +
            f"; prompt tokens {q(sel.get('prompt_tokens'))}; output tokens {q(sel.get('output_tokens'))}; "
            f"lengths {sel.get('lengths')} (cap {sel.get('max_tokens') or 'none'}); reusable prompt share "
            f"{_pct(sel.get('reusable_prompt_share') or 0)}")


def _buckets(res: Results) -> list[str]:
    """TTFT and E2EL by prompt-length bucket per policy, every run's requests pooled; only where the
    prompts fall in more than one bucket."""
    groups = {(v, p): buckets([r for run in res.select(p, v) for r in run.records if r.ok])
              for v in res.values for p in res.policies if res.select(p, v)}
    if all(len(b) <= 1 for b in groups.values()):
        return []
    head = ([short(res.knob)] if res.knob else []) + ["policy", "prompt tokens", "requests", "TTFT p50",
                                                      "TTFT p95", "E2EL p50", "E2EL p95"]
    lines = ["", "## Latency by prompt length", "", "Every run's completed requests pooled per policy; buckets "
             "of prompt tokens at powers of 4; TTFT in ms, E2EL (end-to-end latency) in s.", "", _row(head),
             _row(["---"] * len(head))]
    for (v, p), bs in groups.items():
        lines += [_row(([v] if res.knob else []) + [p, b["prompt_tokens"], b["count"], f"{b['median_ttft_ms']:.0f}",
                        f"{b['p95_ttft_ms']:.0f}", f"{b['median_e2el_ms'] / 1e3:.2f}",
                        f"{b['p95_e2el_ms'] / 1e3:.2f}"]) for b in bs]
    return lines


def _oracle(res: Results, entries: list[dict]) -> list[str]:
    """The best static split per sweep value, and what share of its gain each adaptive policy captures."""
    lines = ["", "## Oracle: the best static split", "",
             "`split:K` sends the first K requests of a run to the cpu backend and the rest to gpu. The oracle is "
             "the K with the lowest mean batch completion time, known only after running every K. "
             "Gain = (gpu-only mean - policy mean) / gpu-only mean. The numbers are also in oracle.json."]
    for e in entries:
        base = e["baseline"]
        if res.knob:
            lines += ["", f"### {res.knob} = {e['value']}"]
        lines += ["", _row(["K", "runs", "batch completion (s)", f"change vs {base or 'gpu-only'}"]),
                  _row(["---"] * 4)]
        for s in e["splits"]:
            ch = s["change_vs_baseline"]
            lines.append(_row([s["k"], s["n"], f"{s['mean']:.2f} ± {s['std']:.2f}",
                               "-" if ch is None else f"{100 * ch:+.1f}%"]))
        lines.append("")
        cpu = {a["policy"]: ", ".join(map(str, a["cpu_requests"])) for a in e["adaptive"]}
        if base is None:
            lines.append(f"- oracle: K = {e['oracle_k']} ({e['oracle_mean']:.2f} s); no gpu-only or split:0 runs, "
                         "so no gain can be stated")
            lines += [f"- {a['policy']}: {a['mean']:.2f} s; cpu requests per run: {cpu[a['policy']]}"
                      for a in e["adaptive"]]
            continue
        if base != BASELINE:
            lines.append("- baseline: split:0 (every request to gpu), as no gpu-only runs are here")
        if not e["oracle_gain"]:
            said = ", ".join(f"{a['policy']} changed makespan by {-100 * a['gain']:+.1f}% (cpu requests per run: "
                             f"{cpu[a['policy']]})" for a in e["adaptive"])
            lines.append(f"- no static split beats {base} here (best K = {e['oracle_k']}); the oracle's gain is 0, "
                         "so offloading whole requests has nothing to win here" + (f": {said}" if said else ""))
            continue
        lines.append(f"- oracle: K = {e['oracle_k']}, {e['oracle_mean']:.2f} s against {base} "
                     f"{e['baseline_mean']:.2f} s: gain {_pct(e['oracle_gain'])}")
        lines += [f"- {a['policy']}: {a['mean']:.2f} s, gain {_pct(a['gain'])}, captures "
                  f"{_pct(a['fraction_of_oracle_gain'])} of the oracle's gain; "
                  f"cpu requests per run: {cpu[a['policy']]}" for a in e["adaptive"]]
    return lines


def markdown(res: Results, charts: list[Path], notes: list[str], oracles: list[dict] = ()) -> str:
    s, env = res.first.summary, res.first.env
    lines = [f"# {res.name}", ""]
    lines += [f"- model: `{s.get('model')}`; backends: `{s.get('backends') or s.get('url')}` "
              f"(max {s.get('max_active')} active each)",
              f"- devices: {devices(env, s)}",
              f"- workload: {_workload(res)}",
              f"- measured: {env.get('date', '?')}, torch {env.get('torch', '?')}, "
              f"git {str(env.get('git_commit') or '?')[:12]}"]
    slos = {tuple(x.summary["slo"].items()) for x in res.runs if x.summary.get("slo")}
    if slos:
        said = "; ".join(", ".join(f"{k.removesuffix('_ms')} {v:g} ms" for k, v in slo) for slo in sorted(slos))
        lines.append(f"- goodput: completed requests per second within every SLO ({said}; a one-token reply's "
                     "TPOT counts as 0, as in vLLM)" + (": the runs differ in their SLOs" if len(slos) > 1 else ""))
    if res.knob:
        lines.append(f"- sweep: `{res.knob}` over {', '.join(map(str, res.values))}")
    columns = COLUMNS + ((GOODPUT,) if slos else ())
    legend = LEGEND + ("; goodput: requests per second within every SLO" if slos else "") + "."
    rows = aggregate([x.summary for x in res.runs])
    runs = sorted({r["runs"] for r in rows})
    many = len(runs) > 1
    lines += ["", "## Means over runs", "",
              "Mean ± standard deviation over runs" + ("." if many else f" ({runs[0]} each)."), ""]
    changed = [r for r in rows if r["policy"] != BASELINE and r["change_vs_gpu_only"]]
    for part in (LATENCY, tuple(c[0] for c in columns if c[0] not in LATENCY)):  # two of each: they fit 80 columns
        shown = [c for c in columns if c[0] in part]
        lines += _table(res, ["policy"] + (["runs"] if many else []) + [c[1] for c in shown], rows,
                        lambda r, shown=shown: [r["policy"]] + ([r["runs"]] if many else [])
                        + [_mean(r["metrics"].get(key), scale, digits) for key, _, scale, digits in shown])
        shown = [c for c in shown if c[0] not in NO_CHANGE]
        if changed:
            lines += ["", "Change of the mean against gpu-only, %:", ""]
            lines += _table(res, ["policy"] + [c[1] for c in shown], changed,
                            lambda r, shown=shown: [r["policy"]] + [_change(r["change_vs_gpu_only"].get(k))
                                                                    for k, *_ in shown])
        lines.append("")
    if any(k.startswith("backend_max_itl_ms.") for r in rows for k in r["metrics"]):
        lines += _table(res, ["policy", "ITL p99 per backend", "worst gap per backend"], rows,
                        lambda r: [r["policy"], _per_backend(r["metrics"], "backend_p99_itl_ms"),
                                   _per_backend(r["metrics"], "backend_max_itl_ms")])
        lines += ["", "ITL p99, worst gap: the 99th percentile and the longest of the gaps between two chunks of one "
                  "request, by the backend that served it, ms (a long prompt's prefill shows here in the requests "
                  "decoding beside it).", ""]
    lines += [legend, "", "### Where the requests went", ""]
    lines += _table(res, ["policy", "hit rate per backend", "requests per backend, per run"], rows,
                    lambda r: [r["policy"], _mean_hits(r["metrics"]), "; ".join(_counts(b) for b in r["backend_requests"])])
    if oracles:
        lines += _oracle(res, oracles)
    lines += _buckets(res)
    lines += ["", "## Every run", ""]
    head = ["run", "done", "failed"] + [c[1] for c in columns]
    lines += [_row(head), _row(["---"] * len(head))]
    lines += [_row([x.get("run_id"), x.get("completed"), x.get("failed")]
                   + [_fmt(x.get(k), sc, d) for k, _, sc, d in columns]) for x in (run.summary for run in res.runs)]
    lines += ["", legend, "", _row(["run", "hit rate per backend", "requests per backend", "cached tokens"]),
              _row(["---"] * 4)]
    lines += [_row([x.get("run_id"), _hits(x.get("backend_hit_rate") or {}), _counts(x.get("backend_requests", {})),
                    _counts(x.get("backend_cached_tokens", {}))]) for x in (run.summary for run in res.runs)]
    failed = [(run.summary.get("run_id"), e) for run in res.runs for e in run.requests["error"] if e]
    if failed:
        lines += ["", f"## Failed requests ({len(failed)})", ""]
        lines += [f"- {rid}: {e}" for rid, e in failed[:20]]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines += ["", "## Charts", ""]
    lines += [f"![{c.stem}]({c.name})" for c in charts]
    return "\n".join(lines) + "\n"
