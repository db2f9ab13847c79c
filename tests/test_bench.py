"""`mvllm bench`: experiment files, workloads, and whole runs against real servers with tiny models."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_api_servers import NULLS
from test_shutdown import TINY

from mvllm.bench import experiment as ex
from mvllm.bench.client import replay
from mvllm.bench.experiment import ExperimentError, Workload
from mvllm.bench.process import ServerError, ServerProcess
from mvllm.bench.results import read_json
from mvllm.bench.runner import bench
from mvllm.bench.workload import Request, arrivals, build, token_range

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "exp.toml"
    p.write_text(text)
    return p


def test_every_shipped_experiment_loads():
    files = sorted(EXPERIMENTS.glob("*.toml"))
    assert {"paper-8", "paper-48", "smoke"} <= {f.stem for f in files}
    for f in files:
        exp = ex.load(f)
        assert exp.name == f.stem
        assert exp.points()


@pytest.mark.parametrize("name,requests", [("paper-8", 8), ("paper-48", 48)])
def test_paper_experiments_are_the_reference(name, requests):
    exp = ex.load(EXPERIMENTS / f"{name}.toml")
    w = exp.workload
    assert (w.requests, w.prefix_tokens, w.suffix_tokens, w.output_tokens) == (requests, 496, 20, 128)
    assert (w.arrival, w.interval, w.warm) == ("fixed", 0.05, True)
    assert (exp.max_active, exp.runs) == (4, 3)
    assert {"gpu-only", "mixed"} <= set(exp.policies)
    assert exp.model == "synthetic:qwen2.5-0.5b"


@pytest.mark.parametrize("text,named", [
    ('name = "x"\nmodel = "m"\n[workload]\narival = "fixed"\n', "'workload.arival'"),
    ('name = "x"\nmodel = "m"\nruns = "three"\n', "'runs' must be an integer"),
    ('name = "x"\nmodel = "m"\npolicies = ["mixed", "fastest"]\n', "'fastest'"),
    ('name = "x"\nmodel = "m"\n[workload]\narrival = "uniform"\n', "'workload.arrival'"),
    ('name = "x"\nmodel = "m"\n[workload]\nrequests = 0\n', "'workload.requests'"),
    ('name = "x"\n', "missing key 'model'"),
    ('name = "x"\nmodel = "m"\n[sweep]\nknob = "workload.colour"\nvalues = [1]\n', "'workload.colour'"),
    ('name = "x"\nmodel = "m"\n[sweep]\nknob = "max_active"\nvalues = [0]\n', "'max_active'"),
    ('name = "x"\nmodel = "m"\nworkload = 3\n', "'workload' must be a table"),
    ('name = "x"\nmodel = \n', "not valid TOML"),
])
def test_bad_experiment_names_the_key(tmp_path, text, named):
    with pytest.raises(ExperimentError) as e:
        ex.load(write(tmp_path, text))
    assert named in str(e.value)
    assert "exp.toml" in str(e.value)


def test_missing_experiment_file(tmp_path):
    with pytest.raises(ExperimentError, match="does not exist"):
        ex.load(tmp_path / "nope.toml")


def test_sweep_applies_each_value(tmp_path):
    exp = ex.load(write(tmp_path, 'name = "s"\nmodel = "m"\n[sweep]\nknob = "workload.suffix_tokens"\n'
                                  'values = [20, 100]\n'))
    assert [(v, p.workload.suffix_tokens) for v, p in exp.points()] == [(20, 20), (100, 100)]
    assert exp.workload.suffix_tokens == 20  # the default, untouched


def test_workload_prompts_share_the_prefix_and_nothing_else():
    w = Workload(requests=6, prefix_tokens=496, suffix_tokens=20, seed=3)
    prefix, reqs = build(w, 151936)
    lo, hi = token_range(151936)
    assert len(prefix) == 496 and all(len(r.prompt) == 516 for r in reqs)
    assert all(r.prompt[:496] == prefix for r in reqs)
    assert len({tuple(r.prompt[496:512]) for r in reqs}) == 6  # the 32nd block differs per request
    assert all(lo <= t < hi for r in reqs for t in r.prompt)
    again = build(w, 151936)
    assert again[0] == prefix and [r.prompt for r in again[1]] == [r.prompt for r in reqs]
    other = build(Workload(requests=6, prefix_tokens=496, suffix_tokens=20, seed=4), 151936)
    assert other[0] != prefix


def test_fixed_arrivals_are_on_the_clock():
    assert arrivals(Workload(requests=4, interval=0.05)) == pytest.approx([0.0, 0.05, 0.10, 0.15])


def _gaps(w):
    t = arrivals(w)
    return np.diff(t)


def test_poisson_and_gamma_arrivals():
    poisson = _gaps(Workload(requests=4000, arrival="poisson", rate=20.0, seed=1))
    assert statistics.fmean(poisson) == pytest.approx(0.05, rel=0.06)
    assert np.std(poisson) / np.mean(poisson) == pytest.approx(1.0, rel=0.08)  # exponential: CV 1
    bursty = _gaps(Workload(requests=4000, arrival="gamma", rate=20.0, burstiness=0.25, seed=1))
    steady = _gaps(Workload(requests=4000, arrival="gamma", rate=20.0, burstiness=4.0, seed=1))
    assert statistics.fmean(bursty) == pytest.approx(0.05, rel=0.1)
    assert statistics.fmean(steady) == pytest.approx(0.05, rel=0.06)
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.12)  # CV = 1 / sqrt(shape)
    assert np.std(steady) / np.mean(steady) == pytest.approx(0.5, rel=0.08)
    same = arrivals(Workload(requests=50, arrival="poisson", rate=20.0, seed=1))
    assert same == arrivals(Workload(requests=50, arrival="poisson", rate=20.0, seed=1))
    assert same != arrivals(Workload(requests=50, arrival="poisson", rate=20.0, seed=2))


# -- against real servers (tiny synthetic model, two CPU backends) -----------------------------------------

MODEL = "synthetic:tiny-llama"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    srv = ServerProcess(["--model", MODEL, "--backends", "gpu=cpu,cpu=cpu", "--policy", "round-robin"], log)
    with srv:
        srv.wait_ready(120)
        yield srv


def _recompute(df: pd.DataFrame, summary: dict) -> None:
    ok = df[df["error"].fillna("") == ""]
    assert summary["completed"] == len(ok) and summary["failed"] == len(df) - len(ok)
    ttft = 1000 * (ok["first_token"] - ok["arrival"])
    e2el = 1000 * (ok["finish"] - ok["arrival"])
    for name, xs in (("ttft", ttft), ("e2el", e2el)):
        assert summary[f"mean_{name}_ms"] == pytest.approx(xs.mean())
        assert summary[f"median_{name}_ms"] == pytest.approx(np.percentile(xs, 50))
        assert summary[f"p95_{name}_ms"] == pytest.approx(np.percentile(xs, 95))
        assert summary[f"p99_{name}_ms"] == pytest.approx(np.percentile(xs, 99))
    tpot = (e2el - ttft) / (ok["output_tokens"] - 1)
    assert summary["median_tpot_ms"] == pytest.approx(np.percentile(tpot, 50))
    itl = [float(x) for s in ok["itl_ms"].fillna("") for x in str(s).split()]
    assert summary["median_itl_ms"] == pytest.approx(np.percentile(itl, 50), abs=1e-3)
    assert summary["total_output_tokens"] == ok["output_tokens"].sum()
    assert summary["total_input_tokens"] == ok["prompt_tokens"].sum()
    assert summary["makespan"] == pytest.approx(ok["finish"].max() - df["arrival"].min())
    assert summary["output_throughput"] == pytest.approx(ok["output_tokens"].sum() / summary["duration"])
    assert summary["backend_requests"] == ok["backend"].value_counts().to_dict()


def test_smoke_experiment_end_to_end(tmp_path):
    out = tmp_path / "smoke"
    done = subprocess.run([sys.executable, "-m", "mvllm.cli", "bench", str(EXPERIMENTS / "smoke.toml"), "--out",
                           str(out), "--quiet"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    exp = ex.load(EXPERIMENTS / "smoke.toml")
    runs = sorted(out.glob("*/summary.json"))
    assert len(runs) == len(exp.policies) * exp.runs
    for path in runs:
        folder = path.parent
        s = read_json(path)
        df = pd.read_csv(folder / "requests.csv", keep_default_na=False, na_values={"first_token": [""]})
        assert len(df) == exp.workload.requests and s["failed"] == 0
        _recompute(df, s)
        assert (df["prompt_tokens"] == exp.workload.prefix_tokens + exp.workload.suffix_tokens).all()
        assert (df["output_tokens"] == exp.workload.output_tokens).all()
        assert (df["cached_tokens"] >= exp.workload.prefix_tokens).all()  # the warmed prefix was found
        assert set(s["warm_cached_tokens"]) == {"gpu", "cpu"}
        routing = (folder / "routing.jsonl").read_text().splitlines()
        assert len(routing) == exp.workload.requests
        env = s["environment"]
        assert env["torch"] and env["cpu"] and "bench" in env["command"]
        assert (folder / "server.log").is_file()
        if s["policy"] == "gpu-only":
            assert s["backend_requests"] == {"gpu": exp.workload.requests}
    agg = read_json(out / "aggregate.json")
    mixed = next(r for r in agg if r["policy"] == "mixed")
    assert "makespan" in mixed["change_vs_gpu_only"]
    assert (out / "aggregate.csv").read_text().count("\n") > 10
    done = subprocess.run([sys.executable, "-m", "mvllm.cli", "report", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("makespan", "latency", "timeline", "scores"):
        png = out / "report" / f"{name}.png"
        assert png.stat().st_size > 10_000 and f"![{name}]({name}.png)" in (out / "report" / "summary.md").read_text()


def test_url_mode_against_an_external_server(server, tmp_path):
    exp = ex.from_dict({"name": "ext", "model": "ignored", "runs": 1, "warmup": 3,
                        "workload": {"requests": 4, "prefix_tokens": 32, "suffix_tokens": 4, "output_tokens": 8,
                                     "vocab": 512}})
    rows = bench(exp, tmp_path / "ext", url=server.url + "/", quiet=True)
    s = read_json(tmp_path / "ext" / "external-run1" / "summary.json")
    assert s["url"] == server.url and s["policy"] == "external" and s["completed"] == 4
    assert s["model"] == MODEL  # what that server serves, not the experiment's "ignored"
    assert s["warm_cached_tokens"] is None  # nothing warmed on a server it does not own
    assert s["total_output_tokens"] == 32 and sum(s["backend_requests"].values()) == 4
    assert not (tmp_path / "ext" / "external-run1" / "server.log").exists()
    assert rows[0]["policy"] == "external"


def test_a_failing_request_is_counted_and_the_rest_go_on(server):
    reqs = [Request(0, [5, 6, 7, 8], 4, 0.0), Request(1, [5, 6, 10_000], 4, 0.01), Request(2, [9, 9, 9], 4, 0.02)]
    records, duration, _ = asyncio.run(replay(server.url, MODEL, reqs, 30.0))
    assert [r.ok for r in records] == [True, False, True]
    assert "HTTP 400" in records[1].error and "vocabulary" in records[1].error
    assert records[0].output_tokens == 4 and records[2].output_tokens == 4
    assert all(r.backend in ("gpu", "cpu") for r in (records[0], records[2]))


def test_server_that_never_gets_ready_times_out_with_its_log(tmp_path):
    exp = ex.from_dict({"name": "slow", "model": MODEL, "backends": "gpu=cpu,cpu=cpu", "policies": ["gpu-only"],
                        "runs": 1, "ready_timeout": 0.5})
    with pytest.raises(ServerError, match=r"not ready after 0.5 s; its last log lines"):
        bench(exp, tmp_path / "slow", quiet=True)
    assert not list((tmp_path / "slow").glob("*/summary.json"))


def test_server_that_dies_reports_its_log(tmp_path):
    exp = ex.from_dict({"name": "dead", "model": "synthetic:no-such-model", "backends": "gpu=cpu,cpu=cpu",
                        "policies": ["gpu-only"], "runs": 1, "ready_timeout": 60})
    with pytest.raises(ServerError) as e:
        bench(exp, tmp_path / "dead", quiet=True)
    assert "exited with code" in str(e.value) and "no-such-model" in str(e.value)


@pytest.mark.parametrize("args,message", [
    (["--policy", "fastest"], "unknown policy 'fastest'"),
    (["--runs", "0"], "--runs must be at least 1"),
])
def test_cli_bad_input_is_one_line(tmp_path, args, message):
    done = subprocess.run([sys.executable, "-m", "mvllm.cli", "bench", str(EXPERIMENTS / "smoke.toml"), "--out",
                           str(tmp_path / "x"), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_cli_missing_experiment_file(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mvllm.cli", "bench", str(tmp_path / "none.toml")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and "does not exist" in done.stderr and "Traceback" not in done.stderr


def test_bench_warms_each_server_it_starts_up_and_times_none_of_it(tmp_path):
    """`warmup` (or bench --warmup N): N requests at once on each new server before its run, replies dropped; the
    run's routing log holds its own requests only, and the summary says what the warm-up sent."""
    from typer.testing import CliRunner

    from mvllm.cli import app

    (tmp_path / "exp.toml").write_text(f'''name = "warm"
model = "{TINY}"
backends = "{NULLS}"
policies = ["round-robin", "gpu-only"]
runs = 1
server = "fresh"
max_active = 8
client_workers = 1
warmup = 5
[workload]
requests = 12
prefix_tokens = 8
suffix_tokens = 4
output_tokens = 6
arrival = "fixed"
interval = 0.01
''')
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", str(tmp_path / "exp.toml"), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    for run in ("round-robin-run1", "gpu-only-run1"):
        summary = json.loads((out / run / "summary.json").read_text())
        assert summary["completed"] == 12 and summary["warmup"]["requests"] == 5 and summary["warmup"]["failed"] == 0
        routed = (out / run / "routing.jsonl").read_text().splitlines()
        assert len(routed) == 12, routed[:3]
    bad = CliRunner().invoke(app, ["bench", str(tmp_path / "exp.toml"), "--out", str(out), "--warmup", "-1"])
    assert bad.exit_code != 0 and "--warmup must be 0 or more, got -1" in bad.output
    (tmp_path / "bad.toml").write_text((tmp_path / "exp.toml").read_text().replace("warmup = 5", "warmup = -2"))
    bad = CliRunner().invoke(app, ["bench", str(tmp_path / "bad.toml"), "--out", str(out)])
    assert bad.exit_code != 0 and "warmup" in bad.output and "must be 0 or more" in bad.output
