"""The cost model and the policies, without processes: the worked example of the reference router's cost
score (the published CPU/GPU offload experiment)."""

import json

import pytest

from mvllm.errors import InvalidRequestError, MvllmError
from mvllm.routing.cost import Booking, candidate
from mvllm.routing.router import Router

RATES = {"gpu": {"prefill_rate": 2551, "decode_rate": 293}, "cpu": {"prefill_rate": 73, "decode_rate": 45}}


def test_idle_cpu_scores_3_118():
    c = candidate("cpu", [], prompt_tokens=516, cached_prefix=496, max_tokens=128, prefill_rate=73, decode_rate=45)
    assert (c.pending_prefill, c.pending_decode) == (20, 128)
    assert round(c.score, 3) == 3.118


def gpu_state(used_per_active: int, queued: int) -> list[Booking]:
    active = [Booking(f"a{i}", 516, 496, 128, active=True, actual_cached=496, generated=g)
              for i, g in enumerate(used_per_active)]
    return active + [Booking(f"q{i}", 516, 496, 128) for i in range(queued)]


def test_worked_example_request_7_and_8():
    # request 7: 4 active whose unused budgets sum to 496, 2 queued
    c7 = candidate("gpu", gpu_state([4, 4, 4, 4], 2), 516, 496, 128, 2551, 293)
    assert (c7.pending_prefill, c7.pending_decode) == (60, 880)
    assert round(c7.score, 3) == 3.027
    # request 8: request 7 now queued too, and the active ones used 8 more tokens of budget
    c8 = candidate("gpu", gpu_state([6, 6, 6, 6], 3), 516, 496, 128, 2551, 293)
    assert (c8.pending_prefill, c8.pending_decode) == (80, 1000)
    assert round(c8.score, 3) == 3.444


def test_router_places_7_on_gpu_and_8_on_cpu(tmp_path):
    log = tmp_path / "routing.jsonl"
    router = Router(["gpu", "cpu"], "mixed", RATES, log)
    router.bookings["gpu"] = {b.request_id: b for b in gpu_state([4, 4, 4, 4], 2)}
    cached = {"gpu": 496, "cpu": 496}
    assert router.route("r7", 516, 128, cached) == "gpu"
    for b in router.bookings["gpu"].values():
        if b.active:
            b.generated += 2
    assert router.route("r8", 516, 128, cached) == "cpu"
    router.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["choice"] for x in lines] == ["gpu", "cpu"]
    assert round(lines[0]["candidates"]["gpu"]["score"], 3) == 3.027
    assert round(lines[1]["candidates"]["gpu"]["score"], 3) == 3.444
    assert round(lines[1]["candidates"]["cpu"]["score"], 3) == 3.118
    assert lines[1]["candidates"]["cpu"]["cached_prefix"] == 496


def test_queued_request_keeps_its_routing_time_estimate():
    router = Router(["gpu", "cpu"], "mixed", RATES)
    router.route("a", 516, 128, {"gpu": 496, "cpu": 0})
    # the cache was evicted since: the booking still counts 20 prefill tokens, not 516
    c = router.candidates(516, 128, {"gpu": 0, "cpu": 0})["gpu"]
    assert c.pending_prefill == 20 + 516


def test_booking_follows_worker_events():
    router = Router(["gpu", "cpu"], "gpu-only")
    router.route("a", 100, 10, {})
    b = router.bookings["gpu"]["a"]
    assert b.pending_prefill == 100 and b.pending_decode == 10
    router.on_scheduled("gpu", "a", 32)
    assert b.active and b.pending_prefill == 68
    router.on_tokens("gpu", "a", 3)
    assert b.pending_prefill == 0 and b.pending_decode == 7
    router.on_finished("gpu", "a")
    assert router.bookings["gpu"] == {}


@pytest.mark.parametrize("policy,expected", [
    ("gpu-only", ["gpu"] * 6),
    ("cpu-only", ["cpu"] * 6),
    ("round-robin", ["gpu", "cpu"] * 3),
    ("split:2", ["cpu", "cpu", "gpu", "gpu", "gpu", "gpu"]),
])
def test_static_policies(policy, expected):
    router = Router(["gpu", "cpu"], policy)
    assert [router.route(f"r{i}", 10, 10, {}) for i in range(6)] == expected


