"""`mvllm report`: every chart and the markdown summary, from result files alone."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from mvllm.bench.metrics import RequestRecord, summarize
from mvllm.bench.results import (
    ResultsError,
    request_rows,
    run_id,
    write_aggregate,
    write_json,
    write_requests,
)
from mvllm.env import describe
from mvllm.report import report, report_all
from mvllm.report.load import load

ROOT = Path(__file__).resolve().parents[1]
START = 1_800_000_000.0


def fake_run(out: Path, policy: str, run: int, knob=None, value=None, fail: bool = False) -> None:
    """A run folder as bench writes it, from made-up but consistent request records."""
    rng = random.Random(f"{policy}{run}{value}")
    records, routing = [], []
    for i in range(8):
        backend = "cpu" if policy == "mixed" and i % 4 == 3 else "gpu"
        arrival = 0.05 * i
        first = arrival + rng.uniform(0.02, 0.3)
        finish = first + rng.uniform(1.0, 2.0) * (1 + (value or 0) / 100)
        chunks = [first + (finish - first) * k / 15 for k in range(16)]
        r = RequestRecord(i, arrival, 516, arrival, first, finish, backend, 496, 16, chunks)
        if fail and i == 5:
            r = RequestRecord(i, arrival, 516, arrival, None, arrival + 0.01, "", None, 0, [], "HTTP 400: bad")
        records.append(r)
        cands = {}
        if policy == "mixed":
            cands = {b: {"pending_prefill": 20, "pending_decode": 128, "prefill_rate": 100.0, "decode_rate": 40.0,
                         "cached_prefix": 496, "score": rng.uniform(1, 4)} for b in ("gpu", "cpu")}
        routing.append({"request_id": f"cmpl-{i}", "time": START + arrival + 0.001, "policy": policy,
                        "choice": backend, "candidates": cands})
    rid = run_id(policy, run, knob, value)
    folder = out / rid
    folder.mkdir(parents=True)
    s = {"experiment": out.name, "policy": policy, "model": "synthetic:tiny-llama", "backends": "gpu=cpu,cpu=cpu",
         "max_active": 4, "url": None, "start_time": START,
         "workload": {"requests": 8, "prefix_tokens": 496, "suffix_tokens": 20, "output_tokens": 16,
                      "arrival": "fixed", "interval": 0.05, "seed": 0, "warm": True},
         **summarize(records), "run_id": rid, "run": run, "knob": knob, "value": value}
    write_json(folder / "summary.json", s)
    write_requests(folder / "requests.csv", records)
    (folder / "routing.jsonl").write_text("".join(json.dumps(d) + "\n" for d in routing) + '{"cut sh')
    write_json(folder / "env.json", {"torch": "x", "cpu": "Intel(R) Xeon(R) CPU @ 2.20GHz",
                                     "devices": {"gpu": "Test GPU", "cpu": "Intel(R) Xeon(R) CPU @ 2.20GHz"}})


def experiment(tmp_path: Path, knob=None, values=(None,), policies=("gpu-only", "mixed"), fail=False) -> Path:
    out = tmp_path / ("sweep" if knob else "plain")
    for v in values:
        for p in policies:
            for run in (1, 2, 3):
                fake_run(out, p, run, knob, v, fail=fail and run == 2)
    write_aggregate(out)
    return out


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_report_writes_every_chart(tmp_path):
    out = experiment(tmp_path, fail=True)
    written = report(out)
    names = {p.name for p in written}
    assert names == {"summary.md", "makespan.png", "latency.png", "cdf.png", "timeline.png", "scores.png"}
    for p in written:
        assert p.parent == out / "report"
        if p.suffix == ".png":
            _check_png(p)
    md = (out / "report" / "summary.md").read_text()
    assert "(3 each)" in md and "| gpu-only | " in md and "| mixed | " in md
    assert "Failed requests (2)" in md and "HTTP 400: bad" in md
    assert "![timeline](timeline.png)" in md
    assert "gpu: Test GPU, cpu: Intel Xeon" in md


def test_summary_table_matches_the_runs(tmp_path):
    out = experiment(tmp_path)
    report(out)
    md = (out / "report" / "summary.md").read_text()
    agg = json.loads((out / "aggregate.json").read_text())
    mixed = next(r for r in agg if r["policy"] == "mixed")
    makespans = [json.loads(p.read_text())["makespan"] for p in out.glob("mixed-run*/summary.json")]
    assert mixed["metrics"]["makespan"]["mean"] == pytest.approx(sum(makespans) / 3)
    assert f"| {sum(makespans) / 3:.2f}±" in md
    base = next(r for r in agg if r["policy"] == "gpu-only")
    change = mixed["change_vs_gpu_only"]["makespan"]
    assert change == pytest.approx(100 * (sum(makespans) / 3 / base["metrics"]["makespan"]["mean"] - 1))
    assert "start_time" not in mixed["metrics"] and "run" not in mixed["metrics"]
    assert f"| mixed | {change:+.1f} |" in md  # the change table after the one with batch first


def test_sweep_report_has_the_sweep_chart(tmp_path):
    out = experiment(tmp_path, knob="workload.suffix_tokens", values=(20, 200))
    names = {p.name for p in report(out, tmp_path / "charts")}
    assert {"sweep.png", "makespan.png", "latency-suffix_tokens=20.png", "timeline-suffix_tokens=200.png",
            "scores-suffix_tokens=20.png"} <= names
    for p in (tmp_path / "charts").glob("*.png"):
        _check_png(p)
    assert "sweep: `workload.suffix_tokens` over 20, 200" in (tmp_path / "charts" / "summary.md").read_text()


def test_no_scores_chart_without_a_scoring_policy(tmp_path):
    out = experiment(tmp_path, policies=("gpu-only", "round-robin"))
    names = {p.name for p in report(out)}
    assert "scores.png" not in names and "timeline.png" in names
    assert "no scores chart" in (out / "report" / "summary.md").read_text()


def test_report_all_does_every_experiment(tmp_path):
    experiment(tmp_path)
    experiment(tmp_path, knob="max_active", values=(2, 4))
    (tmp_path / "empty").mkdir()
    written = report_all(root=tmp_path)
    assert (tmp_path / "plain" / "report" / "summary.md") in written
    assert (tmp_path / "sweep" / "report" / "sweep.png") in written
    assert not (tmp_path / "empty" / "report").exists()


def test_report_all_finds_experiments_a_level_down(tmp_path):
    """results/compiled-gpu/<name>/ is an experiment too; an experiment's own simulated/ is not searched."""
    nested = experiment(tmp_path / "compiled-gpu")
    fake_run(nested / "simulated", "gpu-only", 1)
    written = report_all(root=tmp_path)
    assert (nested / "report" / "summary.md") in written
    assert not (nested / "simulated" / "report").exists()
    assert (tmp_path / "charts" / "compiled-gpu" / "plain" / "summary.md") in report_all(root=tmp_path,
                                                                                         out=tmp_path / "charts")


