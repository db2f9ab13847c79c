"""Charts of one run per policy (the run with the median batch completion time): a timeline of
every request, and the router's scores at each decision."""

from __future__ import annotations

from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from mvllm.report.load import Results, Run
from mvllm.report.style import backend_color, figure, save, title


def _finish(fig, res: Results, what: str, value, path) -> None:
    """Title (with the sweep value), a layout that keeps the title clear of the first panel, save."""
    if res.knob:
        what += f", {res.knob} = {value}"
    fig.suptitle(title(res, what), x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    save(fig, path)


def _panel_height(n: int) -> float:
    return min(max(2.4, 0.14 * n + 1.2), 7.0)


def timeline(res: Results, path, value=None) -> None:
    """One row per request: arrival tick, waiting (queued, then prefill) as a light bar from arrival to
    the first token, decode as a solid bar to the last token, colored by the backend that served it."""
    pols = [p for p in res.policies if res.typical(p, value)]
    runs = [res.typical(p, value) for p in pols]
    backends = res.backends
    cols = 1 if len(runs) <= 3 else 3  # many policies (an oracle's splits): a grid, not a tower
    rows = -(-len(runs) // cols)
    height = _panel_height(max(len(r.requests) for r in runs))
    fig, axes = figure(rows, cols, width=12 if cols == 1 else 18, height=rows * height + 1.2, sharex=True)
    for ax in axes.flat[len(runs):]:
        ax.set_visible(False)
    for ax, p, run in zip(axes.flat, pols, runs):
        df = run.requests
        for row in df.itertuples():
            color = backend_color(row.backend, backends) if row.backend else "grey"
            first = row.first_token if row.first_token == row.first_token else None
            end = row.finish if row.finish == row.finish else None
            if first is not None:
                ax.barh(row.id, first - row.arrival, left=row.arrival, height=0.7, color=color, alpha=0.25,
                        edgecolor=color, lw=0.5)
                if end is not None:
                    ax.barh(row.id, end - first, left=first, height=0.7, color=color)
            if row.error:
                ax.plot(end if end is not None else row.arrival, row.id, "x", color="crimson", ms=8, mew=2)
            ax.plot([row.arrival, row.arrival], [row.id - 0.42, row.id + 0.42], color="black", lw=1)
        ax.invert_yaxis()
        ax.set_ylabel("request")
        ax.tick_params(labelbottom=True)
        s = run.summary
        counts = ", ".join(f"{k} {v}" for k, v in s.get("backend_requests", {}).items())
        ax.set_title(f"{p} ({s.get('run_id', '')}): batch completion {s['makespan']:.2f} s; {counts}",
                     loc="left", fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("time since the first request was sent (s)")
    handles = [Patch(color=backend_color(b, backends), label=f"decode on {b}") for b in backends]
    handles += [Patch(facecolor="grey", alpha=0.25, edgecolor="grey", label="waiting to first token\n(queued + prefill)"),
                Line2D([], [], color="black", marker="|", ls="none", ms=10, label="arrival (scheduled send)")]
    if any((r.requests["error"] != "").any() for r in runs):
        handles.append(Line2D([], [], color="crimson", marker="x", ls="none", ms=8, mew=2, label="failed"))
    axes[0][-1].legend(handles=handles, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9)
    _finish(fig, res, "Timeline of every request, one run per policy (median batch completion)", value, path)


def scored(run: Run | None) -> bool:
    return run is not None and any(d.get("candidates") for d in run.routing)


def scores(res: Results, path, value=None) -> bool:
    """Each backend's score at each routing decision (lower wins), the chosen one filled; False when
    no policy here logged scores."""
    runs = [(p, res.typical(p, value)) for p in res.policies]
    runs = [(p, r) for p, r in runs if scored(r)]
    if not runs:
        return False
    backends = res.backends
    fig, axes = figure(len(runs), 1, width=12, height=3.8 * len(runs) + 1.0)
    for ax, (p, run) in zip(axes[:, 0], runs, strict=True):
        decisions = [d for d in run.routing if d.get("candidates")]
        t0 = run.summary.get("start_time") or decisions[0]["time"]
        key = "eta" if p == "eta" else "score"  # eta decides by predicted finish time, not by the score
        for b in backends:
            pts = [(d["time"] - t0, d["candidates"][b][key], d["choice"] == b)
                   for d in decisions if key in d["candidates"].get(b, {})]
            if not pts:
                continue
            color = backend_color(b, backends)
            xs, ys, chosen = zip(*pts, strict=True)
            ax.plot(xs, ys, color=color, lw=1.2, alpha=0.8, label=f"{b} {'predicted finish' if key == 'eta' else key}")
            ax.scatter([x for x, c in zip(xs, chosen, strict=True) if c],
                       [y for y, c in zip(ys, chosen, strict=True) if c],
                       s=46, color=color, edgecolor="black", zorder=3, label=f"{b} chosen")
            ax.scatter([x for x, c in zip(xs, chosen, strict=True) if not c],
                       [y for y, c in zip(ys, chosen, strict=True) if not c],
                       s=30, facecolor="white", edgecolor=color, zorder=3)
        n = len(decisions)
        ax.set_title(f"{p} ({run.summary.get('run_id', '')}): {n} decisions; filled = the backend chosen",
                     loc="left", fontsize=10)
        ax.set_ylabel("predicted finish (s from now)" if key == "eta" else "score (s of pending work)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9)
    axes[-1][0].set_xlabel("time of the decision since the first request was sent (s)")
    _finish(fig, res, "Router scores at each decision (lower wins; eta: predicted finish time)", value, path)
    return True
