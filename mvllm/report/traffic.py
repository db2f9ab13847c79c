"""Charts of the traffic: the workload (prompt and output lengths, arrivals), TTFT and E2EL distributions on
a log scale per policy, and each backend's prefix hit rate over time. Each returns False where its data
does not vary (one prompt length, a hit rate that never moves): there is nothing to draw."""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from mvllm.report.charts import ecdf, num
from mvllm.report.load import Results, Run
from mvllm.report.style import backend_color, figure, policy_color, save, title

DECADE = 10.0  # values spanning this factor or more get a log axis
TIME_BINS = (6, 24)  # hit-rate time bins: about one per 8 requests of a policy, within these bounds


def _done(df: pd.DataFrame) -> pd.DataFrame:
    return df[(df["error"] == "") & df["finish"].notna() & df["first_token"].notna()]


def _varies(values) -> bool:
    return len(set(np.asarray(values, dtype=float).tolist())) > 1


def _uneven(arrivals) -> bool:
    gaps = np.diff(np.sort(np.asarray(arrivals, dtype=float)))
    return len(gaps) > 1 and float(np.ptp(gaps)) > 1e-3 * max(float(np.mean(gaps)), 1e-9)


def outputs(df: pd.DataFrame) -> tuple[pd.Series, str]:
    """Each request's output length: the workload's true length where the CSV has it, else what was generated."""
    if "target_tokens" in df and df["target_tokens"].notna().any():
        return df["target_tokens"].dropna(), "output length (the workload's true length, tokens)"
    return _done(df)["output_tokens"], "output tokens generated"


def workload_varies(run: Run) -> bool:
    df = run.requests
    return _varies(df["prompt_tokens"]) or _varies(outputs(df)[0]) or _uneven(df["arrival"])


def log_x(ax, lo: float, hi: float) -> None:
    """A log x axis labelled in plain numbers: at 1, 2 and 5 of each decade, or at every digit where the values
    span less than 30 times."""
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0) if hi >= 30 * lo else range(1, 10)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: num(x)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _hist(ax, values, color: str, label: str) -> None:
    xs = np.asarray(values, dtype=float)
    xs = xs[xs > 0]
    lo, hi = float(xs.min()), float(xs.max())
    if hi / lo >= DECADE:
        bins = np.geomspace(lo, hi * 1.0001, 41)
        log_x(ax, lo, hi)
    elif lo == hi:
        bins = np.array([lo - 0.5, lo + 0.5])
    else:
        bins = np.linspace(lo, hi, min(41, len(set(xs.tolist())) + 1))
    ax.hist(xs, bins=bins, color=color, alpha=0.85, edgecolor="white", lw=0.4)
    for q, ls in ((50, "--"), (99, ":")):
        ax.axvline(np.percentile(xs, q), color="black", ls=ls, lw=1, label=f"p{q} {num(np.percentile(xs, q))}")
    ax.set_xlabel(label)
    ax.set_ylabel("requests")
    ax.legend(frameon=False, fontsize=8)
    ax.grid(alpha=0.3)
    ax.set_title(f"{len(xs)} requests, {num(lo)} to {num(hi)} tokens", loc="left", fontsize=10)


def _arrivals(ax, df: pd.DataFrame) -> None:
    """Requests sent per second in time bins (1 s where the replay lasts 20 s or more); follow-up turns stacked
    on first turns where the CSV says which are which."""
    t = df["arrival"].to_numpy(dtype=float)
    span = float(t.max() - t.min())
    width = 1.0 if span >= 20 else max(span / 20, 1e-3)
    edges = np.arange(t.min(), t.max() + width, width)
    if len(edges) < 2:
        edges = np.array([t.min(), t.min() + width])
    follow = df["parent"].notna().to_numpy() if "parent" in df else np.zeros(len(t), dtype=bool)
    groups = [(t[~follow], "first turns", "#4C72B0"), (t[follow], "follow-up turns", "#DD8452")]
    groups = [g for g in groups if len(g[0])]
    weights = [np.full(len(x), 1.0 / width) for x, _, _ in groups]
    ax.hist([x for x, _, _ in groups], bins=edges, weights=weights, stacked=True, color=[c for _, _, c in groups],
            label=[n for _, n, _ in groups], edgecolor="white", lw=0.3)
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("requests sent per second" + ("" if width == 1.0 else f" ({num(width)} s bins)"))
    ax.grid(alpha=0.3)
    if len(groups) > 1:
        ax.legend(frameon=False, fontsize=8)
    rate = (len(t) - 1) / span if span > 0 else float("nan")
    ax.set_title(f"{len(t)} requests over {num(span)} s, mean {num(rate)} per second", loc="left", fontsize=10)