def test_gzipped_run_files_load_the_same(tmp_path):
    """A results folder whose requests.csv and routing.jsonl are gzipped (experiments/compress_results.py, as
    committed) loads to the same Results and draws the same summary as the plain one bench writes."""
    plain = experiment(tmp_path / "a")
    packed = tmp_path / "b" / plain.name
    shutil.copytree(plain, packed)
    compress = [sys.executable, str(ROOT / "experiments" / "compress_results.py"), str(packed)]
    subprocess.run(compress, check=True, capture_output=True, timeout=120)
    assert not list(packed.glob("*/requests.csv")) and not list(packed.glob("*/routing.jsonl"))
    gz = sorted(packed.glob("*/*.gz"))
    assert {p.name for p in gz} == {"requests.csv.gz", "routing.jsonl.gz"} and len(gz) == 12
    before = {p: p.read_bytes() for p in gz}
    again = subprocess.run(compress, check=True, capture_output=True, text=True, timeout=120)
    assert "compressed 0 files" in again.stdout and {p: p.read_bytes() for p in gz} == before  # deterministic
    a, b = load(plain), load(packed)
    assert len(a.runs) == len(b.runs) == 6
    for x, y in zip(a.runs, b.runs):
        assert x.summary == y.summary and x.env == y.env
        pd.testing.assert_frame_equal(x.requests, y.requests)
        assert x.routing == y.routing and len(y.routing) == 8  # the line cut short is still dropped
        assert request_rows(plain / x.summary["run_id"]) == request_rows(packed / y.summary["run_id"])
    report(plain)
    report(packed)
    assert (packed / "report" / "summary.md").read_text() == (plain / "report" / "summary.md").read_text()


def test_no_runs_is_one_clear_error(tmp_path):
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ResultsError, match="holds no runs"):
        report(tmp_path / "nothing")
    with pytest.raises(ResultsError, match="does not exist"):
        report(tmp_path / "missing")
    with pytest.raises(ResultsError, match="no experiment results under"):
        report_all(root=tmp_path)
    done = subprocess.run([sys.executable, "-m", "mvllm.cli", "report", str(tmp_path / "nothing")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "holds no runs" in done.stderr and "Traceback" not in done.stderr


def test_environment_is_described():
    env = describe()
    assert env["torch"] and env["python"] and env["cpu_count"] >= 1 and isinstance(env["command"], list)
