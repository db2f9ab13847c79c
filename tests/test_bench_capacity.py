"""bench --slo: the capacity search measured on live servers (a tiny synthetic model on two CPU backends, and
the stub server for the cheap paths), what it writes, an interruption, and the one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mvllm.bench.metrics import meets
from mvllm.bench.results import read_json, records_from_rows, request_rows
from mvllm.bench.stub import StubServer
from mvllm.capacity import Goal, run_capacity
from mvllm.cli import app
from mvllm.errors import MvllmError

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

# Six requests of 48 shared + 8 own tokens and 128 out, on backends of one active request each: a burst queues
# for hundreds of ms, 4 requests/s does not queue at all.
TINY = """name = "cap"
model = "synthetic:tiny-llama"
backends = "gpu=cpu,cpu=cpu"
max_active = 1
policies = ["gpu-only", "round-robin"]
runs = 1
ready_timeout = 120
request_timeout = 60
client_workers = 1
[workload]
requests = 6
prefix_tokens = 48
suffix_tokens = 8
output_tokens = 128
arrival = "fixed"
interval = 0.1
"""

STUB = """name = "stubcap"
model = "stub"
runs = 1
client_workers = 1
[workload]
requests = 6
prefix_tokens = 8
suffix_tokens = 4
output_tokens = 8
vocab = 512
arrival = "poisson"
rate = 20.0
"""


def _exp(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.toml"
    path.write_text(text)
    return path


def _cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mvllm.cli", "bench", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_measured_search_finds_each_policys_capacity_on_live_servers(tmp_path):
    out = tmp_path / "out"
    done = _cli(_exp(tmp_path, TINY), "--out", out, "--slo", "ttft:150", "--loads", "4:64", "--tolerance", "0.5")
    assert done.returncode == 0, done.stderr[-3000:]
    folder = out / "capacity"
    data = json.loads((folder / "capacity.json").read_text())
    assert data["measured"] is True and data["complete"] is True and data["slo"] == {"ttft_ms": 150.0}
    assert (data["knob"], data["unit"], data["experiment_load"]) == ("workload.interval", "requests/s", 10.0)
    assert data["server"] == "one per policy, kept across its points" and data["client_workers"] == 1
    assert [p["policy"] for p in data["policies"]] == ["gpu-only", "round-robin"]
    for p in data["policies"]:
        loads = [x["load"] for x in p["points"]]
        assert p["complete"] and loads == sorted(loads) and loads[0] == 4.0
        passed = [x["load"] for x in p["points"] if x["share"] >= 0.99]
        failed = [x["load"] for x in p["points"] if x["share"] < 0.99]
        assert p["capacity"] == max(passed)
        assert p["above"] is None or (p["above"] == min(failed) and p["above"] / p["capacity"] - 1 <= 0.5)
        for x in p["points"]:  # each point a bench run on disk, its share recounted from its requests
            s = read_json(folder / x["run"] / "summary.json")
            assert s["policy"] == p["policy"] and s["load"] == x["load"] and s["server"] == "shared"
            assert s["value"] == pytest.approx(1 / x["load"]) and s["knob"] == "workload.interval"
            assert "saturated" in x["client"] and x["requests"] == 6 and s["good_requests"] <= 6
            records = records_from_rows(request_rows(folder / x["run"]))
            assert x["share"] == sum(r.ok and meets(data["slo"], r) for r in records) / 6
            routed = [json.loads(line) for line in (folder / x["run"] / "routing.jsonl").read_text().splitlines()]
            assert [r["policy"] for r in routed if "choice" in r] == [p["policy"]] * 6  # this run's slice
    # one server a policy, kept across its points
    logs = sorted(folder.glob("server-*/server.log"))
    assert [("policy gpu-only" in x.read_text(), "policy round-robin" in x.read_text()) for x in logs] == [
        (True, False), (False, True)]
    assert (folder / "capacity.png").stat().st_size > 1000 and (folder / "aggregate.json").is_file()
    assert "gpu-only at 4 requests/s: 100.0% meet the SLO" in done.stderr
    assert "round-robin: " in done.stderr and "wrote " in done.stderr


def test_no_load_meeting_the_slo_names_the_lowest(tmp_path):
    with StubServer() as stub:
        done = _cli(_exp(tmp_path, STUB), "--url", stub.url, "--out", tmp_path / "out", "--slo", "ttft:0.001",
                    "--loads", "2:4", "--quiet")
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == "error: no policy meets the SLO even at the lowest load tried, 2 requests/s"
    assert "external: no load meets the SLO: even the lowest tried, 2, misses it" in lines[0]
    data = json.loads((tmp_path / "out" / "capacity" / "capacity.json").read_text())
    assert data["complete"] and [len(p["points"]) for p in data["policies"]] == [1]
    # below the 99% asked: the stub answers in about a millisecond, yet a loaded host once timed 1 of 6 inside 1 µs
    assert data["url"].startswith("http://127.0.0.1:") and data["policies"][0]["points"][0]["share"] < 0.99


def default_sigint() -> None:
    """A terminal's Ctrl-C: SIGINT at its default in the child (a shell's background job, as a CI runner may
    start the suite, has it ignored, and an ignored signal stays ignored across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.serial  # Ctrl-C must land mid-search: a second busy test process lets the search end first
