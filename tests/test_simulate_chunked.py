"""The budgeted step as the simulator and eta price it: the chunk model fitted from the profile's `chunks` rows
(routing/eta.py: Chunks), the simulator's schedule against the engine's on the same requests, eta's replay
against the simulator, and the profiles a budget refuses or re-measures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mvllm.bench.metrics import RequestRecord
from mvllm.routing.eta import Chunks, Timing, finish_time
from mvllm.simulate.backend import Backend, Job
from mvllm.simulate.kv import KVCache

STEP = 0.010  # a decode step, any batch
LINE, PAIR = 2e-5, 3e-9  # a chunk's seconds per token, and per (query, key) pair its offset adds


def chunk_row(tokens: int, offset: int, decodes: int = 0) -> dict:
    extra = LINE * tokens + PAIR * tokens * offset
    return {"tokens": tokens, "offset": offset, "decodes": decodes, "context": 565, "ms": 1000 * (STEP + extra)}


def entry(budget: int = 64) -> dict:
    rows = [chunk_row(c, o) for o in (0, budget, 3 * budget) for c in (8, 16, 32, 64)]
    rows += [chunk_row(c, 0, 3) for c in (8, 16, 32, 61)]
    return {"prefill_rate": 1e9, "max_active": 4, "max_step_tokens": budget, "chunks": rows,
            "decode": [{"batch": b, "context": 568, "step_ms": 1000 * STEP} for b in (1, 2, 3, 4)]}


def test_the_chunk_fit_recovers_the_line_and_the_pairs():
    timing = Timing.from_profile(entry())
    assert timing.budget == 64
    assert timing.chunks.per_pair == pytest.approx(PAIR)
    for c, o in ((8, 0), (20, 0), (64, 0), (40, 100), (64, 500)):
        assert timing.chunk_s(c, o) == pytest.approx(LINE * c + PAIR * c * o)
    # a prompt of 150 uncached tokens, alone: chunks of 64, 64, 22 after 0, 64, 128, and two more steps
    want = sum(LINE * c + PAIR * c * o for c, o in ((64, 0), (64, 64), (22, 128))) + 2 * STEP
    assert timing.priced(150) == pytest.approx(want)


def test_a_profile_without_the_rows_prices_whole_prompts():
    old = entry()
    del old["chunks"]
    timing = Timing.from_profile(old)
    assert timing.budget is None and timing.chunks is None
    assert timing.chunk_s(100, 50) == timing.priced(100) == timing.prefill_s(100)
    no_budget = entry()
    del no_budget["max_step_tokens"]
    assert Timing.from_profile(no_budget).budget is None


class Silent:
    def __getattr__(self, name):
        return lambda *args: None


def simulate(timing: Timing, requests: list[tuple[int, int]], blocks: int | None = None, shared: bool = True):
    """One simulated backend through requests (prompt tokens, max_tokens), all waiting at time 0 (their prompts
    the first tokens of one sequence, unless not `shared`); returns the jobs and each step's (requests in it,
    requests that sampled, {request: tokens computed} of partial chunks)."""
    backend = Backend("cpu", timing, KVCache(blocks))
    jobs = [Job(RequestRecord(i, 0.0, p), list(range(1000 * i * (not shared), 1000 * i * (not shared) + p)), n,
                f"r{i}") for i, (p, n) in enumerate(requests)]
    backend.waiting.extend(jobs)
    now, router, steps = 0.0, Silent(), []
    while backend.has_work:
        now += backend.start_step(router)
        idle, parts = backend.idle, backend.parts
        ran = sorted(j.record.id for j in backend.running if j not in idle)
        before = {j.record.id: j.generated for j in backend.running}
        partial = {j.record.id: end for j, end in parts.items()}
        backend.end_step(now, router)
        sampled = sorted(j.record.id for j in jobs if j.record.id in before and j.generated > before[j.record.id])
        steps.append((ran, sampled, partial))
    return jobs, steps


def test_a_long_prompt_runs_in_chunks_beside_decodes():
    """Budget 64: a 200-token prompt admitted while two requests decode takes 62, 62, 62 and 14 tokens over four
    steps; the decodes make a token in each of them, and it samples only in the last."""
    timing = Timing.from_profile(entry())
    jobs, steps = simulate(timing, [(10, 30), (12, 30), (200, 3)])
    assert steps[0] == ([0, 1, 2], [0, 1], {2: 42})  # 64 - 10 - 12 = 42 of it beside the two prompts
    assert steps[1] == ([0, 1, 2], [0, 1], {2: 104})
    assert steps[2] == ([0, 1, 2], [0, 1], {2: 166})
    assert steps[3] == ([0, 1, 2], [0, 1, 2], {})  # the last 34 tokens: its first token
    assert jobs[2].record.first_token == pytest.approx(jobs[0].record.chunks[3])
    # each step: the decode step plus its chunks' price
    assert jobs[0].record.chunks[1] - jobs[0].record.chunks[0] == pytest.approx(STEP + timing.chunk_s(62, 42))


def test_partial_chunks_publish_their_blocks_before_the_prompt_is_done():
    """A request that shares a long prompt's first blocks hits those its chunks computed so far."""
    budget = 64
    timing = Timing(1e9, [STEP] * 2, budget=budget, chunks=Chunks([(1, 0.0), (budget, 0.001)]))
    backend = Backend("cpu", timing, KVCache(1000))
    long = Job(RequestRecord(0, 0.0, 150), list(range(150)), 2, "r0")
    backend.waiting.append(long)
    router = Silent()
    for _ in range(2):  # two chunks: 128 tokens computed, 8 blocks published
        backend.end_step(backend.start_step(router), router)
    short = Job(RequestRecord(1, 0.0, 200), list(range(200)), 2, "r1")
    backend.waiting.append(short)
    assert long.generated == 0  # its prompt not done
    backend.end_step(backend.start_step(router), router)  # its last 22 tokens, and 42 of the short one
    assert short.cached == 128 and long.generated == 1 and short.todo == 200 - 128 - 42


