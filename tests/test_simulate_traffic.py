"""`mvllm simulate` over every workload kind: hidden lengths (the router is told the cap, the engine stops at the
true length), multi-turn dependencies, each backend's LRU prefix cache at its real size (held to the engine's
own scheduler and block manager), Mooncake traces, and its speed."""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path

import pytest
from test_simulate import drive

from mvllm.bench import workload as wl
from mvllm.bench.experiment import Experiment, Workload
from mvllm.bench.metrics import RequestRecord
from mvllm.engine.block_manager import BLOCK_SIZE, BlockManager, block_hashes
from mvllm.routing.eta import Timing
from mvllm.routing.router import Router
from mvllm.simulate import sim
from mvllm.simulate.backend import Backend, Job
from mvllm.simulate.kv import KVCache, chain

ROOT = Path(__file__).resolve().parent.parent
PROFILE = json.loads((ROOT / "results/paper-8/profile.json").read_text())
MODEL = "synthetic:qwen2.5-0.5b"  # context 32768
BACKENDS = "gpu=cuda,cpu=cpu/threads=8"


def experiment(**workload) -> Experiment:
    return Experiment(name="traffic", model=MODEL, backends=BACKENDS, max_active=4, workload=Workload(**workload))


def with_blocks(**blocks: int) -> dict:
    out = copy.deepcopy(PROFILE)
    for name, n in blocks.items():
        out["backends"][name]["kv_blocks"] = n
    return out


class Spy(Router):
    """The real router, its decisions' inputs recorded."""

    calls: list[tuple[str, int, int, dict]] = []

    def route(self, request_id, prompt_tokens, max_tokens, cached, exclude=(), blocks=None, length=None):
        Spy.calls.append((request_id, prompt_tokens, max_tokens, dict(cached)))
        return super().route(request_id, prompt_tokens, max_tokens, cached, exclude, blocks, length)


@pytest.fixture
def spy(monkeypatch):
    Spy.calls = []
    monkeypatch.setattr(sim, "Router", Spy)
    return Spy.calls


def run(exp: Experiment, policy: str = "gpu-only", profile: dict = PROFILE) -> tuple[dict, list[RequestRecord]]:
    records: list[RequestRecord] = []
    summary = sim.run_one(exp, policy, profile, wl.vocab_of(exp.model, exp.workload), records)
    return summary, sorted(records, key=lambda r: r.id)


def test_hidden_lengths_route_by_what_the_server_is_told_and_end_at_the_true_length(spy):
    random_kind = dict(kind="random", requests=40, suffix_tokens=200, output_tokens=50, range_ratio=0.5, rate=20.0,
                       seed=1)
    summary, recs = run(experiment(**random_kind), "eta")
    assert summary["completed"] == 40 and summary["kv_blocks"] == {"gpu": None, "cpu": None}
    by_rid = {rid: (n, asked) for rid, n, asked, _ in spy}
    for r in recs:  # no cap sent: the server's room left in the context
        assert by_rid[f"sim-{r.id}"] == (r.prompt_tokens, 32768 - r.prompt_tokens)
        assert r.max_tokens is None and r.output_tokens == r.target_tokens < 80 and r.finish_reason == "stop"
        assert len(r.chunks) == r.output_tokens
    spy.clear()
    _, capped = run(experiment(**random_kind, max_tokens=64), "eta")
    assert {asked for _, _, asked, _ in spy} == {64}
    assert any(r.output_tokens == 64 for r in capped) and any(r.output_tokens < 64 for r in capped)
    for r in capped:  # the workload's lengths cut to the cap: those end at the cap ("length")
        assert r.max_tokens == 64 and r.output_tokens == r.target_tokens
        assert r.finish_reason == ("length" if r.output_tokens == 64 else "stop")
    spy.clear()
    _, told = run(experiment(**random_kind, lengths="told"), "eta")
    assert [asked for _, _, asked, _ in spy] == [r.output_tokens for r in told]
    assert all(r.finish_reason == "length" and r.max_tokens == r.output_tokens for r in told)
    spy.clear()
    summary, _ = run(experiment(**random_kind), "eta", with_blocks(gpu=100, cpu=5000))
    assert summary["kv_blocks"] == {"gpu": 100, "cpu": 5000}
    assert all(asked == 100 * BLOCK_SIZE - n for _, n, asked, _ in spy)  # the context capped at the smallest pool


