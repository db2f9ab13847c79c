"""Routing real traffic: the output-length estimate (Kaplan-Meier over finished requests), SGLang's
new_token_ratio, eta's O(n log n) replay against the old step-by-step one, the eta variants (eta, eta-caps,
oracle, new-token-ratio) and the field's peers (sglang-cache, kv-cost) through the Router, bench's refusal of
the oracle with --url, and the simulator running each new policy."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import pytest
from test_router import H200
from typer.testing import CliRunner

from mvllm.bench import experiment as ex
from mvllm.bench import workload as wl
from mvllm.bench.experiment import ExperimentError
from mvllm.bench.runner import bench
from mvllm.cli import app
from mvllm.errors import InvalidRequestError
from mvllm.routing.cost import Booking
from mvllm.routing.eta import Timing, drain_time, finish_time
from mvllm.routing.lengths import Lengths, TokenRatio
from mvllm.routing.policies import REGISTRY
from mvllm.routing.policies.registry import uses_slo
from mvllm.routing.router import Router
from mvllm.simulate import sim

ROOT = Path(__file__).resolve().parent.parent
TWO = ["gpu", "cpu"]
FOUR = ["gpu", "cpu", "cpu2", "cpu3"]
RATES4 = {**H200, "cpu2": H200["cpu"], "cpu3": H200["cpu"]}
NEW_POLICIES = ["eta", "eta-caps", "oracle", "new-token-ratio", "sglang-cache", "kv-cost"]


# --- Lengths: against a brute-force Kaplan-Meier ---

def km_sums(sample: list[tuple[int, bool]], upto: int) -> list[Fraction]:
    """sums[x] = S(0) + ... + S(x - 1) by the book, exactly: S(t) = P(L > t), each integer t in turn, falling at
    t by the share of those still running at t (censored ones included) that stopped there."""
    sums, s = [Fraction(0)], Fraction(1)
    for t in range(upto):
        at_risk = sum(1 for v, _ in sample if v >= t)
        if at_risk:
            s *= 1 - Fraction(sum(1 for v, stopped in sample if v == t and stopped), at_risk)
        sums.append(sums[-1] + s)
    return sums


def km_left(sample: list[tuple[int, bool]], sums: list[Fraction], g: int, cap: int) -> Fraction | int:
    """E[min(L, cap) - g | L > g], at least 1 and at most the room left; the room where nothing is known."""
    room = cap - g
    s_g = sums[g + 1] - sums[g]
    if room <= 1 or not any(stopped for _, stopped in sample) or s_g == 0:
        return max(room, 0)
    return max(1, min(room, (sums[cap] - sums[g]) / s_g))


def fitted(sample: list[tuple[int, bool]], **kw) -> Lengths:
    lengths = Lengths(**kw)
    for t, stopped in sample:
        lengths.finished(t, stopped)
    lengths.fit()
    return lengths


def test_all_observed_lengths_give_the_mean_and_the_mean_residual():
    lengths = fitted([(10, True), (20, True), (30, True), (40, True)], min_finished=4)
    assert lengths.left(0, 100) == 25
    assert lengths.left(15, 100) == 15  # mean of 20, 30, 40 less the 15 made
    assert lengths.left(45, 100) == 55  # outlived every length seen: the cap's room


def test_lengths_match_brute_force_kaplan_meier_with_censoring():
    rng = random.Random(7)
    for _ in range(40):
        sample = []
        for _ in range(rng.randint(16, 40)):
            true, cap = rng.randint(1, 80), rng.choice([30, 50, 64])
            end = min(true, cap, rng.randint(1, 80) if rng.random() < 0.1 else 10**6)  # some clients leave
            sample.append((end, end == true and true < cap))
        lengths, sums = fitted(sample), km_sums(sample, 101)
        for g in range(0, 70, 3):
            for cap in (30, 64, 100):
                assert abs(lengths.left(g, cap) - km_left(sample, sums, g, cap)) <= Fraction(1, 2), (sample, g, cap)


def test_the_cap_bounds_the_estimate():
    rng = random.Random(3)
    sample = [(rng.randint(1, 300), rng.random() < 0.8) for _ in range(200)]
    lengths = fitted(sample)
    for _ in range(2000):
        cap = rng.randint(1, 400)
        g = rng.randint(0, cap + 5)
        left = lengths.left(g, cap)
        assert left <= max(cap - g, 0) and (left >= 1 or cap - g < 1), (g, cap, left)


def test_all_censored_at_their_caps_is_the_cap_exactly():
    lengths = fitted([(c, False) for c in range(20, 80, 2)])
    assert lengths.ready
    for g, cap in [(0, 100), (5, 20), (19, 20), (0, 2048), (30, 31)]:
        assert lengths.left(g, cap) == cap - g


def test_fewer_than_min_finished_is_the_prior():
    lengths = Lengths()
    for _ in range(15):
        lengths.finished(20, True)
    assert not lengths.ready and lengths.left(0, 2048) == 2048 and lengths.state().startswith("prior")
    lengths.finished(20, True)
    assert lengths.ready and lengths.left(0, 2048) == 20 and lengths.state().startswith("estimate")


def test_the_window_forgets_the_oldest():
    lengths = fitted([(100, True)] * 4 + [(10, True)] * 4, window=4, min_finished=4)
    assert lengths.left(0, 1000) == 10


# --- TokenRatio ---

def test_token_ratio_decays_to_its_floor_in_600_steps_and_stays():
    ratio = TokenRatio()
    assert ratio.ratio == 0.7
    for _ in range(600):
        ratio.step()
    assert ratio.ratio == pytest.approx(0.098) and ratio.ratio >= TokenRatio.FLOOR
    for _ in range(500):
        ratio.step()
    assert ratio.ratio == TokenRatio.FLOOR == pytest.approx(0.098)


def test_token_ratio_after_a_retraction_is_what_is_used():
    ratio = TokenRatio()
    ratio.retracted(generated=80, caps=400, running=2)
    assert ratio.ratio == (80 + 40) / 400
    ratio.retracted(generated=390, caps=400, running=2)
    assert ratio.ratio == 1.0


# --- eta's replay: the new one against the old step-by-step one, bit for bit ---

def replay_old(timing, bookings, new, until_all=False):
    prefill_s = timing.priced
    running, queue, t = [], [], 0.0
    for active, pre, dec in bookings:
        if active:
            running.append(dec)
            t += prefill_s(pre)
        else:
            queue.append((pre, dec))
    if new is not None:
        queue.append(new)
    if not running and not queue:
        return 0.0
    top, head, mine = timing.max_active, 0, None
    new_at = len(queue) - 1 if new is not None else -1
    while True:
        while head < len(queue) and len(running) < top:
            prefill, decode = queue[head]
            t += prefill_s(prefill)
            if head == new_at:
                mine = decode
            else:
                running.append(decode)
            head += 1
        n = len(running) + (mine is not None)
        step = timing.step_s[min(n, top) - 1]
        k = min(running) if running else mine
        if mine is not None:
            k = min(k, mine)
        t += k * step
        if mine is not None:
            mine -= k
            if mine <= 0:
                if not until_all:
                    return t
                mine, new_at = None, -1
        running = [r - k for r in running if r > k]
        if until_all and not running and mine is None and head == len(queue):
            return t


def test_replay_equals_the_old_replay_bit_for_bit():
    for seed in range(400):
        rng = random.Random(seed)
        top = rng.randint(1, 8)
        steps = sorted(rng.uniform(0.001, 0.05) for _ in range(top))
        timing = Timing(rng.choice([73.0, 1400.0, 50000.0]), steps, request_s=rng.choice([0.0, 0.013]))
        bookings = [(rng.random() < 0.5, rng.choice([0, rng.randint(1, 600)]),
                     rng.choice([0, rng.randint(0, 5), rng.randint(0, 300)])) for _ in range(rng.randint(0, 14))]
        work = ([d for a, _, d in bookings if a], [p for a, p, _ in bookings if a and p],
                [(p, d) for a, p, d in bookings if not a])
        new = (rng.randint(0, 600), rng.randint(1, 300))
        state = (top, steps, bookings, new)
        assert finish_time(timing, work, *new) == timing.request_s + replay_old(timing, bookings, new), state
        assert drain_time(timing, work, new) == timing.request_s + replay_old(timing, bookings, new, True), state
        assert drain_time(timing, work) == replay_old(timing, bookings, None, True), state


# --- the policies through the Router ---

def finish(router: Router, rid: str, tokens: int, cap: int, reason: str | None, **route) -> str:
    """Route a request, run `tokens` of it, and end it with `reason`; returns its backend."""
    name = router.route(rid, 100, cap, {}, **route)
    router.on_scheduled(name, rid, 0)
    router.on_tokens(name, rid, tokens)
    router.on_finished(name, rid, reason)
    return name


def learned(policy: str, n: int = 16, length: int = 20, cap: int = 2048) -> Router:
    router = Router(TWO, policy, H200)
    for i in range(n):
        finish(router, f"f{i}", length, cap, "stop")
    return router


def test_eta_expects_a_running_request_to_make_the_learned_length_not_its_cap():
    router = learned("eta")
    assert router.lengths.ready
    name = router.route("x", 100, 2048, {})
    booking = router.bookings[name]["x"]
    assert booking.left == 20
    router.on_scheduled(name, "x", 0)
    router.on_tokens(name, "x", 5)
    assert booking.left == 15


def test_eta_prices_a_queue_of_hidden_lengths_far_below_eta_caps():
    etas = {}
    for policy in ("eta", "eta-caps"):
        router = learned(policy)
        for i in range(8):
            router.route(f"r{i}", 100, 2048, {})
            router.on_scheduled("gpu", f"r{i}", 0)
            router.on_tokens("gpu", f"r{i}", 5)
        assert len(router.bookings["gpu"]) == 8
        etas[policy] = router.candidates(100, 2048, {})["gpu"].eta
    assert etas["eta"] < etas["eta-caps"] / 10


def test_a_booking_made_under_the_prior_is_re_estimated_by_the_next_decision_once_the_estimate_is_ready():
    router = Router(TWO, "eta", H200)
    router.route("early", 100, 2048, {})  # waits: priced at the cap, the prior
    for i in range(16):
        finish(router, f"f{i}", 20, 2048, "stop")
    router.candidates(100, 2048, {})
    assert router.bookings["gpu"]["early"].left == router.expect("gpu", router.bookings["gpu"]["early"]) == 20


def test_told_lengths_make_eta_decide_as_eta_caps():
    routers = [Router(TWO, "eta", H200), Router(TWO, "eta-caps", H200)]
    rng = random.Random(5)
    running: dict[str, tuple[str, int, int]] = {}  # rid -> (backend, cap, made)
    for i in range(60):
        cap, prompt = rng.randint(20, 300), rng.randint(10, 600)
        cands = [r.candidates(prompt, cap, {}) for r in routers]
        assert {b: c.eta for b, c in cands[0].items()} == {b: c.eta for b, c in cands[1].items()}
        names = {r.route(f"r{i}", prompt, cap, {}) for r in routers}
        assert len(names) == 1
        running[f"r{i}"] = (names.pop(), cap, 0)
        for rid, (name, cap, made) in list(running.items()):
            step = rng.randint(0, cap - made)
            for r in routers:
                r.on_scheduled(name, rid, 0)
                if step:
                    r.on_tokens(name, rid, step)
                if made + step == cap:
                    r.on_finished(name, rid, "length")
            running[rid] = (name, cap, made + step)
            if made + step == cap:
                del running[rid]
    assert routers[0].lengths.ready and routers[0].lengths.left(0, 2048) == 2048


def test_oracle_reads_the_true_length_and_else_the_cap():
    router = Router(TWO, "oracle", H200)
    told = router.route("a", 100, 2048, {}, length=10)
    assert router.bookings[told]["a"].left == 10
    blind = router.route("b", 100, 2048, {})
    assert router.bookings[blind]["b"].left == 2048
    router.on_scheduled(told, "a", 0)
    router.on_tokens(told, "a", 4)
    assert router.bookings[told]["a"].left == 6
    c_told = router.candidates(100, 2048, {}, length=10)["gpu"].eta
    assert c_told < router.candidates(100, 2048, {})["gpu"].eta


def test_new_token_ratio_decays_by_steps_and_resets_on_preemption():
    router = Router(TWO, "new-token-ratio", H200)
    for _ in range(10):
        router.on_step("gpu")
    assert router.ratios["gpu"].ratio == pytest.approx(0.7 - 10 * (0.7 - 0.098) / 600)
    assert router.ratios["cpu"].ratio == 0.7
    for rid, made in (("a", 30), ("b", 50)):
        assert router.route(rid, 100, 100, {}) == "gpu"
        router.on_scheduled("gpu", rid, 0)
        router.on_tokens("gpu", rid, made)
    router.on_preempted("gpu")
    assert router.ratios["gpu"].ratio == (80 + 2 * 20) / 200
    assert router.work("gpu", list(router.bookings["gpu"].values()))[0] == [70 * 0.6, 50 * 0.6]


def test_sglang_cache_follows_the_cache_else_the_smallest_tree():
    router = Router(TWO, "sglang-cache", H200)
    a, b, fresh = list(range(10)), list(range(100, 120)), list(range(1000, 1007))
    assert router.route("a", 160, 10, {}, blocks=a) == "gpu"  # both trees empty: the first
    assert router.route("b", 320, 10, {}, blocks=b) == "cpu"  # the smaller tree
    assert router.route("c", 160, 10, {}, blocks=b[:4] + fresh[:6]) == "cpu"  # 64 of 160 cached there
    other = [h + 1000 for h in fresh]
    assert router.route("d", 160, 10, {}, blocks=b[:3] + other) == "gpu"  # 48 of 160: not > 0.3; the smaller tree
    with pytest.raises(InvalidRequestError, match="block hashes"):
        router.route("e", 160, 10, {})


@pytest.mark.parametrize("gpu_load, cpu_load, choice", [(100, 0, "cpu"), (60, 0, "gpu"), (200, 135, "gpu")])
def test_sglang_cache_balances_load_only_past_both_thresholds(gpu_load, cpu_load, choice):
    router = Router(TWO, "sglang-cache", H200)
    for name, n in (("gpu", gpu_load), ("cpu", cpu_load)):
        router.bookings[name] = {f"{name}{i}": Booking(f"{name}{i}", 16, 0, 10) for i in range(n)}
    router.sent["gpu"].insert(list(range(10)))
    assert router.route("x", 160, 10, {}, blocks=list(range(10))) == choice


def test_sglang_cache_forgets_a_dead_backend():
    router = Router(TWO, "sglang-cache", H200)
    router.route("a", 160, 10, {}, blocks=list(range(10)))
    assert len(router.sent["gpu"]) == 10
    router.on_dead("gpu")
    assert len(router.sent["gpu"]) == 0


def test_kv_cost_prefers_the_cache_unless_the_load_outweighs_it():
    router = Router(TWO, "kv-cost", H200)
    assert router.route("a", 160, 10, {"gpu": 0, "cpu": 160}) == "cpu"  # 10 + 10 against 0 + 10
    router.on_finished("cpu", "a")
    router.bookings["cpu"] = {f"b{i}": Booking(f"b{i}", 160, 0, 10, active=True) for i in range(2)}  # 20 blocks
    assert router.route("c", 160, 10, {"gpu": 0, "cpu": 160}) == "gpu"  # 20 against 30


def kv_cost(booked: list[Booking], prompt: int, cached: int) -> int:
    """Dynamo's cost by hand: the prompt's uncached blocks + the blocks held there + the prompt's own."""
    blocks = -(-prompt // 16)
    return (blocks - cached // 16) + sum(-(-(b.prompt_tokens + b.generated) // 16) for b in booked) + blocks


def test_kv_cost_is_the_argmin_of_its_cost():
    rng = random.Random(11)
    router = Router(TWO, "kv-cost", H200)
    for i in range(200):
        for name in TWO:
            router.bookings[name] = {f"{name}{j}": Booking(f"{name}{j}", rng.randint(1, 400), 0, 50, active=True,
                                                          generated=rng.randint(0, 50))
                                     for j in range(rng.randint(0, 6))}
        prompt = rng.randint(1, 400)
        cached = {name: rng.randint(0, prompt) // 16 * 16 for name in TWO}
        costs = {name: kv_cost(list(router.bookings[name].values()), prompt, cached[name]) for name in TWO}
        assert router.route(f"x{i}", prompt, 10, cached) == min(TWO, key=costs.get), costs


@pytest.mark.parametrize("policy", list(REGISTRY))
def test_every_policy_routes_over_four_backends(policy):
    router = Router(FOUR, policy, RATES4, slo={"ttft_ms": 2000.0, "tpot_ms": 100.0} if uses_slo(policy) else None)
    for i in range(16):
        blocks = [i % 3, 100 + i]
        name = router.route(f"r{i}", 40, 30, {b: 16 * (b == "cpu2") for b in FOUR}, blocks=blocks, length=12)
        assert name in FOUR
        if i % 2:
            router.on_scheduled(name, f"r{i}", 0)
            router.on_tokens(name, f"r{i}", 12)
            router.on_finished(name, f"r{i}", "stop")


def test_finish_reasons_feed_the_length_estimate():
    router = Router(TWO, "eta", H200)
    for rid, reason in (("a", "stop"), ("b", "length"), ("c", "abort"), ("d", None)):
        finish(router, rid, 7, 2048, reason)
    assert list(router.lengths.seen) == [(7, True), (7, False), (7, False)]


def test_switching_from_eta_caps_to_eta_re_estimates_the_bookings():
    before = Lengths()
    for _ in range(16):
        before.finished(20, True)
    router = Router(TWO, "eta-caps", H200, lengths=before)  # a switch starts the estimate from `lengths`
    name = router.route("x", 100, 2048, {})
    assert router.bookings[name]["x"].left == 2048
    router.set_policy("eta")
    assert router.bookings[name]["x"].left == 20


def test_the_routing_log_says_what_eta_expected(tmp_path):
    log = tmp_path / "routing.jsonl"
    router = Router(TWO, "eta", H200, log_path=log)
    router.route("x", 100, 2048, {})
    router.close()
    line = json.loads(log.read_text())
    assert line["expected_tokens"] == 2048 and line["lengths"].startswith("prior")
    assert all("expected_decode" in c for c in line["candidates"].values())


# --- bench refuses the oracle against a server it does not start ---

def test_bench_refuses_the_oracle_with_a_url(tmp_path):
    exp = ex.from_dict({"name": "o", "model": "ignored", "runs": 1, "workload": {"requests": 2}})
    with pytest.raises(ExperimentError, match="oracle"):
        bench(exp, tmp_path / "o", policies=["oracle"], url="http://127.0.0.1:9", quiet=True)
    assert not (tmp_path / "o").exists()


def test_cli_bench_refuses_the_oracle_with_a_url_in_one_line(tmp_path):
    result = CliRunner().invoke(app, ["bench", str(ROOT / "experiments/smoke.toml"), "--url", "http://127.0.0.1:9",
                                      "--policy", "oracle", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert "oracle" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


# --- the simulator ---

PROFILE = json.loads((ROOT / "results/paper-8/profile.json").read_text())
HIDDEN = ex.load(ROOT / "experiments/paper-48-hidden.toml")  # 48 requests, lengths hidden, cap 2048


def simulate(exp: ex.Experiment, policy: str) -> tuple[dict, list]:
    records: list = []
    return sim.run_one(exp, policy, PROFILE, wl.vocab_of(exp.model, exp.workload), records), records


@pytest.mark.parametrize("policy", NEW_POLICIES)
def test_the_simulator_runs_each_new_policy_to_the_end(policy):
    shared = ex.Experiment(name="t", model="synthetic:qwen2.5-0.5b", backends="gpu=cuda,cpu=cpu/threads=8",
                        max_active=4, workload=ex.Workload(kind="shared-prefix", groups=3, prompts_per_group=8,
                                                           prefix_tokens=256, suffix_tokens=32, output_tokens=60,
                                                           rate=40.0, max_tokens=512))
    for exp, n in ((shared, 24), (HIDDEN, 48)):
        summary, records = simulate(exp, policy)
        assert summary["completed"] == len(records) == n and all(r.ok for r in records)


def test_the_oracle_is_not_worse_than_the_caps_on_hidden_lengths():
    oracle, caps = simulate(HIDDEN, "oracle")[0]["makespan"], simulate(HIDDEN, "eta-caps")[0]["makespan"]
    assert oracle <= caps * 1.01, (oracle, caps)


def test_eta_is_not_worse_than_the_caps_on_hidden_lengths():
    eta, caps = simulate(HIDDEN, "eta")[0]["makespan"], simulate(HIDDEN, "eta-caps")[0]["makespan"]
    assert eta <= caps * 1.05, (eta, caps)


def test_eta_keeps_a_prompt_on_the_peer_gpu_that_caches_it():
    """Two GPUs of one profile are peers: where both finish the request within the margin, the one caching the
    longer prefix takes it (ties: home); a CPU caching more does not, its throughput is not home's."""
    rates = {"gpu": H200["gpu"], "gpu1": H200["gpu"], "cpu": H200["cpu"]}
    router = Router(["gpu", "gpu1", "cpu"], "eta", rates)
    assert router.route("a", 516, 64, {"gpu": 0, "gpu1": 496, "cpu": 0}) == "gpu1"
    assert router.route("b", 516, 64, {"gpu": 0, "gpu1": 0, "cpu": 0}) == "gpu"  # a tie: home
    assert router.route("c", 516, 64, {"gpu": 0, "gpu1": 0, "cpu": 512}) in ("gpu", "gpu1")
    for i in range(24):  # gpu1 busy: the cache no longer outweighs its queue
        router.bookings["gpu1"][f"q{i}"] = Booking(f"q{i}", 516, 496, 512, active=True, generated=1)
    assert router.route("d", 516, 64, {"gpu": 0, "gpu1": 496, "cpu": 0}) == "gpu"
