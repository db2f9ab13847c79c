"""Decode priced by context depth: the profile's `contexts` rows fitted into a per-token slope (routing/eta.py:
depth_cost), and the simulator's steps priced by the context its batch holds, step for step as the engine
schedules them."""

from __future__ import annotations

import pytest

from mvllm.bench.metrics import RequestRecord
from mvllm.routing.eta import Timing, depth_cost
from mvllm.simulate.backend import Backend, Job

WEIGHTS = {1: 0.010, 2: 0.011, 3: 0.012, 4: 0.013}  # seconds a step at no context, by batch
SLOPE = 1e-6  # seconds a step per token of context of each running request
REF = 568  # the decode table's context


def step(batch: int, context: float) -> float:
    return WEIGHTS[batch] + SLOPE * batch * context


def entry() -> dict:
    """A profile entry whose steps are exactly linear in the context the batch holds."""
    return {"prefill_rate": 1e9, "max_active": 4,
            "decode": [{"batch": b, "context": REF, "step_ms": 1000 * step(b, REF)} for b in WEIGHTS],
            "contexts": [{"batch": b, "depth": d, "context": d + 9, "step_ms": 1000 * step(b, d + 9)}
                         for d in (0, 1024, 4096) for b in (1, 4)]}


def test_the_fit_recovers_the_slope_and_old_profiles_price_as_before():
    assert depth_cost(entry()) == (pytest.approx(SLOPE), REF)
    timing = Timing.from_profile(entry())
    for b in WEIGHTS:
        assert timing.at_depth(b, 0) == pytest.approx(step(b, REF))
        assert timing.at_depth(b, b * (3000 - REF)) == pytest.approx(step(b, 3000))
    old = {k: v for k, v in entry().items() if k != "contexts"}
    assert depth_cost(old) == (0.0, 0.0)
    assert Timing.from_profile(old).depth_s == 0.0
    flat = entry()  # a slope the noise makes negative prices no depth rather than a cheaper long context
    for r in flat["contexts"]:
        r["step_ms"] = 1000 * WEIGHTS[r["batch"]] * (1.01 if r["depth"] == 0 else 1.0)
    assert depth_cost(flat)[0] == 0.0


class Silent:
    def __getattr__(self, name):
        return lambda *args: None


class Spy(Timing):
    """Timing that records each step's (batch, context held by the requests decoding in it)."""

    def at_depth(self, batch, excess):
        self.seen.append((batch, excess + self.depth_ref * sum(not j.fresh for j in self.backend.running)))
        return super().at_depth(batch, excess)


def run(timing: Timing, requests: list[tuple[int, int]]) -> tuple[list[Job], list[tuple[int, float]]]:
    """Drive one simulated backend through requests (prompt tokens, max_tokens), all waiting at time 0;
    returns the jobs and each step's (batch, context held by the requests decoding in it)."""
    spy = Spy(**{f: getattr(timing, f) for f in ("prefill_rate", "step_s", "prefill_points", "request_s",
                                                   "overlap", "depth_s", "depth_ref")})
    spy.seen, spy.backend = [], (backend := Backend("cpu", spy))
    jobs = [Job(RequestRecord(i, 0.0, p), list(range(p)), n, f"r{i}") for i, (p, n) in enumerate(requests)]
    backend.waiting.extend(jobs)
    now, router = 0.0, Silent()
    while backend.has_work:
        now += backend.start_step(router)
        backend.end_step(now, router)
    return jobs, spy.seen


def test_a_long_context_decodes_at_its_depth_row():
    """One request at depth 4,096 decodes at the profile's batch-1 row for that context, not the table's."""
    (job,), _ = run(Timing.from_profile(entry()), [(4096, 33)])
    chunks = job.record.chunks
    tpot = (chunks[-1] - chunks[0]) / (len(chunks) - 1)
    assert tpot == pytest.approx(step(1, 4096 + 16.5), rel=1e-9)  # the mean context of its 32 decode steps
    (short,), _ = run(Timing.from_profile(entry()), [(100, 33)])
    assert (short.record.chunks[-1] - short.record.chunks[0]) / 32 == pytest.approx(step(1, 116.5), rel=1e-9)


def test_the_simulator_holds_the_contexts_the_engine_decodes(tiny):
    """The real engine's scheduler on a tiny model and the simulator, through the same requests: the same
    batch each step and the same context held by the requests decoding in it."""
    from mvllm import SamplingParams
    from mvllm.engine.engine import Engine, EngineConfig

    requests = [(40, 20), (100, 5), (7, 30), (180, 10), (60, 12)]
    path, _ = tiny("llama")
    eng = Engine(EngineConfig(str(path), dtype="float32", num_blocks=128, max_active=2))
    engine_steps = []
    schedule = eng.scheduler.schedule

    def spy():
        batch = schedule()
        if batch.decode or batch.prefill:
            engine_steps.append((len(batch.decode) + len(batch.prefill), sum(len(s) for s in batch.decode)))
        return batch

    eng.scheduler.schedule = spy
    for p, n in requests:
        eng.add_request(list(range(1, p + 1)), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    timing = Timing(1e9, [0.01, 0.01], depth_s=1e-9, depth_ref=0.0)
    _, simulated = run(timing, requests)
    assert simulated == engine_steps
    assert len(engine_steps) > sum(n for _, n in requests) // 2  # the spy saw the whole run