@pytest.mark.parametrize("profile", [PROFILE, with_blocks(gpu=4000, cpu=4000)], ids=["unbounded", "bounded"])
def test_a_follow_up_turn_is_sent_after_its_parent_and_finds_its_reply_cached(spy, profile):
    exp = experiment(kind="shared-prefix", groups=2, prompts_per_group=2, prefix_tokens=64, suffix_tokens=20,
                     output_tokens=30, turns=3, think_time=0.25, rate=2.0)
    built = wl.build_all(exp.workload, wl.vocab_of(MODEL, exp.workload), MODEL)
    own = {r.id: len(r.prompt) for r in built.requests}
    summary, recs = run(exp, "gpu-only", profile)
    assert summary["completed"] == 12
    by_id = {r.id: r for r in recs}
    routed = {rid: cached["gpu"] for rid, _, _, cached in spy}
    children = [r for r in recs if r.parent is not None]
    assert len(children) == 8
    for c in children:
        p = by_id[c.parent]
        assert c.arrival == pytest.approx(p.finish + 0.25)
        assert c.prompt_tokens == p.prompt_tokens + p.output_tokens + own[c.id]
        reused = (p.prompt_tokens + p.output_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # all but the last token's KV
        assert c.cached_tokens >= reused > p.prompt_tokens and routed[f"sim-{c.id}"] >= reused


def custom(tmp_path: Path, prompts: list[list[int]], output: int) -> str:
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps({"prompt_tokens": p, "output_tokens": output}) + "\n" for p in prompts))
    return str(path)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


@pytest.mark.parametrize("blocks, hit", [(30, 0), (1000, 144)])
def test_lru_evicts_a_prefix_between_two_uses_only_from_a_small_pool(tmp_path, spy, blocks, hit):
    """X, four other 160-token prompts, X again, one a second: each request holds 11 blocks; released, X's 10
    full blocks wait in the LRU; in 30 blocks the others evict them, in 1000 X finds 9 (its last token is
    always computed)."""
    rng = random.Random(0)
    x = tokens(rng, 160)
    exp = experiment(kind="custom", path=custom(tmp_path, [x] + [tokens(rng, 160) for _ in range(4)] + [x], 4),
                     arrival="fixed", interval=1.0)
    summary, recs = run(exp, "gpu-only", with_blocks(gpu=blocks, cpu=blocks))
    assert summary["completed"] == 6 and summary["kv_blocks"]["gpu"] == blocks
    assert recs[-1].cached_tokens == spy[-1][3]["gpu"] == hit
    assert all(r.cached_tokens == 0 for r in recs[:-1])


def test_admission_waits_until_the_blocks_fit(tmp_path):
    rng = random.Random(1)
    path = custom(tmp_path, [tokens(rng, 300), tokens(rng, 300)], 8)  # 19 blocks each
    exp = experiment(kind="custom", path=path, arrival="fixed", interval=0.0)
    _, (a, b) = run(exp, "gpu-only", with_blocks(gpu=30, cpu=30))
    assert b.first_token > a.finish  # the second waits for the first's blocks
    _, (a, b) = run(exp, "gpu-only", with_blocks(gpu=1000, cpu=1000))
    assert b.first_token < a.finish  # room for both: they run together


class Silent:
    def __getattr__(self, name):
        return lambda *args: None


def modelled(arrivals: list[tuple[float, list[int], int, int]], num_blocks: int, max_active: int,
             overlap: bool = False) -> tuple[list[tuple], Backend]:
    """Drive one modelled backend (1 s steps, free prefill) through requests (arrival, prompt, length, limit);
    (first token step, finish step, cached tokens, tokens) per request."""
    backend = Backend("gpu", Timing(1e15, [1.0] * max_active, overlap=overlap), KVCache(num_blocks))
    jobs = [Job(RequestRecord(i, t, len(p)), p, n, f"r{i}", limit=cap) for i, (t, p, n, cap) in enumerate(arrivals)]
    drive(backend, jobs)
    return [(round(j.record.first_token), round(j.record.finish), j.record.cached_tokens, j.record.output_tokens)
            for j in jobs], backend


