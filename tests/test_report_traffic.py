"""`mvllm report` on traffic with many prefixes and long-tailed lengths: the workload, CDF and hit-rate
charts, goodput recomputed under SLOs chosen after the runs, and old results folders still drawn."""

from __future__ import annotations

import csv
import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_report import _check_png as _png

from mvllm.bench.metrics import RequestRecord, summarize
from mvllm.bench.results import CSV_COLUMNS, run_id, write_aggregate, write_json, write_requests
from mvllm.report import report
from mvllm.report.load import load

ROOT = Path(__file__).resolve().parents[1]
OLD_COLUMNS = CSV_COLUMNS[:CSV_COLUMNS.index("itl_ms") + 1]  # what bench wrote before max_tokens etc.


def traffic_records(policy: str, run: int, n: int = 120) -> list[RequestRecord]:
    """Poisson arrivals, prompts from tens to tens of thousands of tokens, a follow-up turn now and then, and a
    gpu prefix cache that warms up over the run (its hit rate climbs); the cpu one stays cold."""
    rng = random.Random(f"{policy}-{run}")
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(4.0)
        prompt = int(min(40_000, max(20, rng.lognormvariate(6.5, 1.5))))
        target = int(min(2000, max(1, rng.lognormvariate(4.5, 1.0))))
        backend = "cpu" if policy != "gpu-only" and i % 5 == 0 else "gpu"
        cached = int(prompt * min(0.9, t / 40)) // 16 * 16 if backend == "gpu" else 0
        first = t + 0.02 + prompt / 20_000 * rng.uniform(0.5, 2.0) * (3 if backend == "cpu" else 1)
        finish = first + (target - 1) * rng.uniform(0.004, 0.02)
        chunks = [first + (finish - first) * k / max(target - 1, 1) for k in range(target)]
        out.append(RequestRecord(i, t, prompt, t, first, finish, backend, cached, target, chunks, max_tokens=None,
                                 target_tokens=target, finish_reason="length",
                                 parent=i - 1 if i % 7 == 6 else None))
    return out