def workload(res: Results, path, run: Run) -> None:
    """Prompt and output length histograms (log x where lengths span a decade; a length every request shares
    is said in the title instead) and arrivals over time."""
    df = run.requests
    out, out_label = outputs(df)
    lengths = [(df["prompt_tokens"], "#4C72B0", "prompt length (tokens)", "prompt"),
               (out, "#55A868", out_label, "output")]
    drawn = [x for x in lengths if _varies(x[0])]
    fig, axes = figure(1, len(drawn) + 1, width=5.3 * (len(drawn) + 1) + 0.5, height=4.4)
    for ax, (values, color, label, _) in zip(axes[0], drawn, strict=False):
        _hist(ax, values, color, label)
    _arrivals(axes[0][-1], df)
    same = [f"{num(values.iloc[0])} {name} tokens" for values, _, _, name in lengths if not _varies(values)]
    what = f"Workload: {'prompt and output lengths, ' if drawn else ''}arrivals (from {run.summary.get('run_id')})"
    if same:
        what += "; every request " + " and ".join(same)
    fig.suptitle(title(res, what), x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    save(fig, path)


def cdf(res: Results, path, value=None) -> None:
    """TTFT and E2EL empirical CDFs per policy, every request of its runs pooled, on a log axis; the SLOs as
    vertical lines where goodput was set, with each policy's share of requests within it."""
    pols = [p for p in res.policies if res.select(p, value)]
    slo = next((r.summary["slo"] for r in res.select(value=value) if r.summary.get("slo")), {})
    fig, axes = figure(2, 1, width=13, height=8.5)
    for ax, (col, label, scale, unit) in zip(axes[:, 0], (("ttft_ms", "time to first token (ms)", 1.0, "ms"),
                                                       ("e2el_ms", "end-to-end latency (s)", 1e-3, "s")),
                                             strict=True):
        bound = slo.get(col)
        pooled = []
        for p in pols:
            xs = np.array([x * scale for r in res.select(p, value) for x in r.requests[col].dropna().tolist()])
            xs = xs[xs > 0]
            if not len(xs):
                continue
            pooled += [xs.min(), xs.max()]
            text = f"{p}: median {num(np.median(xs))} {unit}, p95 {num(np.percentile(xs, 95))} {unit}"
            if bound:
                text += f"; {100 * np.mean(xs <= bound * scale):.0f}% within the SLO"
            ecdf(ax, xs.tolist(), policy_color(p, pols), text)
        if bound:
            ax.axvline(bound * scale, color="crimson", ls="--", lw=1.2)
            ax.annotate(f"SLO {num(bound * scale)} {unit}", (bound * scale, 0.0), xytext=(3, 4),
                        textcoords="offset points", color="crimson", fontsize=8)
        if pooled:
            log_x(ax, min(pooled), max(pooled))
        ax.set_xlabel(label + ", log scale")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3, which="both")
        ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    what = "CDF of TTFT and end-to-end latency per policy, every request of every run"
    if res.knob:
        what += f" ({res.knob} = {value})"
    fig.suptitle(title(res, what), x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    save(fig, path)


def _binned(df: pd.DataFrame, edges: np.ndarray, backend: str) -> np.ndarray:
    """Cached over prompt tokens of the requests `backend` served, by arrival bin (NaN where it served none)."""
    d = df[df["backend"] == backend]
    idx = np.clip(np.searchsorted(edges, d["arrival"].to_numpy(dtype=float), side="right") - 1, 0, len(edges) - 2)
    cached = np.bincount(idx, weights=d["cached_tokens"].to_numpy(dtype=float), minlength=len(edges) - 1)
    prompt = np.bincount(idx, weights=d["prompt_tokens"].to_numpy(dtype=float), minlength=len(edges) - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(prompt > 0, cached / prompt, np.nan)


def _served(res: Results, policy: str, value) -> pd.DataFrame:
    """The completed requests of a policy's runs that reported cached tokens, pooled."""
    frames = [_done(r.requests) for r in res.select(policy, value)]
    df = pd.concat(frames) if frames else pd.DataFrame()
    return df[df["cached_tokens"].notna()] if len(df) else df


def hit_rate(res: Results, path, value=None) -> bool:
    """Each backend's prefix hit rate (cached / prompt tokens) in time bins by arrival, one panel per policy,
    runs pooled; False where no run reported cached tokens or no backend's rate moves over time."""
    served = {p: df for p in res.policies if len(df := _served(res, p, value))}
    if not served:
        return False
    t = np.concatenate([df["arrival"].to_numpy(dtype=float) for df in served.values()])
    bins = min(max(len(t) // len(served) // 8, TIME_BINS[0]), TIME_BINS[1])
    edges = np.linspace(t.min(), max(t.max(), t.min() + 1e-3), bins + 1)
    mids = (edges[:-1] + edges[1:]) / 2
    backends = res.backends
    series = {p: {b: _binned(df, edges, b) for b in backends if (df["backend"] == b).any()}
              for p, df in served.items()}
    if not any(_varies(ys[~np.isnan(ys)]) for per in series.values() for ys in per.values()):
        return False
    cols = min(3, len(series))
    rows = -(-len(series) // cols)
    fig, axes = figure(rows, cols, width=5.2 * cols + 1.5, height=3.3 * rows + 1.0, sharex=True, sharey=True)
    for ax in axes.flat[len(series):]:
        ax.set_visible(False)
    for ax, (p, per) in zip(axes.flat, series.items(), strict=False):
        df = served[p]
        for b, ys in per.items():
            d = df[df["backend"] == b]
            overall = d["cached_tokens"].sum() / d["prompt_tokens"].sum() if d["prompt_tokens"].sum() else 0.0
            ax.plot(mids, 100 * ys, marker="o", ms=3, lw=1.6, color=backend_color(b, backends),
                    label=f"{b}: {100 * overall:.1f}% over {len(d)} requests")
        ax.set_title(p, loc="left", fontsize=10)
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, fontsize=7, loc="best")
        ax.tick_params(labelbottom=True)
    for ax in axes[:, 0]:
        ax.set_ylabel("prefix hit rate (%)")
    for ax in axes[-1]:
        ax.set_xlabel("arrival time (s)")
    width = edges[1] - edges[0]
    what = f"Prefix hit rate per backend over time (cached / prompt tokens, {num(width)} s bins), runs pooled"
    if res.knob:
        what += f", {res.knob} = {value}"
    fig.suptitle(title(res, what), x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    save(fig, path)
    return True
