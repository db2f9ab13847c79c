"""slo routes by an SLO (overflow to a backend that meets it, a lost request to one that meets it for no one);
share:P spreads a fixed fraction to the CPU; bad SLOs are refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mvllm.bench.experiment import apply, load
from mvllm.cli import app
from mvllm.errors import InvalidRequestError
from mvllm.routing.policies import is_known, make_policy
from mvllm.routing.policies.registry import uses_slo
from mvllm.routing.router import Router
from mvllm.server.serve import choose_policy, unmet_warning
from mvllm.simulate.capacity import capacity
from mvllm.simulate.reference import profile as m2_profile
from mvllm.slo import parse_slo

ROOT = Path(__file__).resolve().parent.parent

LOOSE = {"ttft_ms": 2000.0, "tpot_ms": 100.0}


def m2_router(slo=LOOSE, policy="slo") -> Router:
    return Router(["gpu", "cpu"], policy, m2_profile(0.8)["backends"], slo=slo)


def test_share_spreads_a_fraction_evenly_and_refuses_a_bad_one():
    p = make_policy("share:0.25", ["gpu", "cpu"])
    picks = [p.choose(["gpu", "cpu"], {}) for _ in range(100)]
    assert picks.count("cpu") == 25 and picks[:8] == ["gpu", "gpu", "gpu", "cpu"] * 2
    assert [make_policy("share:0", ["gpu", "cpu"]).choose(["gpu", "cpu"], {}) for _ in range(5)] == ["gpu"] * 5
    assert is_known("share:0.3") and not is_known("share:1.5") and not is_known("share:x")
    for bad in ("share:1.5", "share:-0.1", "share:half"):
        with pytest.raises(InvalidRequestError, match="fraction"):
            make_policy(bad, ["gpu", "cpu"])


def test_slo_needs_an_slo_and_no_other_policy_takes_one():
    assert uses_slo("slo") and not uses_slo("eta") and not uses_slo("share:0.1")
    with pytest.raises(InvalidRequestError, match="needs an SLO"):
        m2_router(slo=None)
    with pytest.raises(InvalidRequestError, match="does not route by an SLO"):
        m2_router(policy="eta")
    r = m2_router(slo=None, policy="eta")
    with pytest.raises(InvalidRequestError, match="does not route by an SLO"):
        r.set_policy("mixed", LOOSE)
    assert r.policy.name == "eta"  # a refused switch changes nothing
    r.set_policy("slo", LOOSE)
    assert r.policy.slo == LOOSE


def test_slo_overflows_to_the_cpu_only_past_the_gpus_ttft_bound():
    r = m2_router()
    placed = [r.route(f"r{i}", 516, 128, {"gpu": 496, "cpu": 496}) for i in range(12)]
    # the M2's GPU serves 4 at 13.7 ms a step (1.75 s a request): the 5th would wait for its first token 1.80 s,
    # past the 10% headroom of 2 s; on the CPU it gets it in 0.35 s
    assert placed[:5] == ["gpu"] * 4 + ["cpu"] and placed.count("cpu") < 8
    e = m2_router(slo=None, policy="eta")
    assert [e.route(f"r{i}", 516, 128, {"gpu": 496, "cpu": 496}) for i in range(12)] == ["gpu"] * 12


def test_slo_offloads_from_a_tenth_of_the_ttft_bound_where_the_cpu_fits_easily():
    def placed(tpot_ms: float) -> list[str]:
        r = m2_router({"ttft_ms": 9000.0, "tpot_ms": tpot_ms})
        return [r.route(f"r{i}", 516, 128, {"gpu": 496, "cpu": 496}) for i in range(5)]

    # the 5th request would wait 1.80 s on the GPU: a fifth of the 9 s bound. The CPU gives it its first token
    # in 0.35 s and steps at 76 ms: within half of a 200 ms TPOT bound it fits easily, and takes it; within 120 ms
    # only closely, and the GPU, under a quarter of the bound, keeps it
    assert placed(200.0) == ["gpu"] * 4 + ["cpu"]
    assert placed(120.0) == ["gpu"] * 5


def test_slo_sends_a_lost_request_to_a_backend_that_meets_the_slo_for_no_one():
    tight = {"ttft_ms": 2000.0, "tpot_ms": 50.0}  # the M2's CPU steps at 62 ms and more: it meets this for no one
    r = m2_router(tight)
    assert unmet_warning(r) is None  # the GPU meets it
    placed = [r.route(f"r{i}", 516, 128, {"gpu": 496, "cpu": 496}) for i in range(12)]
    assert placed[:8] == ["gpu"] * 8 and set(placed[8:]) == {"cpu"}
    lost = m2_router({"tpot_ms": 5.0})
    assert "no backend meets" in unmet_warning(lost) and "tpot" in unmet_warning(lost)


def test_simulated_m2_capacity_slo_carries_more_than_eta_and_mixed():
    exp = load(ROOT / "experiments/paper-48.toml")
    exp.backends = "gpu=mps,cpu=cpu"
    exp = apply(apply(apply(exp, "workload.arrival", "poisson"), "workload.rate", 8.0), "workload.requests", 400)
    found = {r["policy"]: r["capacity"] for r in
             capacity(exp, m2_profile(0.8), ["gpu-only", "mixed", "eta", "slo"], LOOSE, 0.99, (1.0, 8.0), 0.02)}
    assert found["eta"] == found["gpu-only"]
    assert found["slo"] > found["mixed"] > found["gpu-only"]


def test_serve_target_slo_picks_slo_and_refuses_bad_input_in_one_line():
    assert choose_policy(None, "profile.json", None, LOOSE) == "slo"
    assert choose_policy(None, "profile.json", None) == "eta"
    assert choose_policy(None, None, None, LOOSE) == "gpu-only"
    profile = str(ROOT / "results/capacity/profile.json")
    runner = CliRunner()
    for args, message in [
        (["--target-slo", "ttft:abc"], "positive number"),
        (["--target-slo", "ttft:-5"], "positive number"),
        (["--target-slo", "speed:5"], "unknown metric"),
        (["--target-slo", "ttft:500", "--policy", "eta", "--profile", profile], "does not route by an SLO"),
        (["--policy", "slo", "--profile", profile], "needs an SLO"),
    ]:
        result = runner.invoke(app, ["serve", "--model", "synthetic:tiny-qwen2", "--backends", "gpu=cpu,cpu=cpu",
                                     *args])
        assert result.exit_code == 2, result.output
        assert message in result.output and "Traceback" not in result.output
    assert parse_slo(["ttft:2000 tpot:100"]) == LOOSE


def test_slo_keeps_a_prefill_off_a_backend_where_it_would_stall_a_short_request_past_the_tpot_bound():
    from mvllm.routing.cost import Booking

    def place(short: bool) -> str:
        r = m2_router()
        for i in range(8):  # the GPU queues: its TTFT is past a quarter of the bound
            r.bookings["gpu"][f"g{i}"] = Booking(f"g{i}", 516, 496, 128)
        if short:  # 10 tokens to make: the new prompt's 1.4 s CPU prefill adds 150 ms to each of its steps
            r.bookings["cpu"]["s"] = Booking("s", 516, 496, 10, active=True)
        r.replayed.clear()
        return r.route("new", 116, 128, {"gpu": 16, "cpu": 16})

    assert place(short=False) == "cpu" and place(short=True) == "gpu"


def test_lengths_ends_by_is_the_chance_a_request_ends_within_a_length():
    from mvllm.routing.lengths import Lengths

    lengths = Lengths(min_finished=4, refit_every=1)
    assert lengths.ends_by(0, 2048, 10) == 0.0 and lengths.ends_by(0, 10, 10) == 1.0  # no fit: the cap decides
    for n in (5, 5, 50, 50):
        lengths.finished(n, stopped=True)
    assert lengths.ends_by(0, 2048, 10) == pytest.approx(0.5)  # half end at 5
    assert lengths.ends_by(6, 2048, 10) == 0.0 and lengths.ends_by(6, 2048, 50) == pytest.approx(1.0)


def test_slo_keeps_a_long_prefill_off_a_request_that_may_be_short_where_lengths_are_hidden():
    from mvllm.routing.cost import Booking

    def place(made_short: bool) -> str:
        r = m2_router()
        for n in ([4] * 8 + [200] * 8) if made_short else [200] * 16:  # replies seen: half end at 4 tokens
            r.lengths.finished(n, stopped=True)
        for i in range(8):  # the GPU queues: its TTFT is past a quarter of the bound
            r.bookings["gpu"][f"g{i}"] = Booking(f"g{i}", 516, 496, 2048)
        r.bookings["cpu"]["s"] = Booking("s", 516, 496, 2048, active=True)  # its length is not told
        r.replayed.clear()
        return r.route("new", 116, 2048, {"gpu": 16, "cpu": 16})

    # the CPU's 1.4 s prefill of the new prompt would push a 4-token reply past 100 ms a token
    assert place(made_short=False) == "cpu" and place(made_short=True) == "gpu"


def test_slo_counts_the_prefills_that_refill_the_slots_freed_while_a_request_runs():
    from mvllm.routing.cost import Booking

    def place(ending_soon: bool) -> str:
        r = m2_router()
        for i in range(8):  # the GPU queues: its TTFT is past a quarter of the bound
            r.bookings["gpu"][f"g{i}"] = Booking(f"g{i}", 516, 496, 128)
        for i in range(3):  # the CPU runs 3 long requests: 10 tokens left each, or 1,000
            r.bookings["cpu"][f"c{i}"] = Booking(f"c{i}", 516, 496, 1000, active=True,
                                                 generated=990 if ending_soon else 1)
        r.replayed.clear()
        return r.route("new", 116, 128, {"gpu": 16, "cpu": 16})

    # at batch 4 the M2's CPU steps at 89 ms; the three slots that free while the new request runs take
    # prefills of ~1.4 s each, 32 ms more a token over its 128: past the 100 ms bound
    assert place(ending_soon=False) == "cpu" and place(ending_soon=True) == "gpu"