def engine(arrivals: list[tuple[float, list[int], int, int]], num_blocks: int, max_active: int):
    """The same requests through the engine's own Scheduler and BlockManager (no model: each step lands a token
    per request, EOS at its length), driven as `modelled` drives the simulator's backend."""
    from mvllm.engine.params import SamplingParams
    from mvllm.engine.scheduler import Scheduler
    from mvllm.engine.sequence import Sequence

    eos = 7
    sched = Scheduler(BlockManager(num_blocks), max_active, 10**6, [eos])
    seqs = [Sequence(p, SamplingParams(max_tokens=cap, temperature=0.0), f"r{i}") for i, (_, p, _, cap) in
            enumerate(arrivals)]
    first, finish, now, i = {}, {}, 0.0, 0
    while i < len(seqs) or sched.has_work():
        while i < len(seqs) and arrivals[i][0] <= now:
            sched.add(seqs[i])
            i += 1
        if not sched.has_work():
            now = arrivals[i][0]
            continue
        batch, end = sched.schedule(), now + 1.0
        while i < len(seqs) and arrivals[i][0] < end:
            sched.add(seqs[i])
            i += 1
        out = [eos if s.num_output_tokens + 1 >= arrivals[int(s.request_id[1:])][2] else 1000 for s in batch.seqs]
        for s in sched.postprocess(batch, out, end):
            finish[s.request_id] = end
        for s in batch.seqs:
            first.setdefault(s.request_id, end)
        now = end
    return [(round(first[s.request_id]), round(finish[s.request_id]), s.num_cached_tokens, s.num_output_tokens)
            for s in seqs], sched


@pytest.mark.parametrize("num_blocks", [24, 40, 400])
def test_the_modelled_blocks_follow_the_engines_scheduler_and_block_manager(num_blocks):
    """Shared system prompts, growing decodes and a pool small enough to evict and preempt: admission steps,
    finishes, cached prefixes, preemptions and the cache left behind are the engine's own."""
    rng = random.Random(num_blocks)
    systems = [tokens(rng, rng.choice((16, 40, 64))) for _ in range(3)]
    arrivals = []
    for k in range(40):
        n = rng.randint(2, 60)
        arrivals.append((k * 2.5 + 0.25 + 0.5 * (k % 2), rng.choice(systems) + tokens(rng, rng.randint(1, 90)), n,
                         n if k % 3 else n + rng.randint(0, 20)))
    ours, backend = modelled(arrivals, num_blocks, 3)
    theirs, sched = engine(arrivals, num_blocks, 3)
    assert ours == theirs
    assert backend.preemptions == sched.num_preemptions
    assert sum(c for _, _, c, _ in ours) > 0
    if num_blocks == 24:
        assert sched.num_preemptions > 0
    kv, bm = backend.kv, sched.blocks
    assert (kv.in_use, len(kv.lru), len(kv.refs)) == (0, len(bm.cached_free), len(bm.hash_to_block))


def test_overlap_runs_a_request_that_stops_one_step_past_its_end():
    """The engine knows only max_tokens: with overlap it schedules the step after a request's last token before
    that token lands, so a request that stops early holds its slot a step longer than one that ends at its cap,
    and that step's KV of its last token is cached."""
    p = tokens(random.Random(2), 20)
    told = [(0.0, p, 12, 12), (0.0, tokens(random.Random(3), 20), 1, 1)]
    hidden = [(0.0, p, 12, 40), told[1]]
    (a, b), at_cap = modelled(told, 100, 1, overlap=True)
    (c, d), stopped = modelled(hidden, 100, 1, overlap=True)
    assert a == c and d[0] == b[0] + 1
    assert len(at_cap.kv.lru) == 1 + 1 and len(stopped.kv.lru) == 2 + 1  # (20 + 11) // 16 vs (20 + 12) // 16