def write_run(out: Path, policy: str, run: int, records: list[RequestRecord], old: bool = False) -> Path:
    folder = out / run_id(policy, run)
    folder.mkdir(parents=True)
    s = {"experiment": out.name, "policy": policy, "model": "synthetic:tiny-llama", "backends": "gpu=cpu,cpu=cpu",
         "max_active": 4, "start_time": 1_800_000_000.0,
         "workload": {"kind": "trace", "path": "trace.jsonl", "arrival": "trace", "lengths": "hidden"},
         **summarize(records), "run_id": folder.name, "run": run, "knob": None, "value": None}
    write_requests(folder / "requests.csv", records)
    if old:  # a results folder of an earlier bench: fewer columns, no new summary keys, the CSV gzipped
        for key in ("hit_rate", "backend_hit_rate", "buckets"):
            s.pop(key)
        with open(folder / "requests.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        with gzip.open(folder / "requests.csv.gz", "wt", newline="") as f:
            w = csv.writer(f)
            w.writerow(OLD_COLUMNS)
            w.writerows([[r[c] for c in OLD_COLUMNS] for r in rows])
        (folder / "requests.csv").unlink()
    write_json(folder / "summary.json", s)
    return folder


def traffic_experiment(tmp_path: Path, old: bool = False) -> Path:
    out = tmp_path / ("old" if old else "traffic")
    for policy in ("gpu-only", "mixed", "eta"):
        for run in (1, 2):
            write_run(out, policy, run, traffic_records(policy, run), old)
    if not old:  # what bench's runner saves of the workload's selection
        records = traffic_records("gpu-only", 1)
        write_json(out / "workload.json", {
            "kind": "trace", "lengths": "hidden", "max_tokens": None, "requests": len(records),
            "first_turns": sum(r.parent is None for r in records), "span_s": records[-1].arrival, "rate_per_s": 4.0,
            "prompt_tokens": {"p50": 600, "p99": 30000, "max": 40000},
            "output_tokens": {"p50": 90, "p99": 900, "max": 2000}, "reusable_prompt_share": 0.4})
    write_aggregate(out)
    return out


def test_traffic_report_draws_the_three_charts(tmp_path):
    out = traffic_experiment(tmp_path)
    names = {p.name for p in report(out)}
    assert {"workload.png", "cdf.png", "hit_rate.png", "latency.png", "makespan.png"} <= names
    for name in ("workload.png", "cdf.png", "hit_rate.png"):
        _png(out / "report" / name)
    md = (out / "report" / "summary.md").read_text()
    assert "![workload](workload.png)" in md and "![hit_rate](hit_rate.png)" in md
    assert "## Latency by prompt length" in md and "| gpu-only | 64-255 |" in md
    assert "kind trace (trace.jsonl): 120 requests" in md and "reusable prompt share 40.0%" in md
    agg = json.loads((out / "aggregate.json").read_text())
    mixed = next(r for r in agg if r["policy"] == "mixed")
    assert {"hit_rate", "backend_hit_rate.gpu", "backend_hit_rate.cpu"} <= set(mixed["metrics"])
    assert mixed["metrics"]["backend_hit_rate.cpu"]["mean"] == 0.0
    assert "cpu 0.0%" in md


def test_report_goodput_is_recomputed_from_the_csv(tmp_path):
    out = traffic_experiment(tmp_path)
    slo = {"ttft_ms": 300.0, "e2el_ms": 4000.0}
    report(out, tmp_path / "rep", slo=slo)
    res = load(out, slo)
    for run in res.runs:
        rows = [r for r in run.records if r.ok]
        good = sum(1000 * r.ttft <= 300 and 1000 * r.e2el <= 4000 for r in rows)
        assert 0 < good < len(rows)
        assert run.summary["good_requests"] == good and run.summary["slo"] == slo
        assert run.summary["request_goodput"] == pytest.approx(good / run.summary["duration"])
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "goodput: requests per second within every SLO" in md and "ttft 300 ms, e2el 4000 ms" in md
    assert "goodput" not in (out / "mixed-run1" / "summary.json").read_text()  # measured files stay as they were


def test_an_old_results_folder_still_reports(tmp_path):
    out = traffic_experiment(tmp_path, old=True)
    assert not list(out.glob("*/requests.csv")) and len(list(out.glob("*/requests.csv.gz"))) == 6
    names = {p.name for p in report(out, slo={"tpot_ms": 15.0})}
    assert {"workload.png", "cdf.png", "hit_rate.png"} <= names
    res = load(out)
    assert res.runs[0].summary["hit_rate"] is not None  # derived from the CSV
    md = (out / "report" / "summary.md").read_text()
    assert "hit rate per backend" in md


def test_constant_traffic_draws_no_workload_or_hit_rate_chart(tmp_path):
    out = tmp_path / "flat"
    for policy in ("gpu-only", "mixed"):
        recs = [RequestRecord(i, 0.05 * i, 516, 0.05 * i, 0.05 * i + 0.1 + 0.01 * (i % 3), 0.05 * i + 1.0 + 0.1 * i,
                              "gpu", 496, 16) for i in range(10)]
        write_run(out, policy, 1, recs, old=True)
    names = {p.name for p in report(out)}
    assert "workload.png" not in names and "hit_rate.png" not in names and "cdf.png" in names
    md = (out / "report" / "summary.md").read_text()
    assert "no workload chart: every request has 516 prompt tokens and 16 output tokens" in md
    assert "no hit-rate chart" in md


def test_a_malformed_goodput_is_one_cli_line(tmp_path):
    out = traffic_experiment(tmp_path)
    for bad, said in (("ttft=500", "expected KEY:MS"), ("itl:5", "unknown metric 'itl'"),
                      ("e2el:-3", "positive number of milliseconds")):
        done = subprocess.run([sys.executable, "-m", "mvllm.cli", "report", str(out), "--goodput", bad],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr
        assert done.stderr.count("\n") == 1
