"""The router: the median time of one decision, per policy, with 4 backends of 32 running requests each.

    python experiments/router_speed.py [--profile results/real-traffic/profile.json] [--out FILE] [--calls N]

Each backend is the profile's gpu or cpu entry (gpu, cpu, cpu2, cpu3), served at max_active 32, each holding 32
running requests of 2,000-token prompts part-way through their cap of 2,048 and 4 queued ones. The length
estimate has learned from 2,048 lengths drawn from the conversation trace. Three figures per policy:

  route     `Router.route` alone (the request is then taken off again, so every decision sees the same state),
            with each backend's cached prefix given, and sglang-cache's block hashes made beforehand.
  decision  the whole decision as Cluster.submit makes it: the prompt's cached prefix on each backend from the
            server's PrefixIndex (kept from the workers' KV events), the block hashes where the policy needs
            them (made once for both), then `Router.route`.
  calls     the same with the cached prefixes asked of the workers instead, as the server did before the
            index: a `cached_prefix_len` call to each of 4 worker processes (ProcessBackend's own transport
            to a stub worker that answers from its BlockManager and does nothing else: the best case).

For the last two each backend's cache holds the prompts of its 36 requests (4,500 blocks): a 1,024-token
prefix that every prompt shares, then 976 tokens of its own; the new request's prompt is that prefix and 976
new tokens, so that each backend has 1,024 of its tokens cached.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT_DIR))

from mvllm.backends.events import Reply, Shutdown  # noqa: E402
from mvllm.backends.process import ProcessBackend  # noqa: E402
from mvllm.bench.traces import output_lengths  # noqa: E402
from mvllm.engine.block_manager import ROOT, BlockManager, block_hashes  # noqa: E402
from mvllm.engine.params import SamplingParams  # noqa: E402
from mvllm.engine.sequence import Sequence  # noqa: E402
from mvllm.routing.cost import Booking  # noqa: E402
from mvllm.routing.prefix_index import PrefixIndex  # noqa: E402
from mvllm.routing.rates import load_profile, rates_as_served  # noqa: E402
from mvllm.routing.router import Router  # noqa: E402

POLICIES = ("gpu-only", "round-robin", "mixed", "eta-caps", "eta", "new-token-ratio", "oracle", "makespan",
            "sglang-cache", "kv-cost")
RUNNING, QUEUED, DECISIONS = 32, 4, 2000
SHARED, PROMPT = 1024, 2000  # the prefix every prompt shares, and a prompt's length


def trace_lengths() -> list[int]:
    return output_lengths(str(ROOT_DIR / "experiments" / "traces" / "conversation-10min.jsonl.gz"))


def state(router: Router, lengths: list[int], rng: random.Random) -> None:
    for b in router.backends:
        for i in range(RUNNING + QUEUED):
            length = rng.choice(lengths)
            made = rng.randrange(0, min(length, 2048)) if i < RUNNING else 0
            router.bookings[b][f"{b}-{i}"] = Booking(f"{b}-{i}", 2000, 1024, 2048, active=i < RUNNING,
                                                    actual_cached=1024, generated=made, length=length)
        router.sent[b].insert([hash((b, k)) for k in range(64)])
    for _ in range(2048):
        length = rng.choice(lengths)
        router.lengths.finished(min(length, 2048), length < 2048)


def prompts(seed: int) -> tuple[list[int], list[list[int]]]:
    """The shared prefix, and the prompts of the 36 requests on each of the 4 backends."""
    rng = random.Random(seed)
    shared = [rng.randrange(150_000) for _ in range(SHARED)]
    return shared, [shared + [rng.randrange(150_000) for _ in range(PROMPT - SHARED)]
                    for _ in range(4 * (RUNNING + QUEUED))]


def cache(mine: list[list[int]]) -> BlockManager:
    """A worker's block manager once it has computed these prompts (hashed from ROOT, as a worker's is)."""
    bm = BlockManager(num_blocks=len(mine) * PROMPT // 16 + 16)
    bm.record_events()
    for p in mine:
        seq = Sequence(p, SamplingParams(max_tokens=1))
        bm.allocate(seq)
        seq.num_computed_tokens = len(seq)
        bm.commit(seq)
    return bm


def router_for(policy: str, rates: dict, lengths: list[int]) -> Router:
    router = Router(list(rates), policy, rates)
    state(router, lengths, random.Random(0))
    return router


def time_policy(policy: str, rates: dict, lengths: list[int]) -> float:
    router = router_for(policy, rates, lengths)
    cached = {b: 1024 for b in rates}
    blocks = [hash(("gpu", k)) for k in range(125)]
    times = []
    for i in range(DECISIONS):
        start = time.perf_counter()
        name = router.route(f"new-{i}", 2000, 2048, cached, blocks=blocks, length=300)
        times.append(time.perf_counter() - start)
        router.bookings[name].pop(f"new-{i}")
    return statistics.median(times) * 1e6


def time_decision(policy: str, rates: dict, lengths: list[int], index: PrefixIndex, prompt: list[int]) -> float:
    router = router_for(policy, rates, lengths)
    times = []
    for i in range(DECISIONS):
        start = time.perf_counter()
        blocks = list(block_hashes(prompt, parent=ROOT)) if router.policy.needs_blocks else None
        cached = index.cached_prefix_len(prompt, blocks)
        name = router.route(f"new-{i}", len(prompt), 2048, cached, blocks=blocks, length=300)
        times.append(time.perf_counter() - start)
        router.bookings[name].pop(f"new-{i}")
    assert cached == {b: SHARED for b in rates}, cached
    return statistics.median(times) * 1e6


def stub_worker(commands, events, mine: list[list[int]]) -> None:
    """A worker's control thread as it answered the router before the index, over a cache of these prompts."""
    bm = cache(mine)
    events.send(None)
    while not isinstance(cmd := commands.recv(), Shutdown):
        events.send(Reply(cmd.call_id, bm.cached_prefix_len(*cmd.args)))