def mooncake(path: Path, n: int, seed: int = 0, gap_ms: int = 300) -> Path:
    """n requests in Mooncake's format: 512-token blocks, prompts that share first blocks."""
    rng = random.Random(seed)
    heads = [[rng.randrange(10**6) for _ in range(rng.randint(1, 4))] for _ in range(20)]
    with path.open("w") as f:
        for i in range(n):
            length = rng.randint(600, 8000)
            blocks = -(-length // 512)
            ids = (rng.choice(heads) + [10**6 + i * 20 + k for k in range(blocks)])[:blocks]
            f.write(json.dumps({"timestamp": i * gap_ms, "input_length": length,
                                "output_length": rng.randint(50, 600), "hash_ids": ids}) + "\n")
    return path


def test_a_mooncake_trace_runs_with_its_own_timestamps(tmp_path):
    path = mooncake(tmp_path / "trace.jsonl", 12)
    exp = experiment(kind="trace", path=str(path), scale=16)
    assert exp.workload.arrival == "trace" and exp.workload.hidden
    rows = sim.simulate(exp, PROFILE, ["gpu-only", "eta"], tmp_path / "out", spread=0.08)
    for r in rows:
        assert r["completed"] == 12 and r["failed"] == 0 and "band" in r
        assert r["kv_blocks"] == {"gpu": None, "cpu": None}
    assert json.loads((tmp_path / "out/eta/summary.json").read_text())["completed"] == 12
    _, recs = run(exp, "gpu-only")
    built = wl.build_all(exp.workload, wl.vocab_of(MODEL, exp.workload), MODEL)
    assert [r.arrival for r in recs] == pytest.approx([i * 0.3 for i in range(12)])
    assert [r.target_tokens for r in recs] == [r.output_tokens for r in built.requests]
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for i, r in enumerate(recs):  # a request whose first block was sent before finds it on the one backend
        if any(lines[j]["hash_ids"][0] == lines[i]["hash_ids"][0] for j in range(i)):
            assert r.cached_tokens >= 16


def test_the_simulators_hash_chain_is_the_engines():
    ids = tokens(random.Random(4), 1000)
    assert chain(ids) == list(block_hashes(ids))
    assert chain(ids, 10, chain(ids)[9]) == list(block_hashes(ids))[10:]


def test_the_profile_records_the_pool_a_backend_is_served_with():
    from mvllm.backends.spec import parse_backends
    from mvllm.engine.engine import Engine
    from mvllm.profile.run import served_blocks

    for text in ("cpu=cpu/dtype=float32/quant=none/fused=off", "cpu=cpu/dtype=float32/quant=none/fused=off/"
                 "kv_cache_gb=0.001", "cpu=cpu/dtype=float32/quant=none/fused=off/num_blocks=77"):
        [spec] = parse_backends(text, 2)
        small = spec.engine_config("synthetic:tiny-qwen2")
        small.num_blocks = 8  # as the profile runs it
        served = Engine(spec.engine_config("synthetic:tiny-qwen2")).blocks.num_blocks
        assert served_blocks(Engine(small), spec) == served != 8


@pytest.mark.serial  # a wall-clock bound: run alone (make test's second pass)
def test_a_few_thousand_trace_requests_simulate_in_seconds(tmp_path):
    """Under a second on the 2-core CI machine; the deadline leaves room for a loaded one."""
    exp = experiment(kind="trace", path=str(mooncake(tmp_path / "trace.jsonl", 3000, gap_ms=250)), scale=16)
    start = time.perf_counter()
    [row] = sim.simulate(exp, with_blocks(gpu=4000, cpu=1000), ["eta"], None)
    assert time.perf_counter() - start < 60
    assert row["completed"] == 3000 and row["total_cached_tokens"] > 0


def test_long_prompts_are_priced_past_the_mixed_steps_and_grow_with_the_square():
    """A profile measures mixed steps up to 516 tokens and lone prefills up to its longest --lengths: the timing
    model follows the lone growth past 516, and past the last point grows at least as the square's fit."""
    from mvllm.routing.eta import Timing

    entry = {"prefill_rate": 1e5, "decode": [{"batch": 1, "step_ms": 1.0}, {"batch": 2, "step_ms": 1.0}],
             "mixed": [{"tokens": 20, "batch": 2, "ms": 2.0}, {"tokens": 516, "batch": 2, "ms": 4.0}],
             "prefill": [{"tokens": 516, "ms": 3.0}, {"tokens": 2048, "ms": 11.0}, {"tokens": 8192, "ms": 101.0}]}
    t = Timing.from_profile(entry)
    assert t.prefill_s(516) == pytest.approx(0.003)  # the mixed step's 4 ms over the 1 ms decode step
    assert t.prefill_s(2048) == pytest.approx(0.003 + 0.008)  # + what the lone prefill grew from 516 to 2048
    assert t.prefill_s(8192) == pytest.approx(0.003 + 0.098)
    line = 0.101 + (0.101 - 0.011) * (16384 - 8192) / (8192 - 2048)
    assert t.prefill_s(16384) > line  # attention's square, not the last segment's line
    assert t.prefill_s(16384) == pytest.approx(0.101 * 4, rel=0.2)