def test_dead_backend_is_not_chosen():
    router = Router(["gpu", "cpu"], "gpu-only")
    router.route("a", 10, 10, {})
    assert router.on_dead("gpu") == ["a"]
    assert router.route("b", 10, 10, {}) == "cpu"
    router.on_dead("cpu")
    with pytest.raises(MvllmError, match="no backend is alive"):
        router.route("c", 10, 10, {})


@pytest.mark.parametrize("policy,match", [
    ("fastest", "unknown policy"), ("split:x", "K must be"), ("split:-1", "K must be"),
])
def test_bad_policies(policy, match):
    with pytest.raises(InvalidRequestError, match=match):
        Router(["gpu", "cpu"], policy)


def test_policy_needs_named_backends_and_mixed_needs_rates():
    with pytest.raises(InvalidRequestError, match="needs a backend named 'cpu'"):
        Router(["a", "gpu"], "cpu-only")
    with pytest.raises(MvllmError, match="--profile"):
        Router(["gpu", "cpu"], "mixed", {"gpu": RATES["gpu"]})


H200 = {  # shapes of a profile measured on the H200 machine (qwen2.5-0.5b): GPU bf16 graphs, CPU int8
    "gpu": {"prefill_rate": 50000.0, "decode_rate": 1718.0,
            "decode": [{"batch": b, "step_ms": ms} for b, ms in enumerate([2.06, 2.19, 2.2, 2.33], 1)]},
    "cpu": {"prefill_rate": 1400.0, "decode_rate": 131.0,
            "decode": [{"batch": b, "step_ms": ms} for b, ms in enumerate([27.4, 29.5, 31.1, 30.6], 1)]},
}


def test_finish_time_of_a_request_on_an_idle_backend():
    from mvllm.routing.eta import Timing, finish_time

    t = Timing.from_profile(H200["cpu"])
    assert finish_time(t, ([], [], []), new_prefill=14, new_decode=10) == pytest.approx(14 / 1400 + 10 * 0.0274)


def test_finish_time_waits_for_a_free_slot_and_batches():
    from mvllm.routing.eta import Timing, finish_time

    t = Timing(prefill_rate=100.0, step_s=[0.1, 0.2])  # max_active 2
    active = ([3, 1], [], [])  # decode left of the admitted ones (a made 2 of 5, b 4 of 5), none waiting
    # b ends after 1 step at batch 2; the new request (prefill 10 = 0.1 s) joins a; a ends after 2 more steps;
    # then the new one runs alone for its last 1 token
    expected = 1 * 0.2 + 0.1 + 2 * 0.2 + 1 * 0.1
    assert finish_time(t, active, new_prefill=10, new_decode=3) == pytest.approx(expected)


def test_eta_keeps_a_request_off_a_cpu_that_would_finish_it_later():
    gpu = [Booking(f"a{i}", 516, 496, 128, active=True, actual_cached=496, generated=28) for i in range(4)]
    gpu += [Booking(f"q{i}", 516, 496, 128) for i in range(20)]
    cached = {"gpu": 496, "cpu": 496}
    mixed, eta = Router(["gpu", "cpu"], "mixed", H200), Router(["gpu", "cpu"], "eta", H200)
    for r in (mixed, eta):
        r.bookings["gpu"] = {b.request_id: b for b in gpu}
    # the reference score prices the lone CPU request at the CPU's batch-4 rate (128/131 s) and sends it there
    assert mixed.route("new", 516, 128, cached) == "cpu"
    # its finish-time estimate knows a lone request decodes at the batch-1 step (128 * 27.4 ms = 3.5 s),
    # later than the GPU would finish it behind its queue (~1.8 s)
    cands = eta.candidates(516, 128, cached)
    assert cands["cpu"].eta == pytest.approx(20 / 1400 + 128 * 0.0274)
    assert 1.5 < cands["gpu"].eta < 2.0
    assert eta.route("new", 516, 128, cached) == "gpu"


def test_eta_needs_step_times():
    with pytest.raises(MvllmError, match="per-batch decode step times"):
        Router(["gpu", "cpu"], "eta", RATES)


def test_makespan_policy_keeps_the_batch_end_earliest_where_eta_would_not():
    from mvllm.routing.cost import Candidate
    from mvllm.routing.policies import make_policy

    gpu = Candidate("gpu", 0, 0, 1.0, 10.0, 0, eta=5.0, drain=5.0, idle_drain=4.9)
    cpu = Candidate("cpu", 0, 0, 1.0, 1.0, 0, eta=4.0, drain=8.0, idle_drain=7.9)
    cands = {"gpu": gpu, "cpu": cpu}
    assert make_policy("eta", ["gpu", "cpu"]).choose(["gpu", "cpu"], cands) == "cpu"
    assert make_policy("makespan", ["gpu", "cpu"]).choose(["gpu", "cpu"], cands) == "gpu"
    gpu.drain = cpu.drain = 9.0  # the batch ends at 9 s either way: the request's own finish decides
    assert make_policy("makespan", ["gpu", "cpu"]).choose(["gpu", "cpu"], cands) == "cpu"