def stub_backend(name: str, mine: list[list[int]]) -> ProcessBackend:
    """ProcessBackend's parent side (its calls, its reader thread) over a stub worker."""
    ctx = mp.get_context("spawn")
    b = ProcessBackend.__new__(ProcessBackend)
    cmd_recv, b._commands = ctx.Pipe(duplex=False)
    b._events, evt_send = ctx.Pipe(duplex=False)
    b.process = ctx.Process(target=stub_worker, args=(cmd_recv, evt_send, mine), daemon=True)
    b.process.start()
    cmd_recv.close()
    evt_send.close()
    b.name, b.alive, b.info, b._calls, b._pending, b._loop = name, True, {}, itertools.count(), {}, None
    b._events.recv()
    return b


async def time_calls(policy: str, rates: dict, lengths: list[int], backends: list, prompt: list[int],
                     n: int) -> float:
    router = router_for(policy, rates, lengths)
    times = []
    for i in range(n):
        start = time.perf_counter()
        found = await asyncio.gather(*(b.call("cached_prefix_len", prompt, timeout=30) for b in backends))
        cached = {b.name: v for b, v in zip(backends, found)}
        blocks = list(block_hashes(prompt, parent=ROOT)) if router.policy.needs_blocks else None
        name = router.route(f"new-{i}", len(prompt), 2048, cached, blocks=blocks, length=300)
        times.append(time.perf_counter() - start)
        router.bookings[name].pop(f"new-{i}")
    assert cached == {b: SHARED for b in rates}, cached
    return statistics.median(times) * 1e6


def look_up(index: PrefixIndex, prompt: list[int]) -> float:
    times = []
    for _ in range(DECISIONS):
        start = time.perf_counter()
        index.cached_prefix_len(prompt)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(ROOT_DIR / "results" / "real-traffic" / "profile.json"))
    ap.add_argument("--out")
    ap.add_argument("--calls", type=int, default=500, help="decisions timed with calls per policy (0: none)")
    args = ap.parse_args()
    profile = load_profile(args.profile)
    entries = profile["backends"]
    profile = {"backends": {"gpu": entries["gpu"], "cpu": entries["cpu"], "cpu2": entries["cpu"],
                            "cpu3": entries["cpu"]}}
    rates = rates_as_served(profile, {b: RUNNING for b in profile["backends"]})
    lengths = trace_lengths()
    shared, theirs = prompts(0)
    prompt = shared + [random.Random(1).randrange(150_000) for _ in range(PROMPT - SHARED)]
    per = RUNNING + QUEUED
    index = PrefixIndex()
    for k, b in enumerate(rates):
        index.apply(b, *cache(theirs[k * per:(k + 1) * per]).take_events())
    backends = [stub_backend(b, theirs[k * per:(k + 1) * per]) for k, b in enumerate(rates)] if args.calls else []

    async def with_calls() -> dict[str, float]:
        for b in backends:
            b.listen(asyncio.get_running_loop(), lambda name, event: None)
        return {p: round(await time_calls(p, rates, lengths, backends, prompt, args.calls), 1) for p in POLICIES}

    try:
        rows = {p: round(time_policy(p, rates, lengths), 1) for p in POLICIES}
        decision = {p: round(time_decision(p, rates, lengths, index, prompt), 1) for p in POLICIES}
        calls = asyncio.run(with_calls()) if backends else {}
    finally:
        for b in backends:
            b.shutdown()
    print(f"{'':16s} {'route':>8s} {'decision':>9s} {'calls':>8s}   us median per decision")
    for p, us in rows.items():
        print(f"{p:16s} {us:8.1f} {decision[p]:9.1f} {calls.get(p, float('nan')):8.1f}")
    lookup = round(look_up(index, prompt), 1)
    print(f"the index's look-up alone (4 backends, {SHARED} of {PROMPT} tokens cached on each): {lookup} us")
    if args.out:
        Path(args.out).write_text(json.dumps({"backends": 4, "running": RUNNING, "queued": QUEUED,
                                              "median_us": rows, "decision_us": decision, "calls_us": calls,
                                              "lookup_us": lookup}, indent=2) + "\n")


if __name__ == "__main__":
    main()
