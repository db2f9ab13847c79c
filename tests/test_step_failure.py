"""A step that fails ends only the requests it must: one whose sampling or stop check raises ends with an
error while the others of its batch finish with exactly the tokens they get without it; a failing forward
ends that batch's requests, not those waiting. Every KV block comes back. In the engine (plain loop and
overlap) and through a backend worker process, whose client gets Error(rid, message) and whose log gets
one line per failure and one traceback per distinct error."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import prompts

from mvllm import SamplingParams
from mvllm.backends import process, worker
from mvllm.backends.events import Error, Step
from mvllm.backends.spec import BackendSpec
from mvllm.engine.engine import Engine, EngineConfig
from mvllm.engine.sequence import PENDING


@pytest.fixture(scope="module")
def llama(tiny):
    return tiny("llama")[0]


def engine(path, overlap: bool, **kw) -> Engine:
    kw.setdefault("num_blocks", 64)
    return Engine(EngineConfig(str(path), dtype="float32", block_size=4, overlap=overlap, **kw))


def drain(eng: Engine) -> list:
    outs = []
    for _ in range(500):
        if not eng.has_unfinished():
            return outs
        outs += eng.step()
    raise AssertionError("the engine stopped making progress")


class SeedFault(SamplingParams):
    """Sampling params whose seed raises once `trip()` holds: the sampler reads it when it draws this row's
    number, after the rows before it drew theirs from their generators."""

    trip = None

    @property
    def seed(self):
        if self.trip is not None and self.trip():
            raise RuntimeError("injected sampling fault")
        return self._seed

    @seed.setter
    def seed(self, value):
        self._seed = value


class StopFault(list):
    """stop_token_ids whose membership test (the stop check of each landed token) raises once `trip()` holds."""

    trip = None

    def __contains__(self, token):
        if self.trip is not None and self.trip():
            raise RuntimeError("injected stop-check fault")
        return super().__contains__(token)


PROMPT = prompts(41, [11])[0]
SAMPLED = dict(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)


def add_others(eng: Engine) -> list:
    """A greedy request and two seeded ones (top-p, top-k), admitted before the failing one."""
    ps = prompts(40, [9, 14, 6])
    return [eng.add_request(ps[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
            eng.add_request(ps[1], SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1,
                                                  ignore_eos=True)),
            eng.add_request(ps[2], SamplingParams(max_tokens=14, temperature=0.8, top_k=20, seed=2,
                                                  ignore_eos=True))]


def add_failing(eng: Engine, fault: str):
    """The request that fails on its 4th token: when sampling it, or when checking it for a stop."""
    if fault == "sampling":
        params = SeedFault(**SAMPLED)
        seq = eng.add_request(PROMPT, params)
        params.trip = lambda: seq.num_output_tokens >= 3  # 3 before it (the last may be PENDING: overlap)
    else:
        params = SamplingParams(**SAMPLED)
        params.stop_token_ids = StopFault()
        seq = eng.add_request(PROMPT, params)
        params.stop_token_ids.trip = lambda: sum(t != PENDING for t in seq.output_ids) >= 4
    return seq


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("fault", ["sampling", "stop-check"])
def test_a_request_that_fails_ends_alone(llama, overlap, fault):
    """It comes last in the batch, so its sampling fault raises after the seeded rows before it drew their
    numbers: the others still get the tokens of a run without it (and of one where it does not fail), its
    own are its first three, it ends with one error output, and every block is back."""
    plain = engine(llama, overlap)
    without = add_others(plain)
    drain(plain)
    clean = engine(llama, overlap)
    ref = add_others(clean) + [clean.add_request(PROMPT, SamplingParams(**SAMPLED))]
    drain(clean)

    eng = engine(llama, overlap)
    free = eng.blocks.num_free
    good = add_others(eng)
    bad = add_failing(eng, fault)
    outs = drain(eng)
    assert [s.output_ids for s in good] == [s.output_ids for s in without] == [s.output_ids for s in ref[:3]]
    assert all(len(s.output_ids) == s.params.max_tokens and s.finish_reason == "length" for s in good)
    assert bad.output_ids == ref[3].output_ids[:3] and bad.finish_reason == "error"
    assert len(bad.times.tokens) == 3
    for seq in good + [bad]:
        mine = [o for o in outs if o.seq is seq]
        assert [o.token for o in mine if o.error is None] == seq.output_ids  # each token reported once
        assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
    last = [o for o in outs if o.seq is bad][-1]
    assert last.token == PENDING and isinstance(last.error, RuntimeError) and "injected" in str(last.error)
    assert sum(o.error is not None for o in outs) == 1
    assert eng.blocks.num_free == free == eng.blocks.num_blocks
    assert not eng.requests and not eng.has_unfinished()
    again = eng.add_request(PROMPT, SamplingParams(**SAMPLED))  # the engine serves on
    drain(eng)
    assert again.output_ids == ref[3].output_ids


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_failing_forward_ends_its_batch_not_the_waiting_requests(llama, overlap):
    """max_active=2: two requests run, two wait. The third forward raises: the two running end with an error
    (their tokens a prefix of what they get without the fault); the two waiting then run and finish with
    exactly their tokens; every block is back."""
    ps = prompts(42, [7, 12, 9, 5])
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=4, ignore_eos=True)
    ref_eng = engine(llama, overlap, max_active=2)
    ref = [ref_eng.add_request(p, greedy if i % 2 else seeded) for i, p in enumerate(ps)]
    drain(ref_eng)

    eng = engine(llama, overlap, max_active=2)
    forward, calls = eng.runner.logits, []

    def logits(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected forward fault")
        return forward(*args, **kwargs)

    eng.runner.logits = logits
    seqs = [eng.add_request(p, greedy if i % 2 else seeded) for i, p in enumerate(ps)]
    outs = drain(eng)
    errors = [o for o in outs if o.error is not None]
    assert [o.seq for o in errors] == seqs[:2] and errors[0].error is errors[1].error
    assert "injected forward fault" in str(errors[0].error)
    for seq, want in zip(seqs[:2], ref[:2]):
        assert seq.finish_reason == "error" and len(seq.output_ids) < 8
        assert seq.output_ids == want.output_ids[:len(seq.output_ids)]
    assert [s.output_ids for s in seqs[2:]] == [s.output_ids for s in ref[2:]]
    assert all(s.finish_reason == "length" for s in seqs[2:])
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.requests


# --- through a backend worker process -------------------------------------------------------------------


def test_a_step_that_fails_outside_any_batch_ends_every_request(llama, capfd):
    """engine.step raising by itself (here its scheduler): the worker ends every request, running or
    waiting, with an error (the engine's state is unknown), and the backend serves on."""
    eng = engine(llama, False, max_active=1)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    seqs = [eng.add_request(p, greedy) for p in prompts(44, [5, 8])]
    spec, sent = BackendSpec(name="cpu", device="cpu"), []
    worker._step(eng, spec, sent.append)  # one running, one waiting
    schedule = eng.scheduler.schedule

    def broken():
        raise RuntimeError("injected scheduler fault")

    eng.scheduler.schedule = broken
    worker._step(eng, spec, sent.append)
    errors = [m for m in sent if isinstance(m, Error)]
    assert [m.rid for m in errors] == [s.request_id for s in seqs]
    assert {m.message for m in errors} == {"backend cpu failed: RuntimeError: injected scheduler fault"}
    assert "ended requests" in capfd.readouterr().err
    eng.scheduler.schedule = schedule
    again = eng.add_request(prompts(44, [5])[0], greedy)
    drain(eng)
    assert again.output_ids[:1] == seqs[0].output_ids and len(again.output_ids) == 5
    assert eng.blocks.num_free == eng.blocks.num_blocks


def faulty_worker(spec_dict: dict, model: str, commands, events) -> None:
    """worker_main, in which the sampling of a request whose id starts with "boom" raises from its 3rd
    token on (runs in the spawned worker: the test module is imported there)."""
    from mvllm.engine import sampler

    draw = sampler._draw

    def _draw(logits, seqs, drawn):
        if any(s.request_id.startswith("boom") and s.num_output_tokens >= 2 for s in seqs):
            raise RuntimeError("injected sampling fault")
        return draw(logits, seqs, drawn)

    sampler._draw = _draw
    worker.worker_main(spec_dict, model, commands, events)


def test_a_worker_sends_an_error_for_the_failing_request_only(llama, monkeypatch, capfd):
    """Two failing requests among four: each gets Error(rid, message) after its two tokens, the others
    every token (the same as when served again alone), the pool ends full, and the worker's log holds one
    line per failure and a single traceback (the same error, raised at the same place)."""
    monkeypatch.setattr(process, "worker_entry", faulty_worker)
    # capfd reads this process's stderr; a fork server that an earlier test started writes to the one it had then
    monkeypatch.setenv("MVLLM_START", "spawn")
    spec = BackendSpec(name="gpu", device="cpu", dtype="float32", threads=1, max_active=4, num_blocks=64)
    ps = prompts(43, [9, 13, 6, 10])
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=5, ignore_eos=True)
    asks = {"ok-0": (ps[0], greedy), "boom-1": (ps[1], seeded), "ok-2": (ps[2], seeded), "boom-3": (ps[3], seeded)}

    async def serve():
        loop = asyncio.get_running_loop()
        backend = process.ProcessBackend(spec, str(llama))
        try:
            await loop.run_in_executor(None, backend.wait_ready, 180)
            tokens, ends, loads = {}, {}, []

            def on_event(name, event):
                match event:
                    case Step(step_tokens, load):
                        loads.append(load)
                        for rid, token, reason in step_tokens:
                            tokens.setdefault(rid, []).append(token)
                            if reason:
                                ends[rid] = ("finish", reason)
                    case Error(rid, message):
                        ends[rid] = ("error", message)

            backend.listen(loop, on_event)

            async def finish(rids):
                deadline = time.monotonic() + 120
                while not all(r in ends for r in rids):
                    assert time.monotonic() < deadline, f"no end for {set(rids) - set(ends)}"
                    await asyncio.sleep(0.05)

            now = time.time()
            for rid, (prompt, params) in asks.items():
                backend.submit(rid, prompt, params, now)
            await finish(list(asks))
            for rid in ("ok-0", "ok-2"):  # served again, alone
                backend.submit(f"again-{rid}", *asks[rid], time.time())
                await finish([f"again-{rid}"])
            snapshot = await backend.call("snapshot", timeout=30)
            return tokens, ends, snapshot
        finally:
            backend.shutdown()

    tokens, ends, snapshot = asyncio.run(serve())
    for rid in ("ok-0", "ok-2"):
        assert ends[rid] == ("finish", "length") and len(tokens[rid]) == 10
        assert tokens[rid] == tokens[f"again-{rid}"]
    for rid in ("boom-1", "boom-3"):
        assert ends[rid] == ("error", "backend gpu failed: RuntimeError: injected sampling fault")
        assert len(tokens[rid]) == 2
    assert snapshot["free_blocks"] == snapshot["num_blocks"] == 64 and snapshot["running"] == 0
    log = capfd.readouterr().err
    assert log.count("Traceback") == 1
    lines = [line for line in log.splitlines() if line.startswith("backend gpu failed: RuntimeError: injected")]
    assert sorted(rid for line in lines for rid in ("boom-1", "boom-3") if rid in line) == ["boom-1", "boom-3"]
    assert len(lines) <= 2  # one a step: both fail in the same step unless they were admitted apart
