"""`mvllm report` on experiments with static splits: the oracle K, its gain over gpu-only, and the share
of that gain each adaptive policy captures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mvllm.bench.metrics import RequestRecord, summarize
from mvllm.bench.results import run_id, write_aggregate, write_json, write_requests
from mvllm.report import report


def fake_run(out: Path, policy: str, run: int, makespan: float, cpu: int, knob=None, value=None) -> None:
    """A run folder as bench writes it: 6 requests, the first `cpu` on the cpu backend, the last one
    finishing at `makespan` seconds after the first arrival."""
    records = []
    for i in range(6):
        arrival = 0.1 * i
        finish = makespan if i == 5 else arrival + 0.5
        records.append(RequestRecord(i, arrival, 100, arrival, arrival + 0.1, finish, "cpu" if i < cpu else "gpu",
                                     0, 8, [arrival + 0.1, finish]))
    rid = run_id(policy, run, knob, value)
    (out / rid).mkdir(parents=True)
    s = {"experiment": out.name, "policy": policy, "model": "synthetic:tiny-llama", "backends": "gpu=cpu,cpu=cpu",
         "max_active": 4, "url": None, "workload": {"requests": 6},
         **summarize(records), "run_id": rid, "run": run, "knob": knob, "value": value}
    write_json(out / rid / "summary.json", s)
    write_requests(out / rid / "requests.csv", records)
    write_json(out / rid / "env.json", {"devices": {"gpu": "Test GPU", "cpu": "Test CPU"}})


# makespans per run, and cpu requests per run (splits send K)
GAIN = {"gpu-only": ([10.0, 10.2, 9.8], [0, 0, 0]), "mixed": ([9.0, 9.0, 9.0], [1, 2, 1]),
        "split:0": ([10.1, 9.9, 10.0], None), "split:1": ([9.5, 9.5, 9.5], None),
        "split:2": ([8.1, 7.9, 8.0], None), "split:3": ([8.8, 8.8, 8.8], None)}
NO_GAIN = {"gpu-only": ([10.0, 10.0], [0, 0]), "mixed": ([11.0, 11.0], [3, 2]),
           "split:0": ([10.0, 10.0], None), "split:1": ([10.5, 10.5], None), "split:2": ([12.0, 12.0], None)}


def experiment(tmp_path: Path, runs: dict, knob=None, values=(None,)) -> Path:
    out = tmp_path / "exp"
    for v in values:
        for policy, (makespans, cpu) in runs.items():
            for i, m in enumerate(makespans):
                k = int(policy.split(":")[1]) if policy.startswith("split:") else cpu[i]
                fake_run(out, policy, i + 1, m + (v or 0), k, knob, v)
    write_aggregate(out)
    return out


def test_oracle_gain_and_share(tmp_path):
    out = experiment(tmp_path, GAIN)
    names = {p.name for p in report(out)}
    assert {"oracle.json", "oracle.png", "summary.md", "makespan.png"} <= names
    (e,) = json.loads((out / "report" / "oracle.json").read_text())
    assert [s["k"] for s in e["splits"]] == [0, 1, 2, 3]
    assert e["splits"][2]["mean"] == pytest.approx(8.0) and e["splits"][2]["n"] == 3
    assert e["baseline"] == "gpu-only" and e["oracle_k"] == 2
    assert e["oracle_gain"] == pytest.approx(0.2)
    (mixed,) = e["adaptive"]
    assert mixed["policy"] == "mixed" and mixed["gain"] == pytest.approx(0.1)
    assert mixed["fraction_of_oracle_gain"] == pytest.approx(0.5)
    assert mixed["cpu_requests"] == [1, 2, 1]
    assert e["splits"][3]["cpu_requests"] == [3, 3, 3]
    md = (out / "report" / "summary.md").read_text()
    assert "## Oracle: the best static split" in md
    assert "| 2 | 3 | 8.00 ± 0.10 | -20.0% |" in md
    assert "oracle: K = 2" in md and "gain 20.0%" in md
    assert "captures 50.0% of the oracle's gain; cpu requests per run: 1, 2, 1" in md
    assert "![oracle](oracle.png)" in md
    assert (out / "report" / "oracle.png").stat().st_size > 10_000


def test_no_split_beats_gpu_only(tmp_path):
    out = experiment(tmp_path, NO_GAIN)
    report(out)
    (e,) = json.loads((out / "report" / "oracle.json").read_text())
    assert e["oracle_k"] == 0 and e["oracle_gain"] == 0.0
    assert e["adaptive"][0]["gain"] == pytest.approx(-0.1)
    assert e["adaptive"][0]["fraction_of_oracle_gain"] is None
    md = (out / "report" / "summary.md").read_text()
    assert ("no static split beats gpu-only here (best K = 0); the oracle's gain is 0, so offloading whole requests has "
            "nothing to win here: mixed changed makespan by +10.0% (cpu requests per run: 3, 2)") in md
    assert "captures" not in md


def test_split_zero_is_the_baseline_without_gpu_only(tmp_path):
    runs = {k: v for k, v in GAIN.items() if k != "gpu-only"}
    out = experiment(tmp_path, runs)
    report(out)
    (e,) = json.loads((out / "report" / "oracle.json").read_text())
    assert e["baseline"] == "split:0" and e["baseline_mean"] == pytest.approx(10.0)
    assert e["oracle_gain"] == pytest.approx(0.2)
    assert "baseline: split:0" in (out / "report" / "summary.md").read_text()


def test_oracle_per_sweep_value(tmp_path):
    out = experiment(tmp_path, GAIN, knob="max_active", values=(2, 4))
    names = {p.name for p in report(out)}
    assert {"oracle.png", "sweep.png"} <= names
    entries = json.loads((out / "report" / "oracle.json").read_text())
    assert [e["value"] for e in entries] == [2, 4]
    assert entries[1]["oracle_k"] == 2 and entries[1]["oracle_gain"] == pytest.approx(2 / 14)
    md = (out / "report" / "summary.md").read_text()
    assert "### max_active = 2" in md and "### max_active = 4" in md


def test_no_oracle_with_one_split(tmp_path):
    out = experiment(tmp_path, {k: GAIN[k] for k in ("gpu-only", "mixed", "split:1")})
    names = {p.name for p in report(out)}
    assert "oracle.json" not in names and "oracle.png" not in names
    assert "Oracle" not in (out / "report" / "summary.md").read_text()
