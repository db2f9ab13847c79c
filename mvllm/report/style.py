"""One look for every chart: fixed colors per policy and per backend, and titles that name the
experiment, the model and the devices."""

from __future__ import annotations

import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

POLICY_COLORS = {"gpu-only": "#4C72B0", "mixed": "#DD8452", "cpu-only": "#55A868", "round-robin": "#8172B3",
                 "eta": "#C44E9A", "external": "#937860"}
BACKEND_COLORS = {"gpu": "#C44E52", "cpu": "#2A9D8F"}
SPARE = ["#DA8BC3", "#8C8C8C", "#CCB974", "#64B5CD", "#1B4F72", "#7E5109", "#6C3483", "#117864"]


def _pick(name: str, fixed: dict, order: list[str]) -> str:
    if name in fixed:
        return fixed[name]
    rest = [n for n in order if n not in fixed]
    i = rest.index(name) if name in rest else len(rest)
    return SPARE[i % len(SPARE)]


def policy_color(policy: str, policies: list[str]) -> str:
    return _pick(policy, POLICY_COLORS, sorted(policies))


def backend_color(backend: str, backends: list[str]) -> str:
    return _pick(backend, BACKEND_COLORS, sorted(backends))


def short_cpu(name: str) -> str:
    name = re.sub(r"\((R|TM|tm|r)\)", "", name)
    name = re.sub(r"\s*(CPU\s*)?@.*$", "", name)
    name = re.sub(r"\b(\d+-Core|Processor)\b", "", name)
    return re.sub(r"\s+", " ", name).strip()


def devices(env: dict, summary: dict) -> str:
    found = env.get("devices") or {}
    if summary.get("url"):
        return f"external server {summary['url']}"
    if not found:
        return summary.get("backends") or "unknown devices"
    return ", ".join(f"{k}: {short_cpu(v) if v else '?'}" for k, v in found.items())


def title(res, what: str) -> str:
    s, env = res.first.summary, res.first.env
    return f"{what}\n{res.name} · {s.get('model', '?')} · {devices(env, s)}"


def figure(rows: int = 1, cols: int = 1, width: float = 10.0, height: float = 5.0, **kw):
    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "figure.titlesize": 12,
                         "axes.spines.top": False, "axes.spines.right": False})
    return plt.subplots(rows, cols, figsize=(width, height), squeeze=False, **kw)


def save(fig, path) -> None:
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
