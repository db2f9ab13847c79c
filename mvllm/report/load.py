"""Read one experiment's results folder: run summaries, per-request CSVs, routing logs, environments (the
per-run CSV and log plain or gzipped: requests.csv or requests.csv.gz, routing.jsonl or routing.jsonl.gz).
Summary keys a run's bench did not save yet (hit rates, prompt-length buckets) are derived from its
requests.csv; with SLOs given, goodput is recomputed from it for every run."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from mvllm.bench.metrics import RequestRecord, summarize
from mvllm.bench.results import (
    BASELINE,
    ResultsError,
    find_file,
    open_text,
    read_json,
    records_from_rows,
    runs_in,
    value_order,
)
from mvllm.routing.policies import split_k


@dataclass(slots=True)
class Run:
    summary: dict
    requests: pd.DataFrame
    routing: list[dict]
    env: dict
    folder: Path | None = None
    records: list[RequestRecord] = field(default_factory=list)

    @property
    def policy(self) -> str:
        return self.summary["policy"]

    @property
    def value(self):
        return self.summary.get("value")


@dataclass(slots=True)
class Results:
    folder: Path
    name: str
    runs: list[Run] = field(default_factory=list)

    @property
    def first(self) -> Run:
        return self.runs[0]

    @property
    def knob(self) -> str | None:
        return self.first.summary.get("knob")

    @property
    def policies(self) -> list[str]:
        """gpu-only first (the baseline), then the other policies by name, then split:K by K."""
        def order(p: str) -> tuple:
            k = split_k(p)
            return (p != BASELINE, k is not None, k or 0, p)

        return sorted(dict.fromkeys(r.policy for r in self.runs), key=order)

    @property
    def values(self) -> list:
        return sorted(dict.fromkeys(r.value for r in self.runs), key=value_order)

    @property
    def backends(self) -> list[str]:
        names = []
        for r in self.runs:
            spec = r.summary.get("backends") or ""
            names += [p.split("=", 1)[0] for p in spec.split(",") if "=" in p]
            names += list(r.summary.get("backend_requests", {}))
        return list(dict.fromkeys(n for n in names if n))

    def select(self, policy: str | None = None, value=None, any_value: bool = False) -> list[Run]:
        return [r for r in self.runs if (policy is None or r.policy == policy) and (any_value or r.value == value)]

    def typical(self, policy: str, value=None) -> Run | None:
        """The run whose batch completion time is the median of its group (the one drawn in detail)."""
        runs = sorted(self.select(policy, value), key=lambda r: r.summary.get("makespan") or 0.0)
        return runs[(len(runs) - 1) // 2] if runs else None


def _routing(path: Path | None) -> list[dict]:
    if path is None:
        return []
    out = []
    with open_text(path) as f:
        text = f.read()
    for line in text.splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut short when the server stopped
    return out


DERIVED = ("hit_rate", "backend_hit_rate", "buckets")  # summary keys older benches did not save
GOODPUT = ("request_goodput", "good_requests", "slo")
NA = ("sent", "first_token", "finish", "ttft_ms", "tpot_ms", "e2el_ms", "cached_tokens", "max_tokens",
      "target_tokens", "parent")


def derive(run: Run, slo: dict | None = None) -> None:
    """Fill the summary keys an older bench did not save from the run's requests; with `slo`, put goodput
    under those SLOs in place of any saved."""
    missing = [k for k in DERIVED if k not in run.summary]
    if not missing and not slo:
        return
    s = summarize(run.records, run.summary.get("duration"), slo)
    run.summary.update({k: s[k] for k in missing + (list(GOODPUT) if slo else [])})


def load(folder: Path, slo: dict | None = None) -> Results:
    if not folder.is_dir():
        raise ResultsError(f"results folder {folder} does not exist")
    summaries = runs_in(folder)
    if not summaries:
        raise ResultsError(f"{folder} holds no runs (no */summary.json); run `mvllm bench` first")
    res = Results(folder, summaries[0].get("experiment") or folder.name)
    for s in summaries:
        d: Path = s.pop("_dir")
        csv = find_file(d, "requests.csv")
        if csv is None:
            raise ResultsError(f"{d} has a summary.json but no requests.csv (nor requests.csv.gz)")
        df = pd.read_csv(csv, keep_default_na=False, na_values={c: [""] for c in NA})
        for col in ("backend", "error", "finish_reason"):
            if col in df:
                df[col] = df[col].astype(str)
        env = s.get("environment") or (read_json(d / "env.json") if (d / "env.json").is_file() else {})
        run = Run(s, df, _routing(find_file(d, "routing.jsonl")), env, d, records_from_rows(df.to_dict("records")))
        derive(run, slo)
        res.runs.append(run)
    return res
