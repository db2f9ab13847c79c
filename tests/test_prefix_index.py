"""The server's prefix index (routing/prefix_index.py) answers exactly what each worker's BlockManager would,
from the KV events alone: under admissions, decode, LRU eviction, resets, a hash collision and a restart."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time

import pytest

from mvllm.backends.spec import parse_backends
from mvllm.engine.block_manager import BlockManager, block_hashes
from mvllm.engine.params import SamplingParams
from mvllm.engine.sequence import Sequence
from mvllm.routing.prefix_index import PrefixIndex
from mvllm.routing.router import Router

BS = 4


def agree(index: PrefixIndex, workers: dict[str, BlockManager], probes: list[list[int]]) -> None:
    for p in probes:
        for hashes in (None, list(block_hashes(p, index.block_size))):
            found = index.cached_prefix_len(p, hashes)
            assert {w: found.get(w, 0) for w in workers} == {w: bm.cached_prefix_len(p) for w, bm in workers.items()}


def run(bm: BlockManager, token_ids: list[int]) -> Sequence:
    """Admit a sequence and compute its prompt, as a prefill step does."""
    seq = Sequence(list(token_ids), SamplingParams(max_tokens=1))
    bm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    bm.commit(seq)
    return seq


@pytest.mark.parametrize("seed", range(4))
def test_index_follows_random_work_on_three_workers(seed):
    rng = random.Random(seed)
    stems = [[rng.randrange(30) for _ in range(rng.randrange(4, 24))] for _ in range(5)]
    workers = {w: BlockManager(num_blocks=20, block_size=BS) for w in "abc"}
    running: dict[str, list[Sequence]] = {w: [] for w in workers}
    for bm in workers.values():
        bm.record_events()
    index, probes, evicted, resets = PrefixIndex(BS), [], 0, 0
    for _ in range(600):
        w = rng.choice("abc")
        bm, mine = workers[w], running[w]
        before = set(bm.hash_to_block)
        op = rng.random()
        if op < 0.4 or not mine:
            tokens = rng.choice(stems) + [rng.randrange(30) for _ in range(rng.randrange(1, 12))]
            probes = (probes + [tokens])[-30:]
            seq = Sequence(tokens, SamplingParams(max_tokens=1))
            if bm.can_allocate(seq):
                mine.append(run(bm, tokens))
        elif op < 0.75:
            seq = rng.choice(mine)
            if bm.can_append(seq):
                bm.append(seq)
                seq.num_computed_tokens = len(seq)
                bm.commit(seq)
                seq.token_ids.append(rng.randrange(30))
                probes = (probes + [list(seq.token_ids)])[-30:]
        elif op < 0.98:
            bm.free(mine.pop(rng.randrange(len(mine))))
        else:
            while mine:
                bm.free(mine.pop())
            assert bm.reset_prefix_cache()
            resets += 1
        evicted += len(before - set(bm.hash_to_block))
        if rng.random() < 0.7:  # events may wait for several changes, as between two steps
            for name, other in workers.items():
                if (kv := other.take_events()) is not None:
                    index.apply(name, *kv)
            agree(index, workers, probes + [[]] + [p[:n] for p in probes[-5:] for n in (1, BS, BS + 1, 2 * BS + 1)])
    assert evicted > 0 and resets > 0
    fresh = BlockManager(num_blocks=20, block_size=BS)  # worker b restarts: an empty cache
    fresh.record_events()
    index.drop("b")
    workers["b"] = fresh
    agree(index, workers, probes)
    run(fresh, probes[-1])
    index.apply("b", *fresh.take_events())
    agree(index, workers, probes)


def colliding(tokens: tuple[int, ...], first: int) -> tuple[int, ...]:
    """Tokens other than `tokens`, starting with `first`, whose tuple hash is the same (CPython's xxHash-based
    tuple hash, inverted in the last item): so the chain hashes of the two blocks are equal too."""
    p1, p2, p5, mask = 11400714785074694791, 14029467366897019727, 2870177450012600261, 2**64 - 1

    def lanes(items):
        acc = p5
        for x in items:
            acc = (acc + hash(x) % 2**64 * p2) & mask
            acc = ((acc << 31) | (acc >> 33)) & mask
            acc = acc * p1 & mask
        return acc

    def finish(acc, n):
        acc = (acc + (n ^ (p5 ^ 3527539))) & mask
        return acc - 2**64 if acc >= 2**63 else acc

    assert finish(lanes(tokens), len(tokens)) == hash(tokens), "not CPython's tuple hash"
    target = (hash(tokens) - (len(tokens) ^ (p5 ^ 3527539))) % 2**64
    for second in range(10_000):
        head = (first, second, *tokens[2:-1])
        acc = target * pow(p1, -1, 2**64) & mask
        acc = ((acc >> 31) | (acc << 33)) & mask
        lane = (acc - lanes(head)) * pow(p2, -1, 2**64) & mask
        if lane < sys.hash_info.modulus:  # an int whose hash is this lane: itself
            out = (*head, lane)
            assert hash(out) == hash(tokens) and out != tokens
            return out
    raise AssertionError("no colliding block found")


def test_a_hash_collision_is_answered_as_the_block_manager_does():
    first = (1, 2, 3, 4)
    other = colliding(first, 7)
    assert list(block_hashes(list(first) + [0], BS)) == list(block_hashes(list(other) + [0], BS))
    a, b = BlockManager(num_blocks=8, block_size=BS), BlockManager(num_blocks=8, block_size=BS)
    workers = {"a": a, "b": b}
    index = PrefixIndex(BS)
    for bm in workers.values():
        bm.record_events()
    seq = run(a, list(first) + [5])
    run(b, list(other) + [5])
    probes = [list(first) + [9], list(other) + [9], list(first) + [9] * 6, list(other) + [9] * 6]
    for name, bm in workers.items():
        index.apply(name, *bm.take_events())
    assert index.clashes  # the same hash, other tokens: the exact path, worker by worker
    agree(index, workers, probes)
    assert index.cached_prefix_len(probes[1]) == {"a": 0, "b": 4}
    a.free(seq)
    assert a.reset_prefix_cache()
    index.apply("a", *a.take_events())
    assert not index.clashes
    agree(index, workers, probes)
    c = BlockManager(num_blocks=8, block_size=BS)  # one worker alone: its collision is _match's token check
    c.record_events()
    run(c, list(first) + [5])
    index = PrefixIndex(BS)
    index.apply("c", *c.take_events())
    agree(index, {"c": c}, probes)
    assert index.cached_prefix_len(probes[1]) == {"c": 0}


def test_index_in_the_server_equals_each_worker_through_restart_reset_and_eviction():
    """Two real workers with 12-block pools behind a Cluster: after requests, warms, eviction, a reset and a
    worker killed and restarted, its index gives what each worker's own cached_prefix_len call gives."""
    from mvllm.server.cluster import Cluster

    rng = random.Random(0)
    specs = parse_backends("a=cpu/threads=1/num_blocks=12,b=cpu/threads=1/num_blocks=12")
    cluster = Cluster(specs, "synthetic:tiny-qwen2", Router(["a", "b"], "round-robin"), restart=True,
                      ready_timeout=180)
    stems = [[rng.randrange(500) for _ in range(n)] for n in (40, 70, 25)]
    probes = [s + [rng.randrange(500) for _ in range(rng.randrange(1, 30))] for s in stems for _ in range(3)]

    removed, hits = [], []
    apply = cluster.index.apply
    cluster.index.apply = lambda name, stored, gone: (removed.extend(gone), apply(name, stored, gone))

    async def check() -> None:
        for p in probes:
            for hashes in (None, list(block_hashes(p))):
                found = await cluster.cached_prefix(p, hashes)
                truth = {n: await b.call("cached_prefix_len", p, timeout=30) for n, b in cluster.backends.items()}
                assert found == truth
                hits.extend(v for v in found.values() if v)

    async def serve(prompts: list[list[int]]) -> None:
        async def one(p):
            rid, _ = await cluster.submit(p, SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True))
            stream = cluster.streams[rid]
            while not stream.ended:
                await stream.take()
            assert stream.error is None
            cluster.leave(rid, True)

        await asyncio.gather(*(one(p) for p in prompts))

    async def main() -> None:
        cluster.start(asyncio.get_running_loop())
        for _ in range(4):
            await serve([rng.choice(probes) for _ in range(5)])
            await check()
        await cluster.warm(stems[1])
        await check()
        assert removed and hits  # blocks were evicted, and prefixes found
        assert await cluster.reset_prefix_cache() == {"a": True, "b": True}
        await check()
        assert all(not held for held in cluster.index.held.values())
        await cluster.warm(stems[0])
        await serve(probes[:4])
        old = cluster.backends["a"].process.pid
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 180
        while cluster.backends["a"].process.pid == old or not cluster.serving("a"):
            assert time.monotonic() < deadline, "worker a was not restarted"
            await asyncio.sleep(0.1)
        await check()  # the new worker holds the warmed prefix only, and so does its index
        assert (await cluster.cached_prefix(stems[0] + [1]))["a"] == 32
        await serve(probes)
        await check()

    try:
        cluster.wait_ready(180)
        asyncio.run(main())
    finally:
        cluster.shutdown()
