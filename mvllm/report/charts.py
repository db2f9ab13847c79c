"""Charts over runs: batch completion time per policy, latency distributions, and sweeps."""

from __future__ import annotations

import math
import random

import numpy as np

from mvllm.bench.results import BASELINE, runs_in
from mvllm.report.load import Results
from mvllm.report.style import figure, policy_color, save, title

PREDICTED = "predicted (mvllm simulate)"
BAND = "its band: steps ±{:.0f}%"
SWEEP_METRICS = (  # (summary key, axis label, scale)
    ("makespan", "batch completion time (s)", 1.0),
    ("output_throughput", "output throughput (tokens/s)", 1.0),
    ("median_ttft_ms", "median TTFT (ms)", 1.0),
    ("p95_ttft_ms", "p95 TTFT (ms)", 1.0),
    ("p95_e2el_ms", "p95 end-to-end latency (s)", 1e-3),
)


def suffix(res: Results, value) -> str:
    return "" if res.knob is None else f"-{res.knob.split('.')[-1]}={value}"


def _jitter(n: int, width: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [0.0] if n == 1 else [rng.uniform(-width, width) for _ in range(n)]


def makespan(res: Results, path) -> None:
    """Bars: mean batch completion time per policy (per sweep value); dots: every run. Many bars: the
    figure stops widening at 18 inches, the means turn upright and long policy names slant."""
    pols, vals = res.policies, res.values
    bars = len(pols) * len(vals)
    fig_w = min(max(5.5, 1.3 * bars + 2), 18.0)
    across = (fig_w - 2) / bars >= 0.75  # inches per bar that "12.34 s" needs written across
    fig, axes = figure(width=fig_w, height=4.8)
    ax = axes[0][0]
    width = 0.8 / len(pols)
    top = 0.0
    predicted, bands, marked, banded = _predicted(res), _bands(res), False, False
    for j, p in enumerate(pols):
        for i, v in enumerate(vals):
            xs = [r.summary["makespan"] for r in res.select(p, v)]
            if not xs:
                continue
            if (p, v) in predicted:
                ax.scatter([(i if res.knob else 0) + (j - (len(pols) - 1) / 2) * width], [predicted[p, v]],
                           marker="D", s=46, facecolor="none", edgecolor="black", linewidth=1.3, zorder=4,
                           label=None if marked else PREDICTED)
                marked, top = True, max(top, predicted[p, v])
            if (p, v) in bands:
                spread, (lo, hi) = bands[p, v]
                ax.vlines((i if res.knob else 0) + (j - (len(pols) - 1) / 2) * width, lo, hi, color="black",
                          linewidth=1.0, zorder=4, label=None if banded else BAND.format(100 * spread))
                banded, top = True, max(top, hi)
            x = (i if res.knob else 0) + (j - (len(pols) - 1) / 2) * width
            mean = float(np.mean(xs))
            top = max(top, mean, *xs)
            ax.bar(x, mean, width * 0.85, color=policy_color(p, pols), alpha=0.85,
                   label=p if i == 0 else None, zorder=2)
            ax.scatter([x + d for d in _jitter(len(xs), width * 0.18, i * 31 + j)], xs, s=22, color="black",
                       zorder=3, label="one run" if i == 0 and j == 0 else None)
            ax.annotate(f"{mean:.2f} s", (x, 0), xytext=(0, 5), textcoords="offset points", ha="center",
                        va="bottom", fontsize=9, fontweight="bold", color="white", rotation=0 if across else 90)
    if res.knob:
        ax.set_xticks(range(len(vals)), [str(v) for v in vals])
        ax.set_xlabel(res.knob)
    else:
        slant = (fig_w - 2) / len(pols) < 0.09 * max(map(len, pols))
        ax.set_xticks([(j - (len(pols) - 1) / 2) * width for j in range(len(pols))], pols,
                      rotation=30 if slant else 0, ha="right" if slant else "center")
        ax.set_xlabel("policy")
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)
    ax.set_ylabel("batch completion time (s)")
    ax.grid(axis="y", alpha=0.3, zorder=0)
    handles, labels = ax.get_legend_handles_labels()
    markers = {"one run", PREDICTED, *(BAND.format(100 * s) for s, _ in bands.values())}
    order = sorted(range(len(labels)), key=lambda k: labels[k] in markers)
    ax.legend([handles[k] for k in order], [labels[k] for k in order], frameon=False, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    n = sorted({len(res.select(p, v)) for p in pols for v in vals})
    runs = "/".join(map(str, n)) + (" run" if n == [1] else " runs")
    ax.set_title(title(res, f"Batch completion time: mean (bars) and each run (dots), {runs} per policy"),
                 loc="left")
    save(fig, path)


def _predicted(res: Results) -> dict[tuple, float]:
    """(policy, value) -> the makespan `mvllm simulate` predicted, where it wrote results/<name>/simulated."""
    folder = res.folder / "simulated"
    return {(s["policy"], s.get("value")): s["makespan"] for s in runs_in(folder)} if folder.is_dir() else {}


def _bands(res: Results) -> dict[tuple, tuple[float, tuple[float, float]]]:
    """(policy, value) -> (spread, the makespan band) where `mvllm simulate` wrote one."""
    folder = res.folder / "simulated"
    if not folder.is_dir():
        return {}
    return {(s["policy"], s.get("value")): (s["band"]["spread"], tuple(s["band"]["makespan"]))
            for s in runs_in(folder) if "band" in s}


def ecdf(ax, values: list[float], color: str, label: str) -> None:
    xs = np.sort(np.asarray(values, dtype=float))
    ys = np.arange(1, len(xs) + 1) / len(xs)
    ax.step(np.concatenate([[xs[0]], xs]), np.concatenate([[0.0], ys]), where="post", color=color, lw=2,
            label=label)


def num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def latency(res: Results, path, value=None) -> None:
    """Distributions (empirical CDF over every request of every run) of TTFT and end-to-end latency;
    the dotted lines mark the median and the 95th percentile."""
    pols = res.policies
    fig, axes = figure(1, 2, width=12, height=4.6)
    for ax, (col, label, scale, unit) in zip(axes[0], (("ttft_ms", "time to first token (ms)", 1.0, "ms"),
                                                       ("e2el_ms", "end-to-end latency (s)", 1e-3, "s")),
                                             strict=True):
        for p in pols:
            runs = res.select(p, value)
            xs = [x * scale for r in runs for x in r.requests[col].dropna().tolist()]
            if not xs:
                continue
            med, p95 = np.percentile(xs, 50), np.percentile(xs, 95)
            ecdf(ax, xs, policy_color(p, pols), f"{p}: median {num(med)} {unit}, p95 {num(p95)} {unit}")
        for q, name in ((0.5, "median"), (0.95, "p95")):
            ax.axhline(q, color="grey", ls=":", lw=1)
            ax.annotate(name, (1.0, q), xycoords=("axes fraction", "data"), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8, color="grey")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, loc="lower right", fontsize=8)
    what = "TTFT and end-to-end latency, every request of every run"
    if res.knob:
        what += f" ({res.knob} = {value})"
    fig.suptitle(title(res, what), x=0.01, ha="left")
    fig.tight_layout()
    save(fig, path)


