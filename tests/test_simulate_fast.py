"""The simulator's and the router's shortcuts change no prediction: steps that change nothing but tokens run at
once (Backend.coast), eta's replay of a backend's bookings is kept between its events and extended by the
requests booked since (Router.queued), many tokens of a request at once are as many of one (on_tokens), and the
KV cache evicts its oldest blocks in bulk. Each is held here to the plain path, record by record."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
from test_simulate_traffic import experiment, mooncake

from mvllm.routing.cost import Booking
from mvllm.routing.eta import Queued, drain_time, finish_time
from mvllm.routing.router import Router
from mvllm.simulate import sim
from mvllm.simulate.backend import Backend, Job

ROOT = Path(__file__).resolve().parent.parent
# the capacity profile: depth-priced steps, a GPU with overlap, serving overheads, kv_blocks
CAPACITY = json.loads((ROOT / "results/capacity/profile.json").read_text())
PAPER = json.loads((ROOT / "results/paper-48/profile.json").read_text())


def plain(monkeypatch) -> None:
    """No coasting, no kept replays: every step through start_step and end_step, every price from scratch."""
    monkeypatch.setattr(Backend, "coast", lambda self, now, until, router: now)
    monkeypatch.setattr(Router, "book_replayed", lambda self, backend, booking: None)
    real = Router.queued

    def fresh(self, backend, booked):
        self.replayed.pop(backend, None)
        return real(self, backend, booked)

    monkeypatch.setattr(Router, "queued", fresh)


def records(exp, policy: str, profile: dict) -> tuple[dict, list[tuple]]:
    keep: list = []
    summary = sim.run_one(exp, policy, profile, 512, keep=keep)
    return summary, [(r.id, r.backend, r.first_token, r.finish, r.cached_tokens, r.output_tokens, r.finish_reason,
                      tuple(r.chunks)) for r in keep]


def variant(profile: dict, gpu: int | None = None, cpu: int | None = None, overlap: bool | None = None) -> dict:
    out = copy.deepcopy(profile)
    for name, blocks in (("gpu", gpu), ("cpu", cpu)):
        if blocks is not None:
            out["backends"][name]["kv_blocks"] = blocks
    if overlap is not None:
        out["backends"]["gpu"]["overlap"] = overlap
    return out


def budgeted(profile: dict, budget: int) -> dict:
    """The profile with chunk rows (a line and a pair cost; any numbers serve: both paths price by them) and a
    step budget small enough that the trace's prompts run in chunks."""
    out = copy.deepcopy(profile)
    for entry in out["backends"].values():
        step = entry["decode"][0]["step_ms"]
        entry["max_step_tokens"] = budget
        entry["chunks"] = [{"tokens": c, "offset": o, "decodes": 0, "ms": step + 0.01 * c + 1e-6 * c * o}
                           for c in (budget // 4, budget) for o in (0, budget)]
    return out


def alone(profile: dict) -> dict:
    """The profile with served host work per step that is less while the other backend idles (step_ms_alone)."""
    out = copy.deepcopy(profile)
    for name, (busy, idle) in (("gpu", (0.5, 0.1)), ("cpu", (3.0, 0.5))):
        out["backends"][name]["serving"] = {"request_ms": 0.0, "step_ms": busy, "step_ms_alone": idle}
    return out


PROFILES = {
    "capacity": CAPACITY,  # the GPU schedules with overlap: steps scheduled a step ahead run at once too
    "capacity-no-overlap": variant(CAPACITY, overlap=False),  # depth-priced steps run at once
    "paper": variant(PAPER, 2000, 600),
    "small-pools": variant(CAPACITY, 300, 120, overlap=False),  # evictions and preemptions
    "small-pools-overlap": variant(CAPACITY, 300, 120),
    "budget": budgeted(variant(CAPACITY, 300, 120), 256),  # prompts in chunks, with and without overlap
    "budget-no-overlap": budgeted(variant(CAPACITY, 300, 120, overlap=False), 256),
    "alone": alone(CAPACITY),  # a step is cheaper while the other backend idles
    "alone-no-overlap": alone(variant(CAPACITY, overlap=False)),
}


@pytest.mark.parametrize("policy", ["eta", "new-token-ratio", "makespan", "mixed", "gpu-only"])
@pytest.mark.parametrize("profile", list(PROFILES))
def test_the_shortcuts_predict_what_the_plain_path_does(tmp_path, monkeypatch, policy, profile):
    """300 requests, queueing on both backends."""
    exp = experiment(kind="trace", path=str(mooncake(tmp_path / "trace.jsonl", 300, gap_ms=5)), scale=4)
    fast = records(exp, policy, PROFILES[profile])
    with monkeypatch.context() as m:
        plain(m)
        slow = records(exp, policy, PROFILES[profile])
    assert fast[1] == slow[1]
    assert fast[0] == slow[0]
    if profile.startswith("small-pools"):
        assert fast[0]["preemptions"]["gpu"] > 0
    if profile.startswith("budget"):
        assert fast[0]["max_step_tokens"] == {"gpu": 256, "cpu": 256}


def test_many_tokens_at_once_are_as_many_of_one():
    rng = random.Random(3)
    rates = {"gpu": {"prefill_rate": 5e4, "decode_rate": 1700.0,
                     "decode": [{"batch": b, "step_ms": 2.0 + 0.1 * b} for b in range(1, 5)]}}
    for policy in ("eta", "eta-caps", "new-token-ratio", "oracle"):
        one, many = Router(["gpu"], policy, rates), Router(["gpu"], policy, rates)
        made: dict[str, int] = {}
        for i in range(300):
            rid, prompt, cap, length = f"r{i}", rng.randint(10, 500), rng.randint(20, 3000), rng.randint(1, 400)
            for r in (one, many):
                r.route(rid, prompt, cap, {}, length=length)
                r.on_scheduled("gpu", rid, 0)
            made[rid] = 0
            for rid in list(made):
                b = one.bookings["gpu"][rid]
                n = rng.randint(1, min(40, b.max_tokens - made[rid]))
                for _ in range(n):
                    one.on_tokens("gpu", rid, 1)
                many.on_tokens("gpu", rid, n)
                made[rid] += n
                assert (b.generated, b.left) == (many.bookings["gpu"][rid].generated,
                                                  many.bookings["gpu"][rid].left), (policy, rid)
                if made[rid] == b.max_tokens or rng.random() < 0.3:
                    for r in (one, many):
                        r.on_finished("gpu", rid, "length" if made[rid] == b.max_tokens else "stop")
                    del made[rid]


def test_a_kept_replay_extended_by_new_bookings_is_the_replay_from_scratch():
    rng = random.Random(7)
    rates = {"gpu": {"prefill_rate": 5e4, "decode_rate": 1700.0,
                     "decode": [{"batch": b, "step_ms": 2.0 + 0.1 * b} for b in range(1, 5)]},
             "cpu": {"prefill_rate": 1400.0, "decode_rate": 130.0,
                     "decode": [{"batch": b, "step_ms": 27.0 + b} for b in range(1, 5)]}}
    router = Router(["gpu", "cpu"], "makespan", rates)
    for i in range(400):
        prompt, cap = rng.randint(10, 4000), rng.randint(20, 2000)
        cands = router.candidates(prompt, cap, {})
        for b, c in cands.items():
            timing, booked = router.timings[b], list(router.bookings[b].values())
            work = router.work(b, booked)
            mine = (prompt, router.expect(b, Booking("", prompt, 0, cap)))
            assert c.eta == finish_time(timing, work, *mine)
            assert c.drain == drain_time(timing, work, mine) and c.idle_drain == drain_time(timing, work)
            assert Queued.of(timing, work).finish(timing, mine) == c.eta - timing.request_s
        name = router.route(f"r{i}", prompt, cap, {})
        if rng.random() < 0.3:  # an event: the backend's kept replay is dropped
            booked = [rid for rid, b in router.bookings[name].items() if not b.active]
            if booked:
                router.on_scheduled(name, booked[0], 0)
                router.on_tokens(name, booked[0], rng.randint(1, 5))
        if rng.random() < 0.1:
            done = [rid for rid, b in router.bookings[name].items() if b.active]
            if done:
                router.on_finished(name, done[0], "stop")


def test_the_band_run_in_forked_processes_is_the_band_run_here(tmp_path, monkeypatch):
    """The band's two runs in child processes (Linux) give what they give run one after the other here."""
    exp = experiment(kind="trace", path=str(mooncake(tmp_path / "trace.jsonl", 120, gap_ms=5)), scale=4)
    forked = sim.simulate(exp, CAPACITY, ["eta"], None, spread=0.08)
    monkeypatch.setattr(sim.sys, "platform", "darwin")
    here = sim.simulate(exp, CAPACITY, ["eta"], None, spread=0.08)
    assert forked == here
    lo, hi = here[0]["band"]["makespan"]
    assert lo < hi


def test_the_band_s_brief_runs_give_what_whole_summaries_give(tmp_path):
    """The band's runs keep no token times and summarize only its keys: the same numbers as whole runs."""
    exp = experiment(kind="trace", path=str(mooncake(tmp_path / "trace.jsonl", 120, gap_ms=5)), scale=4)
    [row] = sim.simulate(exp, CAPACITY, ["eta"], None, spread=0.08)
    runs = [row] + [sim.run_one(exp, "eta", sim.scaled_steps(CAPACITY, {n: f for n in CAPACITY["backends"]}),
                                sim.wl.vocab_of(exp.model, exp.workload),
                                believed=CAPACITY) for f in (0.92, 1.08)]
    for key in sim.BAND_KEYS:
        assert row["band"][key] == [min(r[key] for r in runs), max(r[key] for r in runs)]
    assert runs[1]["p95_ttft_ms"] != runs[2]["p95_ttft_ms"]


def test_a_step_costs_the_host_work_measured_alone_while_no_other_backend_has_work(tmp_path):
    """serving.step_ms_alone: the simulator prices a step by it while the other backend idles (gpu-only: always),
    by step_ms while the other has work or runs a step; a profile without it prices every step by step_ms."""
    from mvllm.routing.eta import Timing

    profile = alone(variant(CAPACITY, overlap=False))
    gpu = Timing.from_profile(profile["backends"]["gpu"])
    assert gpu.alone_s == pytest.approx(0.0004) and gpu.step_s[0] == pytest.approx(
        Timing.from_profile(CAPACITY["backends"]["gpu"]).step_s[0] - 0.004e-3 + 0.5e-3)
    busy = copy.deepcopy(profile)
    for entry in busy["backends"].values():
        del entry["serving"]["step_ms_alone"]
    assert Timing.from_profile(busy["backends"]["gpu"]).alone_s == 0.0
    exp = experiment(kind="trace", path=str(mooncake(tmp_path / "trace.jsonl", 60, gap_ms=50)), scale=4)
    keep_alone, keep_busy = [], []
    sim.run_one(exp, "gpu-only", profile, 512, keep=keep_alone)
    sim.run_one(exp, "gpu-only", busy, 512, keep=keep_busy)
    gaps = [(r.chunks[-1] - r.chunks[0]) / (len(r.chunks) - 1) for r in keep_alone if len(r.chunks) > 20]
    busy_gaps = [(r.chunks[-1] - r.chunks[0]) / (len(r.chunks) - 1) for r in keep_busy if len(r.chunks) > 20]
    assert sum(busy_gaps) / len(busy_gaps) - sum(gaps) / len(gaps) > 0.0003  # nearly the 0.4 ms less a step
    # the relief is the other backend's idleness, not the policy's: gone while the other waits or runs a step
    cpu = Backend("cpu", Timing.from_profile(profile["backends"]["cpu"]))
    on_gpu = Backend("gpu", gpu, others=(cpu,))
    assert on_gpu.relief() == pytest.approx(0.0004)
    cpu.waiting.append(Job(None, [1] * 16, 4, "x"))
    assert on_gpu.relief() == 0.0
    cpu.waiting.clear()
    cpu.busy = True
    assert on_gpu.relief() == 0.0