def test_ctrl_c_keeps_the_points_measured(tmp_path):
    """Ctrl-C mid-search (each point of 6 requests at 1-2/s lasts seconds, so the signal lands inside the search)."""
    path = tmp_path / "out" / "capacity" / "capacity.json"
    with StubServer() as stub:
        proc = subprocess.Popen([sys.executable, "-m", "mvllm.cli", "bench", str(_exp(tmp_path, STUB)), "--url",
                                 stub.url, "--out", str(tmp_path / "out"), "--slo", "ttft:10000", "--loads", "1:2",
                                 "--quiet"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, preexec_fn=default_sigint)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if path.is_file() and '"load"' in path.read_text():
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err[-2000:]
    assert err.strip().splitlines()[-1] == f"error: interrupted; the points measured so far are in {path}"
    data = json.loads(path.read_text())
    assert data["complete"] is False and data["policies"][0]["points"]
    assert (path.parent / "capacity.png").is_file()


def test_an_error_mid_search_keeps_the_points_before_it(tmp_path, capsys):
    """The driver both commands share: each point on disk as it comes, an error after them one line."""
    from rich.console import Console

    from mvllm.bench import experiment as ex

    exp = ex.load(_exp(tmp_path, TINY))
    seen = []

    def measure(policy, load, point):
        if len(seen) == 3:
            raise MvllmError(f"{policy} at {load:g}: the server went away")
        seen.append(point.workload.interval)
        return {"share": 1.0, "goodput": None, "p99_ttft_ms": None, "p99_tpot_ms": None, "backend_requests": {}}

    with pytest.raises(MvllmError, match=r"^gpu-only at 40: the server went away; the points measured before it "
                                         r"are in .*capacity.json$"):
        run_capacity(exp, ["gpu-only"], tmp_path, Goal({"ttft_ms": 100.0}), measure, Console(), "measured")
    data = json.loads((tmp_path / "capacity.json").read_text())
    assert seen == [0.4, 0.1, 0.05] and not data["complete"]
    assert [x["load"] for x in data["policies"][0]["points"]] == [2.5, 10.0, 20.0]


SWEEP = '[sweep]\nknob = "max_active"\nvalues = [1, 2]\n'


@pytest.mark.parametrize("args, words", [
    (["--slo", "ttft:2000 speed:5"], "--slo 'speed:5': unknown metric"),
    (["--slo", "ttft"], "--slo 'ttft': expected KEY:MS"),
    (["--slo", "ttft:500", "--loads", "4:2"], "--loads '4:2': needs 0 < LOW < HIGH"),
    (["--slo", "ttft:500", "--loads", "fast"], "--loads 'fast': expected LOW:HIGH"),
    (["--slo", "ttft:500", "--slo-share", "1.5"], "--slo-share must be in (0, 1], not 1.5"),
    (["--slo", "ttft:500", "--tolerance", "1"], "--tolerance must be in (0, 1), not 1"),
    (["--slo", "ttft:500", "--runs", "3"], "--runs does not apply with --slo"),
    (["--slo", "ttft:500", "--goodput", "e2el:900"], "--goodput does not apply with --slo"),
    (["--slo", "ttft:500", "--policy", "fastest"], "unknown policy 'fastest'"),
    (["--slo", "ttft:500", SWEEP], "cap sweeps max_active; search a copy without its sweep"),
])
def test_cli_bad_input_is_one_line(tmp_path, args, words):
    text = TINY.replace("[workload]", SWEEP + "[workload]") if SWEEP in args else TINY
    args = [a for a in args if a != SWEEP]
    res = runner.invoke(app, ["bench", str(_exp(tmp_path, text)), "--out", str(tmp_path / "out"), *args])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0]
    assert not (tmp_path / "out" / "capacity" / "server-1").exists()  # refused before any server started


def test_a_server_that_cannot_start_is_one_line(tmp_path):
    done = _cli(_exp(tmp_path, TINY.replace("synthetic:tiny-llama", "synthetic:no-such-model")), "--out",
                tmp_path / "out", "--slo", "ttft:150", "--quiet")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith("error: gpu-only at 2.5 requests/s: the server exited with code")
    assert "unknown synthetic preset 'no-such-model'" in done.stderr and "the points measured before it" in done.stderr