def _numeric(values: list) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def sweep(res: Results, path) -> None:
    """Each metric against the swept knob, per policy: mean of runs, bars for the standard deviation."""
    pols, vals = res.policies, res.values
    numeric = _numeric(vals)
    xs = vals if numeric else list(range(len(vals)))
    fig, axes = figure(2, 3, width=16, height=8)
    for ax, (key, label, scale) in zip(axes.flat, SWEEP_METRICS, strict=False):
        for p in pols:
            means, stds, pts = [], [], []
            for x, v in zip(xs, vals, strict=True):
                ys = [r.summary[key] * scale for r in res.select(p, v) if r.summary.get(key) is not None]
                means.append(float(np.mean(ys)) if ys else math.nan)
                stds.append(float(np.std(ys, ddof=1)) if len(ys) > 1 else 0.0)
                pts += [(x, y) for y in ys]
            color = policy_color(p, pols)
            ax.errorbar(xs, means, yerr=stds, color=color, marker="o", lw=2, capsize=3, label=p)
            if pts:
                ax.scatter(*zip(*pts, strict=True), color=color, s=10, alpha=0.5)
        ax.set_xlabel(res.knob)
        ax.set_ylabel(label)
        if not numeric:
            ax.set_xticks(xs, [str(v) for v in vals])
        elif min(vals) > 0 and max(vals) / min(vals) >= 8:  # e.g. 1, 2, 4, 8, 16: evenly spaced on log 2
            ax.set_xscale("log", base=2)
            ax.set_xticks(vals, [f"{v:g}" for v in vals])
            ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    spare = axes.flat[-1]  # the sixth panel holds the legend
    spare.axis("off")
    spare.legend(*axes[0][0].get_legend_handles_labels(), frameon=False, loc="center left")
    fig.suptitle(title(res, f"Metrics against {res.knob}: mean of runs, standard deviation as error bars"),
                 x=0.01, ha="left")
    fig.tight_layout()
    save(fig, path)


