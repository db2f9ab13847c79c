"""The markdown summary: what was run, where, the table over runs, every run, and the charts."""

from __future__ import annotations

from pathlib import Path

from mvllm.bench.results import BASELINE, aggregate
from mvllm.report.load import Results
from mvllm.report.style import devices

COLUMNS = (  # (metric, header, scale, digits)
    ("makespan", "batch completion (s)", 1.0, 2),
    ("output_throughput", "output throughput (tok/s)", 1.0, 1),
    ("median_ttft_ms", "median TTFT (ms)", 1.0, 0),
    ("p95_ttft_ms", "p95 TTFT (ms)", 1.0, 0),
    ("median_e2el_ms", "median E2EL (s)", 1e-3, 2),
    ("p95_e2el_ms", "p95 E2EL (s)", 1e-3, 2),
    ("median_tpot_ms", "median TPOT (ms)", 1.0, 1),
)


def _fmt(x, scale: float, digits: int) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _counts(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "-"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


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
    w = s.get("workload", {})
    lines = [f"# {res.name}", ""]
    lines += [f"- model: `{s.get('model')}`; backends: `{s.get('backends') or s.get('url')}` "
              f"(max {s.get('max_active')} active each)",
              f"- devices: {devices(env, s)}",
              f"- workload: {w.get('requests')} requests of {w.get('prefix_tokens')} shared-prefix + "
              f"{w.get('suffix_tokens')} unique tokens, {w.get('output_tokens')} output tokens (EOS ignored), "
              f"{w.get('arrival')} arrivals" + (f" every {w.get('interval')} s" if w.get("arrival") == "fixed" else
                                                f" at {w.get('rate')} req/s, burstiness {w.get('burstiness')}")
              + f", seed {w.get('seed')}; prefix warmed: {'yes' if w.get('warm') else 'no'}",
              f"- measured: {env.get('date', '?')}, torch {env.get('torch', '?')}, "
              f"git {str(env.get('git_commit') or '?')[:12]}"]
    if res.knob:
        lines.append(f"- sweep: `{res.knob}` over {', '.join(map(str, res.values))}")
    lines += ["", "## Means over runs", "",
              "Mean ± standard deviation over runs; in brackets the change of the mean against gpu-only.", ""]
    head = ([res.knob] if res.knob else []) + ["policy", "runs"] + [c[1] for c in COLUMNS] + ["requests per backend"]
    lines += [_row(head), _row(["---"] * len(head))]
    for r in aggregate([x.summary for x in res.runs]):
        cells = [r["value"]] if res.knob else []
        cells += [r["policy"], r["runs"]]
        for key, _, scale, digits in COLUMNS:
            m = r["metrics"].get(key)
            if m is None:
                cells.append("-")
                continue
            text = _fmt(m["mean"], scale, digits)
            if m["n"] > 1:
                text += " ± " + _fmt(m["std"], scale, digits)
            ch = r["change_vs_gpu_only"].get(key)
            if ch is not None and r["policy"] != BASELINE:
                text += f" ({ch:+.1f}%)"
            cells.append(text)
        cells.append("; ".join(_counts(b) for b in r["backend_requests"]))
        lines.append(_row(cells))
    if oracles:
        lines += _oracle(res, oracles)
    lines += ["", "## Every run", ""]
    head = ["run", "completed", "failed"] + [c[1] for c in COLUMNS] + ["requests per backend", "cached tokens"]
    lines += [_row(head), _row(["---"] * len(head))]
    for run in res.runs:
        x = run.summary
        lines.append(_row([x.get("run_id"), x.get("completed"), x.get("failed")]
                          + [_fmt(x.get(k), sc, d) for k, _, sc, d in COLUMNS]
                          + [_counts(x.get("backend_requests", {})), _counts(x.get("backend_cached_tokens", {}))]))
    failed = [(run.summary.get("run_id"), e) for run in res.runs for e in run.requests["error"] if e]
    if failed:
        lines += ["", f"## Failed requests ({len(failed)})", ""]
        lines += [f"- {rid}: {e}" for rid, e in failed[:20]]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    lines += ["", "## Charts", ""]
    lines += [f"![{c.stem}]({c.name})" for c in charts]
    return "\n".join(lines) + "\n"
