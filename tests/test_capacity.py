"""simulate --slo: the bisection on synthetic curves, and the CLI's answer, files and one-line errors."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mvllm.capacity import DOUBLINGS, NoLoadMeetsError, search
from mvllm.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_bisection_finds_a_monotone_edge_within_the_tolerance():
    found = search(lambda x: x <= 7.3, 1.0, 2.0, tolerance=0.02)
    assert 7.3 / 1.02 <= found.best <= 7.3 < found.above <= found.best * 1.02
    assert found.points[0] == (1.0, True) and sorted(x for x, _ in found.points) != [x for x, _ in found.points]


def test_bisection_on_a_noisy_curve_lands_in_its_crossing_band():
    rng = random.Random(3)

    def meets(x: float) -> bool:  # the share meeting falls from 1 to 0 around 10, with a point of noise
        share = 1 - 1 / (1 + math.exp(-(x - 10) / 0.5)) + rng.gauss(0, 0.01)
        return share >= 0.9

    crossing = 10 - 0.5 * math.log(9)  # 8.90 without noise; 4 sigma of noise move it by 0.23
    for _ in range(20):
        found = search(meets, 1.0, 2.0, tolerance=0.03)
        assert crossing / 1.03 - 0.25 < found.best < crossing + 0.25 and found.above <= found.best * 1.03


def test_bisection_says_when_even_the_lowest_load_misses_or_every_load_meets():
    with pytest.raises(NoLoadMeetsError, match="even the lowest tried, 2"):
        search(lambda x: x < 1, 2.0, 4.0)
    found = search(lambda x: True, 1.0, 2.0)
    assert found.above is None and found.best == 2.0 * 2 ** DOUBLINGS


def _simulate(tmp_path, *args):
    return runner.invoke(app, ["simulate", str(ROOT / "experiments/paper-8.toml"), "--profile",
                               str(ROOT / "results/paper-8/profile.json"), "--out", str(tmp_path), *args])


def test_cli_finds_each_policys_capacity_and_draws_it(tmp_path):
    res = _simulate(tmp_path, "--policy", "gpu-only,eta", "--slo", "ttft:1000 tpot:50", "--tolerance", "0.1")
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "capacity.json").read_text())
    assert data["slo"] == {"ttft_ms": 1000.0, "tpot_ms": 50.0} and data["unit"] == "requests/s"
    for p in data["policies"]:
        passed = [x["load"] for x in p["points"] if x["share"] >= 0.99]
        failed = [x["load"] for x in p["points"] if x["share"] < 0.99]
        assert p["capacity"] == max(passed)
        assert p["above"] is None or (p["above"] == min(failed) and p["above"] / p["capacity"] - 1 <= 0.1)
    assert (tmp_path / "capacity.png").stat().st_size > 1000
    assert "gpu-only:" in res.output and "eta:" in res.output


@pytest.mark.parametrize("args, words", [
    (["--slo", "ttft:2000 speed:5"], "--slo 'speed:5': unknown metric"),
    (["--slo", "ttft"], "--slo 'ttft': expected KEY:MS"),
    (["--slo", "ttft:0.001"], "no policy meets the SLO even at the lowest load tried"),
    (["--slo", "ttft:500", "--loads", "4:2"], "--loads '4:2': needs 0 < LOW < HIGH"),
])
def test_cli_bad_slo_is_one_line(tmp_path, args, words):
    res = _simulate(tmp_path, "--policy", "gpu-only", *args)
    assert res.exit_code == 2, res.output
    assert words in res.output.strip().splitlines()[-1]
    assert "Traceback" not in res.output