def oracle(res: Results, entries: list[dict], path) -> None:
    """Per sweep value: mean batch completion time of each split:K against K (dots: every run), the
    baseline and each adaptive policy's mean as horizontal lines, the oracle K ringed and named above."""
    pols = res.policies
    cols = min(len(entries), 3)
    rows = math.ceil(len(entries) / cols)
    fig, axes = figure(rows, cols, width=max(7.0, 5.2 * cols), height=4.2 * rows + 0.8)
    for ax in axes.flat[len(entries):]:
        ax.set_visible(False)
    legend: dict = {}
    for ax, e in zip(axes.flat, entries, strict=False):
        ks = [s["k"] for s in e["splits"]]
        ax.errorbar(ks, [s["mean"] for s in e["splits"]], yerr=[s["std"] for s in e["splits"]], color="black",
                    marker="o", lw=1.5, capsize=3, label="split:K mean (± std)", zorder=3)
        for j, s in enumerate(e["splits"]):
            ax.scatter([s["k"] + d for d in _jitter(s["n"], 0.08, j)], s["makespans"], s=14, color="grey",
                       alpha=0.7, zorder=2, label="one run" if j == 0 else None)
        if e["baseline"] == BASELINE:
            ax.axhline(e["baseline_mean"], color=policy_color(BASELINE, pols), ls="--", lw=1.5,
                       label="gpu-only mean")
        for a in e["adaptive"]:
            ax.axhline(a["mean"], color=policy_color(a["policy"], pols), lw=2, label=f"{a['policy']} mean")
        ax.scatter([e["oracle_k"]], [e["oracle_mean"]], s=220, facecolors="none", edgecolors="crimson", lw=2,
                   zorder=4, label="oracle (best K)")
        ax.set_xticks(ks)
        ax.set_xlabel("K (first K requests to the cpu backend)")
        ax.set_ylabel("batch completion time (s)")
        ax.grid(alpha=0.3)
        best = f"oracle: K = {e['oracle_k']}"
        if e["baseline"]:
            best += f", gain {100 * e['oracle_gain']:.1f}% over {e['baseline']}"
        ax.set_title((f"{res.knob} = {e['value']}\n" if res.knob else "") + best, loc="left", fontsize=10)
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, h)
    fig.suptitle(title(res, "Static splits against the adaptive routers: batch completion time by K"),
                 x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    names = sorted(legend, key=lambda k: not k.startswith("split:K"))
    fig.legend([legend[k] for k in names], names, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 0.9))
    save(fig, path)