def test_the_simulator_schedules_chunks_as_the_engine_does(tiny):
    """The real engine's scheduler with a small budget, and the simulator, through the same requests: the same
    requests in each step, the same ones sampling, and the same cached prefixes (the prompts share their first
    tokens, so later ones hit blocks a partial prompt published)."""
    from mvllm import SamplingParams
    from mvllm.engine.engine import Engine, EngineConfig

    if "max_step_tokens" not in EngineConfig.__dataclass_fields__:
        pytest.skip("the engine has no step budget here")
    budget = 32
    requests = [(100, 5), (20, 8), (70, 4), (10, 6), (45, 3), (130, 2)]
    path, _ = tiny("llama")
    eng = Engine(EngineConfig(str(path), dtype="float32", num_blocks=128, max_active=3, max_step_tokens=budget))
    seqs, engine_steps = [], []
    schedule = eng.scheduler.schedule
    for p, n in requests:
        seqs.append(eng.add_request(list(range(1, p + 1)), SamplingParams(max_tokens=n, temperature=0.0,
                                                                          ignore_eos=True)))
    ids = {s.request_id: i for i, s in enumerate(seqs)}
    got = []

    def spy():
        batch = schedule()
        got.append(sorted(ids[s.request_id] for s in batch.seqs))
        return batch

    eng.scheduler.schedule = spy
    while eng.has_unfinished():
        got.clear()
        made = [len(s.times.tokens) for s in seqs]
        eng.step()
        if got and got[0]:
            engine_steps.append((got[0], [i for i, s in enumerate(seqs) if len(s.times.tokens) > made[i]]))
    timing = Timing(1e9, [STEP] * 3, budget=budget, chunks=Chunks([(1, 0.0), (budget, 0.001)]))
    jobs, simulated = simulate(timing, requests, blocks=128)
    assert [(ran, sampled) for ran, sampled, _ in simulated] == engine_steps
    assert [j.cached for j in jobs] == [s.num_cached_tokens for s in seqs]
    assert any(partial for _, _, partial in simulated)  # some prompt did run in chunks


def test_eta_replay_agrees_with_the_simulator_under_a_budget():
    """A lone request, and one queued behind another on a batch of one: eta's finish time is the simulator's."""
    one = entry()
    one["max_active"] = 1
    one["decode"] = one["decode"][:1]
    timing = Timing.from_profile(one)
    (job,), _ = simulate(timing, [(150, 20)])
    assert finish_time(timing, ([], [], []), 150, 20) == pytest.approx(job.record.finish)
    jobs, _ = simulate(Timing.from_profile(one), [(150, 20), (90, 7)], shared=False)
    assert finish_time(timing, ([], [], [(150, 20)]), 90, 7) == pytest.approx(jobs[1].record.finish)


def test_a_profile_under_another_budget_is_refused_and_an_old_one_said():
    from mvllm.simulate.sim import SimulateError, budget_line, step_budgets

    profile = {"backends": {"cpu": entry(64), "gpu": {k: v for k, v in entry().items() if k != "chunks"}}}
    specs = [SimpleNamespace(name="cpu", max_step_tokens=None), SimpleNamespace(name="gpu", max_step_tokens=None)]
    budgets = step_budgets(profile, specs)
    assert budgets == {"cpu": 64, "gpu": None}
    line = budget_line(budgets)
    assert "gpu" in line and "cpu" not in line and "\n" not in line
    with pytest.raises(SimulateError, match="max_step_tokens=128.*measured under 64"):
        step_budgets(profile, [SimpleNamespace(name="cpu", max_step_tokens=128)])


def test_bench_measures_again_a_profile_without_the_rows_or_under_another_budget(tmp_path):
    import json

    from mvllm.bench.runner import _matches

    path = tmp_path / "profile.json"
    good = {"model": "m", "backends": {"cpu": entry(64)}}
    path.write_text(json.dumps(good))
    assert _matches(path, "m", {"cpu": 4}, {"cpu": 64})
    assert not _matches(path, "m", {"cpu": 4}, {"cpu": 256})
    good["backends"]["cpu"]["threads"] = 8  # measured with 8 threads: not reused for a backend that runs 13
    path.write_text(json.dumps(good))
    assert _matches(path, "m", {"cpu": 4}, {"cpu": 64}, {"cpu": 8})
    assert not _matches(path, "m", {"cpu": 4}, {"cpu": 64}, {"cpu": 13})
    del good["backends"]["cpu"]["chunks"]
    path.write_text(json.dumps(good))
    assert not _matches(path, "m", {"cpu": 4}, {"cpu": 64})