def test_drain_time_is_when_the_last_booked_request_ends():
    from mvllm.routing.eta import Timing, drain_time, finish_time

    timing = Timing(prefill_rate=1000.0, step_s=[0.01, 0.02])
    booked = ([100], [10], [(10, 10), (10, 10)])  # a admitted (its prompt not yet run), b and c waiting
    assert drain_time(timing, ([], [], [])) == 0.0
    end = drain_time(timing, booked)
    # prefill of a, then b; 10 steps of a+b; prefill of c; 10 steps of a+c; a alone for its last 80
    assert end == pytest.approx(0.01 + 0.01 + 10 * 0.02 + 0.01 + 10 * 0.02 + 80 * 0.01)
    assert finish_time(timing, booked, 10, 5) < drain_time(timing, booked, (10, 5))


def test_eta_keeps_a_request_home_unless_elsewhere_is_clearly_sooner():
    """Home is the backend of the highest profiled throughput; another backend wins only when it is predicted
    to finish the request more than ETA_MARGIN sooner (a smaller gain is inside the model's error)."""
    from mvllm.routing.cost import Candidate
    from mvllm.routing.policies import ETA_MARGIN, make_policy

    eta = make_policy("eta", ["gpu", "cpu"])
    gpu = Candidate("gpu", 0, 0, 1.0, 1600.0, 0, eta=1.0)
    cpu = Candidate("cpu", 0, 0, 1.0, 150.0, 0, eta=1.0 / (1 + ETA_MARGIN) + 1e-6)
    cands = {"gpu": gpu, "cpu": cpu}
    assert eta.choose(["gpu", "cpu"], cands) == "gpu"  # 4.99% sooner on the cpu: stays
    cpu.eta = 1.0 / (1 + ETA_MARGIN) - 1e-3
    assert eta.choose(["gpu", "cpu"], cands) == "cpu"  # clearly sooner: moves
    assert eta.choose(["cpu"], cands) == "cpu"  # the home backend is among the alive ones


def test_policy_names_come_from_one_registry():
    """POLICIES, the experiment check and make_policy agree; the router asks a policy what it needs, not its
    name; split:K is K requests to the backend named cpu, though the class takes any two backends."""
    from mvllm.bench.experiment import ExperimentError, check_policy
    from mvllm.routing.policies import PARAMETRISED, POLICIES, REGISTRY, Split, is_known, make_policy

    assert POLICIES == ("mixed", "eta", "eta-caps", "new-token-ratio", "oracle", "makespan", "gpu-only",
                        "cpu-only", "round-robin", "sglang-cache", "kv-cost", "slo", "split:K", "share:P")
    for name in REGISTRY:
        assert is_known(name) and check_policy(name) == name
        assert make_policy(name, ["gpu", "cpu"]).name == name
    assert set(PARAMETRISED) == {"split"} and is_known("split:0") and check_policy("split:12") == "split:12"
    for bad in ("split:K", "split:", "split:-1", "split:x", "mixed:2", "fastest", ""):
        assert not is_known(bad)
        with pytest.raises(ExperimentError, match="unknown policy"):
            check_policy(bad)
    needs = {n: (p.needs_rates, p.needs_timing, p.needs_drain)
             for n in ("mixed", "eta", "makespan", "gpu-only", "round-robin", "split:1")
             for p in [make_policy(n, ["gpu", "cpu"])]}
    assert needs == {"mixed": (True, False, False), "eta": (True, True, False), "makespan": (True, True, True),
                     "gpu-only": (False, False, False), "round-robin": (False, False, False),
                     "split:1": (False, False, False)}
    split = make_policy("split:1", ["gpu", "cpu"])
    assert (split.offload, split.home) == ("cpu", "gpu")
    other = Split(2, offload="b", home="a")
    assert [other.choose(["a", "b"], {}) for _ in range(4)] == ["b", "b", "a", "a"]
    with pytest.raises(InvalidRequestError, match="needs a backend named 'cpu'"):
        make_policy("split:1", ["a", "gpu"])
